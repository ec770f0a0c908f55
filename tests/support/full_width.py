"""One rank at full width under torch's own meters: its peak memory and FLOPs beside the cost model.

:func:`measure` builds a preset at full width on the meta device, compiles it as one rank of a fake
process group of the plan's world and steps it under torch's meters, entered outside autopar's
step, as any user's code may: autopar/verification/full_width.py (``measure_step``) says how and why
in that order (a warm-up step; MemTracker around the second, tracking the program, its optimizer
and the tensors it steps; FlopCounterMode around the third), and registers FLOP formulas for
transformers' grouped expert GEMMs, which FlopCounterMode has none for.

What comes back: the measured peak and FLOPs, and ``Cost.peak_memory(pp_rank)``,
``Cost.flops(pp_rank)`` and the peak's breakdown of the same shapes, dtype and plan.
Its user: tests/e2e/test_full_width.py (each case in a subprocess, so the fake group stays there).
"""
from __future__ import annotations

import time

import autopar
from autopar.verification.full_width import compile_rank, fake_world, measure_step
from autopar.verification.scale import model_spec

__all__ = ["measure"]


def measure(plan: str, layers: int, rank: int, *, model: str = "llama3-70b", mixed_precision: str | None = None,
            seq: int = 8192, microbatch: int = 1) -> dict:
    """Rank ``rank`` of ``plan`` stepped under MemTracker and FlopCounterMode (the module docstring),
    with the cost model's prediction for its pp rank."""
    import torch

    p = autopar.Plan.parse(plan)
    spec = model_spec(model, layers)
    with fake_world(p.world_size, rank):
        start = time.perf_counter()
        pm, ids = compile_rank(spec, plan, seq, microbatch, mixed_precision=mixed_precision)
        compiled = time.perf_counter() - start
        measured = measure_step(pm, ids)
        peak, flops, by_op = measured["peak"], measured["flops"], measured["flops_by_op"]
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
