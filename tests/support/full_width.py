"""One rank at full width under torch's own meters: its peak memory and FLOPs beside the cost model.

:func:`measure` builds a preset at full width on the meta device and compiles it with
``autopar.parallelize`` as one rank of a fake process group of the plan's world
(tests/support/scale.py: :func:`~tests.support.scale.fake_world`,
:func:`~tests.support.scale.compile_rank`), then steps it three times, the meters entered here,
outside autopar:

1. a warm-up step: from its optimizer step on, the optimizer's state exists, as in every later
   step (the cost model prices a step in steady state);
2. ``with MemTracker() as mt: pm.train_step(...)``, ``mt.track_external(pm.gm, pm.optimizer,
   *stepped)``: the peak of ``mt.get_tracker_snapshot("peak")``.  ``stepped`` are the tensors the
   optimizer steps (``param_groups``): MemTracker sees a tensor made before it was entered only
   when ``track_external`` names it or an op makes it, and it reads an optimizer's ``state`` only,
   so the fp32 masters of mixed precision (not module parameters) would stay unseen until the
   optimizer step updates them in place;
3. ``with FlopCounterMode() as fc: pm.train_step(...)``: ``fc.get_total_flops()``.  A step of its
   own: FlopCounterMode's module tracker keeps gradients alive in its hooks and, entered inside
   MemTracker, decomposes ops it has no formula for (``silu_backward``), so the two meters around
   one step measure a peak no GPU has (+3% and +7.5% on a full-recompute rank).

FlopCounterMode has no formula for the grouped GEMMs of transformers' MoE experts (aten's
``_grouped_mm``, which Mixtral's experts call in bf16, and ``transformers::grouped_mm_fallback``
and its backward, in fp32), so :func:`measure` registers them with torch's public
``register_flop_formula``: 2*rows*in*out forward, twice that backward (an input and a weight
gradient), as for any GEMM.

What comes back: the measured peak and FLOPs, and ``Cost.peak_memory(pp_rank)``,
``Cost.flops(pp_rank)`` and the peak's breakdown of the same shapes, dtype and plan.
Its user: tests/e2e/test_full_width.py (each case in a subprocess, so the fake group stays there).
"""
from __future__ import annotations

import functools
import time

import autopar
from tests.support.scale import compile_rank, fake_world, model_spec

__all__ = ["measure", "register_grouped_mm_flops"]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``torch._grouped_mm``: each group's rows by its matrix, 2*M*K*N summed over the groups, for
    every layout it takes (2-D x 3-D: tokens by their expert's weights; 2-D x 2-D with offsets: one
    weight gradient per group; 3-D x 2-D; 3-D x 3-D, batched)."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]


@functools.lru_cache(maxsize=1)
def register_grouped_mm_flops() -> bool:
    """FlopCounterMode formulas for the grouped expert GEMMs (once per process, after transformers
    is imported): aten's ``_grouped_mm`` (what transformers calls for bf16 experts; its backward is
    ``_grouped_mm`` again) and transformers' ``grouped_mm_fallback`` and its backward."""
    import torch
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    if torch.ops.aten._grouped_mm not in flop_registry:  # torch may come to count it itself
        register_flop_formula(torch.ops.aten._grouped_mm)(_grouped_mm_flops)
    ops = getattr(torch.ops, "transformers", None)
    if ops is None or not hasattr(ops, "grouped_mm_fallback"):
        return False

    @register_flop_formula(ops.grouped_mm_fallback)
    def _forward(x_shape, w_shape, offs_shape, *args, out_shape=None, **kwargs) -> int:
        return 2 * x_shape[0] * x_shape[1] * w_shape[2]          # rows x in x out, each row by its expert

    @register_flop_formula(ops.grouped_mm_fallback_backward)
    def _backward(x_shape, w_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
        return 4 * x_shape[0] * x_shape[1] * w_shape[2]          # the input's and the weights' gradients

    return True


def measure(plan: str, layers: int, rank: int, *, model: str = "llama3-70b", mixed_precision: str | None = None,
            seq: int = 8192, microbatch: int = 1) -> dict:
    """Rank ``rank`` of ``plan`` stepped under MemTracker and FlopCounterMode (the module docstring),
    with the cost model's prediction for its pp rank."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    p = autopar.Plan.parse(plan)
    spec = model_spec(model, layers)
    with fake_world(p.world_size, rank):
        start = time.perf_counter()
        pm, ids = compile_rank(spec, plan, seq, microbatch, mixed_precision=mixed_precision)
        compiled = time.perf_counter() - start
        register_grouped_mm_flops()                                   # transformers is imported by now
        pm.train_step((ids,), ids)                                    # warm-up: the optimizer's state
        stepped = [t for group in pm.optimizer.param_groups for t in group["params"]]
        mt = MemTracker()
        mt.track_external(pm.gm, pm.optimizer, *stepped)
        with mt:
            pm.train_step((ids,), ids)
        peak = max(snap["Total"] for snap in mt.get_tracker_snapshot("peak").values())
        with FlopCounterMode(display=False) as fc:
            pm.train_step((ids,), ids)
        flops = fc.get_total_flops()
        by_op = {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}
        pp_rank = pm.coords().get("pp", (0, 1))[0]
        stepped_seconds = time.perf_counter() - start - compiled
    cost = autopar.estimate(spec, autopar.Cluster.for_world("h100", p.world_size), plan, seq_len=seq,
                            global_batch=ids.shape[0], dtype_bytes=2 if mixed_precision else 4)
    breakdown = cost.peak_breakdown(pp_rank)
    return {"plan": plan, "rank": rank, "pp_rank": pp_rank, "mixed_precision": mixed_precision,
            "measured_peak": peak, "predicted_peak": cost.peak_memory(pp_rank),
            "measured_flops": flops, "predicted_flops": cost.flops(pp_rank), "flops_by_op": by_op,
            "moment": breakdown.moment, "terms": {t: alive for t, (_, alive) in breakdown.terms.items() if alive},
            "compile_seconds": compiled, "step_seconds": stepped_seconds, "torch": torch.__version__}
