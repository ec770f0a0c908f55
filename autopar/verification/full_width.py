"""One rank of a full-size model, built on the meta device, stepped under torch's own meters.

The engine of ``autopar explain --simulate`` and ``autopar plan --check`` (autopar/cli/simulate_cmd.py)
and of the suite's scale checks (autopar/verification/scale.py, tests/support/full_width.py,
tests/e2e/test_full_width.py):

* :func:`meta_model`: a preset of ``autopar.ModelSpec`` as a transformers model on the meta device
  (``LlamaForCausalLM``; ``MixtralForCausalLM`` for a preset with an MoE block in every layer);
* :func:`fake_world`: this process as one rank of torch's fake process group (every collective a
  no-op), so that ``autopar.parallelize`` compiles the rank's own program;
* :func:`compile_rank`: the model compiled for a plan as that rank, with the global batch;
* :func:`measure_step`: a warm-up step (the optimizer's state exists from its optimizer step on,
  as in every later step), then one step under ``MemTracker`` (tracking the program, its optimizer
  and the tensors it steps: the fp32 masters of mixed precision are no module parameters), then one
  under ``FlopCounterMode``.  Two steps, not one under both: FlopCounterMode's module tracker keeps
  gradients alive and decomposes ops it has no formula for, a peak no GPU has.

What the step allocates is what the target device would: parameters, gradients and optimizer
state with their sizes, the fused attention kernel a GPU runs (autopar/ops/fused_attention.py),
ZeRO-3's prefetches.  Neighbours: autopar/cost (the prediction it is set against).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import AutoparError

__all__ = ["meta_model", "simulated_spec", "fake_world", "compile_rank", "measure_step",
           "register_grouped_mm_flops"]


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def simulated_spec(spec, layers: int | None = None):
    """``spec`` with ``layers`` layers (if given), refused unless :func:`meta_model` can build it."""
    if spec.is_moe and (spec.moe_layer_freq != 1 or spec.num_shared_experts or spec.first_dense_layers):
        raise AutoparError(f"autopar: {spec.name} mixes dense and MoE layers (or has shared experts); the "
                           "full-width simulation builds dense models and MoE models with an MoE block in "
                           "every layer (mixtral-8x7b). Price it with autopar.estimate instead.")
    return dataclasses.replace(spec, num_layers=layers) if layers else spec


def meta_model(spec, seq: int):
    """``spec`` as a transformers model on the current device (call under ``torch.device("meta")``)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    except ImportError as exc:
        raise AutoparError("autopar: the full-width simulation (--simulate, --check) builds the model with "
                           "transformers, which is not installed; install it: pip install -e '.[test]' "
                           "(or pip install transformers==5.25.0)") from exc

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads or spec.num_heads,
                  head_dim=spec.head_dim, max_position_embeddings=seq, tie_word_embeddings=spec.tied_embeddings,
                  attn_implementation="sdpa")
    if spec.is_moe:
        return MixtralForCausalLM(MixtralConfig(intermediate_size=spec.moe_ffn or spec.ffn,
                                                num_local_experts=spec.num_experts,
                                                num_experts_per_tok=spec.top_k, **common))
    return LlamaForCausalLM(LlamaConfig(intermediate_size=spec.ffn, **common))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """This process as rank ``rank`` of torch's fake process group of ``world_size`` ranks (every
    collective a no-op), destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise AutoparError(f"autopar: rank {rank} is outside the plan's world of {world_size} ranks")
    if dist.is_initialized():
        raise AutoparError("autopar: the full-width simulation needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_rank(spec, plan: str, seq: int, microbatch: int, *, bucket_bytes: int | None = None,
                 mixed_precision: str | None = None):
    """``spec`` built on the meta device and compiled by ``autopar.parallelize`` for ``plan`` as this
    rank of the fake world (:func:`fake_world`); returns ``(pm, ids)``, ``ids`` the global batch of
    ``microbatch * dp * mb`` sequences of ``seq`` tokens (meta)."""
    from autopar.plan import Plan
    from autopar.plan_space import DEFAULT_BUCKET_BYTES
    from autopar.runtime import parallelize

    p = Plan.parse(plan)
    with torch.device("meta"):
        net = meta_model(spec, seq)
    ids = torch.zeros(microbatch * p.dp * p.mb, seq, dtype=torch.long, device="meta")
    pm = parallelize(net, (ids,), example_kwargs={"use_cache": False}, plan=plan, loss_fn=_loss,
                             bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES, mixed_precision=mixed_precision)
    return pm, ids


def measure_step(pm, ids) -> dict:
    """The rank's peak memory by ``MemTracker`` (and its categories) and its FLOPs by
    ``FlopCounterMode`` (and per op), each around a step of its own after a warm-up step."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    register_grouped_mm_flops()                                   # transformers is imported by now
    pm.train_step((ids,), ids)                                    # warm-up: the optimizer's state
    stepped = [t for group in pm.optimizer.param_groups for t in group["params"]]
    mt = MemTracker()
    mt.track_external(pm.gm, pm.optimizer, *stepped)
    with mt:
        pm.train_step((ids,), ids)
    snapshot = mt.get_tracker_snapshot("peak")
    device = max(snapshot, key=lambda dev: snapshot[dev]["Total"])
    categories = {str(k).split(".")[-1].lower(): v for k, v in snapshot[device].items() if k != "Total"}
    with FlopCounterMode(display=False) as fc:
        pm.train_step((ids,), ids)
    return {"peak": snapshot[device]["Total"], "categories": categories, "flops": fc.get_total_flops(),
            "flops_by_op": {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}}


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
    is imported), which it has none for: aten's ``_grouped_mm`` (what transformers calls for bf16
    experts; its backward is ``_grouped_mm`` again) and transformers' ``grouped_mm_fallback`` and its
    backward (fp32), 2*rows*in*out forward and twice that backward, as for any GEMM."""
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
