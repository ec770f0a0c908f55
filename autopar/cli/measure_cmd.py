"""Measured against predicted memory of one plan on this machine (``autopar explain --measure``).

:func:`measure_memory` spawns ``world_size`` local gloo processes; each loads
``MODULE:FUNCTION`` (:func:`autopar.cli.inspect_cmd.load_target`), compiles the model for the
plan (:func:`autopar.parallelize`, AdamW, the loss :func:`autopar.cli.inspect_cmd.lm_cross_entropy`
against the first input shifted left by one token), runs one ``train_step`` and returns
``pm.memory_report()`` (definitions in autopar/runtime/stepping/memory.py).  :func:`memory_comparison`
sets those reports against the cost model's memory terms (cost/memory.py) for the same
model (``ModelSpec.from_module``), sequence length and batch, fp32 (``dtype_bytes=4``),
and :func:`format_memory_comparison` prints the table.  autopar/cli/plan_cmd.py wires it into
``autopar explain``.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from autopar.errors import AutoparError
from autopar.verification.launch import run_spawned

__all__ = ["measure_memory", "predicted_memory", "memory_comparison", "format_memory_comparison",
           "measured_cost", "MEASURE_TIMEOUT_S"]

MEASURE_TIMEOUT_S = 600.0

# Cost-model memory terms (cost/memory.py) that make up each measured category.
_PREDICTED_PARTS = {
    "params": ("params",),
    "grads": ("grads",),
    "optimizer": ("optimizer",),
    "activations": ("activations", "embedding_activations", "head_activations", "recompute_buffer"),
}


def _shifted_target(inputs: tuple) -> torch.Tensor:
    ids = inputs[0] if inputs else None
    if not torch.is_tensor(ids) or ids.dim() < 2 or ids.is_floating_point():
        raise AutoparError(
            "autopar: --measure trains with next-token cross-entropy, so the first example input "
            f"must be integer token ids [batch, seq]; got {type(ids).__name__}"
            f"{'' if not torch.is_tensor(ids) else f' {ids.dtype} {tuple(ids.shape)}'}. "
            "Return a language model and its input_ids from MODULE:FUNCTION.")
    return torch.roll(ids, -1, dims=1)


def _measuring_rank(rank: int, world_size: int, port: int, target: str, plan: str, *, post) -> dict:
    """One spawned rank: join the gloo world, train one step, return ``pm.memory_report()``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=MEASURE_TIMEOUT_S))
    from autopar.cli.inspect_cmd import lm_cross_entropy, load_target
    from autopar.runtime import parallelize

    model, inputs, kwargs = load_target(target)
    pm = parallelize(model, inputs, example_kwargs=kwargs, plan=plan, loss_fn=lm_cross_entropy)
    pm.train_step(inputs, _shifted_target(inputs))
    return pm.memory_report()


def measure_memory(target: str, plan: str, world_size: int, timeout: float = MEASURE_TIMEOUT_S) -> list[dict]:
    """``memory_report()`` of every rank after one ``train_step`` of ``target`` under ``plan``."""
    return run_spawned(_measuring_rank, world_size, (target, plan), timeout=timeout,
                       what=f"measuring plan '{plan}' on {target}")


def predicted_memory(cost, pp_rank: int | None = None) -> dict[str, float]:
    """The cost model's bytes per measured category (activations: every activation term)."""
    terms = cost.memory(pp_rank)
    return {cat: sum(terms.get(part, 0.0) for part in parts) for cat, parts in _PREDICTED_PARTS.items()}


def memory_comparison(cost, reports: list[dict]) -> list[dict]:
    """Rows (category, predicted, measured, diff) for the ranks of the cost's fullest pp rank.

    Measured is the largest value over those ranks (ranks ``pp_rank * world_size/pp ...`` of the
    (pp, dp, cp, tp) mesh); ``diff`` is (measured - predicted) / predicted, ``None`` when
    nothing is predicted.  ``master_params`` (the fp32 masters of mixed precision, which the cost
    model counts in its optimizer term) has no cost-model term of its own.
    """
    plan = cost.plan
    pp_rank = cost.memory_pp_rank
    per_pp_rank = len(reports) // plan.pp
    ranks = reports[pp_rank * per_pp_rank:(pp_rank + 1) * per_pp_rank]
    predicted = predicted_memory(cost, pp_rank)
    rows = []
    for cat in ("params", "grads", "optimizer", "activations", "master_params"):
        measured = max(r.get(cat, 0) for r in ranks)
        pred = predicted.get(cat)
        diff = (measured - pred) / pred if pred else None
        rows.append(dict(category=cat, predicted=pred, measured=measured, diff=diff))
    return rows


def format_memory_comparison(rows: list[dict], plan: str, target: str, world_size: int) -> str:
    """The predicted-vs-measured table, bytes per rank."""
    out = [f"Memory per rank, predicted (cost model, fp32) vs measured (one train_step of {target} "
           f"under '{plan}' on {world_size} local gloo processes; largest rank of the fullest pp rank):",
           f"  {'category':<14} {'predicted':>12} {'measured':>12} {'difference':>11}"]
    for r in rows:
        pred = "-" if r["predicted"] is None else f"{r['predicted']:,.0f}"
        diff = "-" if r["diff"] is None else f"{r['diff'] * 100:+.1f}%"
        out.append(f"  {r['category']:<14} {pred:>12} {r['measured']:>12,} {diff:>11}")
    return "\n".join(out)


def measured_cost(target: str, plan_text: str, world: int | None, hardware: str | None, given=()):
    """``autopar report --measure``: the cost model's ``Cost`` of ``target``'s model under the plan on
    ``world`` CPU ranks (fp32; the model, sequence and batch from its example inputs) and the memory
    comparison rows of one measured step (:func:`memory_comparison`).  ``given``: (flag, value) pairs
    that --measure replaces, refused when set."""
    from autopar.cost import Cluster, ModelSpec, estimate
    from autopar.frontend.target import load_target
    from autopar.plan import Plan

    extra = [flag for flag, value in given if value is not None]
    if extra:
        raise AutoparError(f"autopar: --measure takes the model, sequence length and batch from {target}'s "
                           f"example inputs; drop {', '.join(extra)}")
    plan = Plan.parse(plan_text)
    if world != plan.world_size:
        raise AutoparError(f"autopar: plan '{plan}' uses pp*dp*cp*tp = {plan.world_size} processes but --world "
                           f"is {world}; pass --world {plan.world_size}")
    model, inputs, kwargs = load_target(target)
    ids = _shifted_target(inputs)  # checks the first input is token ids [batch, seq]
    cluster = (Cluster.from_profile(hardware, gpus_per_node=world) if hardware is not None
               else Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world))
    cost = estimate(ModelSpec.from_module(model, inputs, kwargs), cluster, plan, int(ids.shape[1]),
                    int(ids.shape[0]), dtype_bytes=4)
    return cost, memory_comparison(cost, measure_memory(target, str(plan), world))
