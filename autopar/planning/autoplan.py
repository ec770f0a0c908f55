"""``parallelize(..., plan="auto")``: choose the plan with the cost model, for this world.

The model's dimensions come from the traced graph (``autopar.frontend.analyze``), the hardware
from the current device (an H100/H200/A100 by its CUDA name, else the ``cpu`` preset),
the world size from the process group, and the sequence and global batch from the
example inputs (pass a representative batch).  Every plan the runtime can execute for
this world is scored with ``autopar.estimate``; the fastest one that fits in memory wins.
The space is small (factorisations of the world into dp x tp, SP on or off, micro-batch
counts, ZeRO stages the runtime supports), so each candidate is estimated directly.

Neighbours: :mod:`autopar.runtime` calls :func:`choose_plan`; the search over every
dimension for clusters is :mod:`autopar.search`.
"""
from __future__ import annotations

import itertools
import logging

import torch

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.support import moe_needs_rewrite, unsupported

__all__ = ["choose_plan", "local_gpu", "predict_step"]

log = logging.getLogger("autopar.planning.autoplan")


def local_gpu() -> str:
    """The cost model's GPU preset for this machine."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(world: int, global_batch: int, num_experts: int = 0) -> list[Plan]:
    plans = []
    for tp in _divisors(world):
        dp = world // tp
        # MoE blocks run on sequence shards: with experts, tp needs sp
        sps = ((True,) if num_experts else (False, True)) if tp > 1 else (False,)
        mbs = _divisors(global_batch // dp) if global_batch % dp == 0 else ()
        zeros = (0, 1, 2, 3) if dp > 1 else (0,)
        eps = [e for e in _divisors(dp) if num_experts % e == 0] if num_experts else (1,)
        for sp, mb, zero, ep in itertools.product(sps, mbs, zeros, eps):
            try:
                plan = Plan(dp=dp, tp=tp, sp=sp, mb=mb, zero=zero, ep=ep)
            except (ValueError, TypeError):
                continue
            if unsupported(plan, moe_rewrite=bool(num_experts) and moe_needs_rewrite(plan)):
                continue
            plans.append(plan)
    return plans


def _spec_and_cluster(structure, world: int):
    from autopar.cost import Cluster, ModelSpec
    from autopar.frontend.analyze import structure_dims

    spec = ModelSpec(name="traced", **{**structure_dims(structure), "num_layers": max(1, structure.num_layers)})
    cluster = Cluster.for_world(local_gpu(), world) if world <= 8 or world % 8 == 0 else Cluster(
        gpu=local_gpu(), num_nodes=1, gpus_per_node=world)
    return spec, cluster


def predict_step(structure, plan: Plan, seq_len: int, global_batch: int, *, dtype_bytes: int = 2) -> dict[str, float]:
    """The cost model's step time, MFU and tokens/s of ``plan`` on this machine's GPUs
    (``pm.last_step_stats``); empty on a CPU, whose figures the model is not calibrated for."""
    if local_gpu() == "cpu":
        return {}
    from autopar.cost import estimate

    spec, cluster = _spec_and_cluster(structure, plan.world_size)
    try:
        cost = estimate(spec, cluster, plan, seq_len=seq_len, global_batch=global_batch, dtype_bytes=dtype_bytes)
    except ValueError:
        return {}
    return {"predicted_seconds": cost.step_time, "predicted_mfu": cost.mfu,
            "predicted_tokens_per_s": seq_len * global_batch / cost.step_time}


def choose_plan(structure, world: int, seq_len: int, global_batch: int, *,
                dtype_bytes: int = 4) -> Plan:
    """The fastest runtime-supported plan for ``world`` ranks that fits, by the cost model."""
    from autopar.cost import estimate

    spec, cluster = _spec_and_cluster(structure, world)
    best = None
    for plan in _candidates(world, global_batch, spec.num_experts):
        try:
            plan.validate(world_size=world, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                          vocab=spec.vocab if plan.tp > 1 else None, global_batch=global_batch)
            cost = estimate(spec, cluster, plan, seq_len=seq_len, global_batch=global_batch,
                            dtype_bytes=dtype_bytes)
        except ValueError:
            continue
        key = (not cost.fits, cost.step_time)
        if best is None or key < best[0]:
            best = (key, plan, cost)
    if best is None:
        raise AutoparError(f"autopar: plan='auto' found no plan the runtime supports for {world} ranks, "
                           f"a global batch of {global_batch} and this model; pass a plan explicitly.")
    _, plan, cost = best
    log.info("plan='auto' chose %s: predicted %.3f s/step, %.1f GiB per GPU", plan, cost.step_time,
             cost.memory_per_gpu / 2**30)
    return plan
