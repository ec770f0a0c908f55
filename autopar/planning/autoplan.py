"""``parallelize(..., plan="auto")``: choose the plan with the cost model, for this world.

The model's dimensions come from the traced graph (``autopar.frontend.analyze``), the hardware
from the hardware profile named by ``$AUTOPAR_HARDWARE_PROFILE`` (written by ``autopar calibrate``)
or else the current device (an H100/H200/A100 by its CUDA name, else the ``cpu`` preset),
the world size from the process group (a CPU profile's host holds ``$LOCAL_WORLD_SIZE`` ranks, which
time-share its cores: :func:`autopar.cost.profile.host_share`), and the sequence and global batch from the
example inputs (pass a representative batch).  :func:`estimate_step` is the same model's estimate of
the plan a program runs (``pm.predicted_cost``, ``pm.last_step_stats``).  :func:`choose_plan` is the search
(:mod:`autopar.planning.search`) restricted to what this world allows: its world size and
the plans the runtime runs (``runnable=True``, the rules of :mod:`autopar.plan_space` that
``parallelize`` checks); the fastest plan that fits in memory wins (the fastest of all if none fits).

Neighbours: :mod:`autopar.runtime` calls :func:`choose_plan`.
"""
from __future__ import annotations

import logging
import os

import torch

from autopar.errors import AutoparError
from autopar.plan import Plan

__all__ = ["choose_plan", "local_gpu", "estimate_step", "predict_step", "step_prediction", "PROFILE_ENV"]

PROFILE_ENV = "AUTOPAR_HARDWARE_PROFILE"
"""The environment variable naming a hardware profile (``autopar calibrate``) for ``plan="auto"``."""

log = logging.getLogger("autopar.planning.autoplan")


def local_gpu() -> str:
    """The cost model's GPU preset for this machine."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((g for g in ("h200", "h100", "a100") if g in name), "h100")


def _spec_and_cluster(structure, world_size: int):
    from autopar.cost import Cluster, ModelSpec
    from autopar.cost.hardware import whole_nodes
    from autopar.cost.profile import load_profile
    from autopar.frontend.model_dims import structure_dims

    spec = ModelSpec(name="traced", **{**structure_dims(structure), "num_layers": max(1, structure.num_layers)})
    # The ranks on one host: torchrun's LOCAL_WORLD_SIZE (whole nodes by construction), else the
    # profile's or the preset's node; how they fill nodes is one rule (cost.hardware.whole_nodes).
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    if os.environ.get(PROFILE_ENV):
        path = os.environ[PROFILE_ENV]
        data = load_profile(path)
        if data.get("host_cores"):  # a CPU host: the ranks started on it share its cores
            local = local or world_size
        num_nodes, per_node = whole_nodes(world_size, local or data["gpus_per_node"])
        return spec, Cluster.from_profile(path, num_nodes=num_nodes, gpus_per_node=per_node)
    return spec, Cluster.for_world(local_gpu(), world_size, gpus_per_node=local or None)


def estimate_step(structure, plan: Plan, seq_len: int, global_batch: int, *, dtype_bytes: int = 2,
                  any_hardware: bool = False):
    """The cost model's :class:`autopar.cost.Cost` of ``plan`` on this machine (``pm.predicted_cost``);
    None on a CPU without a hardware profile (``$AUTOPAR_HARDWARE_PROFILE``): the ``cpu`` preset's
    figures are no measurement of this machine (``any_hardware``: priced with them all the same,
    ``pm.report``'s memory and bytes)."""
    if local_gpu() == "cpu" and not os.environ.get(PROFILE_ENV) and not any_hardware:
        return None
    from autopar.cost import estimate

    try:  # a plan the cost model refuses (or ranks that fill no whole nodes) has no prediction
        spec, cluster = _spec_and_cluster(structure, plan.world_size)
        return estimate(spec, cluster, plan, seq_len=seq_len, global_batch=global_batch, dtype_bytes=dtype_bytes)
    except ValueError as exc:
        log.info("no step prediction for plan %s: %s", plan, exc)
        return None


def predict_step(structure, plan: Plan, seq_len: int, global_batch: int, *, dtype_bytes: int = 2) -> dict[str, float]:
    """The cost model's step time, MFU and tokens/s of ``plan`` on this machine's GPUs, or on the
    machine a hardware profile measured (``pm.last_step_stats``); empty where :func:`estimate_step` is None."""
    return step_prediction(estimate_step(structure, plan, seq_len, global_batch, dtype_bytes=dtype_bytes))


def step_prediction(cost) -> dict[str, float]:
    """``cost``'s step time, MFU and tokens/s under ``pm.last_step_stats``' keys (empty for None)."""
    if cost is None:
        return {}
    return {"predicted_seconds": cost.step_time, "predicted_mfu": cost.mfu,
            "predicted_tokens_per_s": cost.tokens_per_s}


def choose_plan(structure, world_size: int, seq_len: int, global_batch: int, *,
                dtype_bytes: int = 4) -> Plan:
    """The fastest plan for ``world_size`` ranks that the runtime runs and that fits, by the cost
    model's search (the fastest that the runtime runs if none fits)."""
    from autopar.planning.search import search

    spec, cluster = _spec_and_cluster(structure, world_size)
    options = dict(world_size=world_size, seq_len=seq_len, global_batch=global_batch, top=1,
                   runnable=True, dtype_bytes=dtype_bytes)
    try:
        found = search(spec, cluster, **options) or search(spec, cluster.replace(hbm_bytes=float("inf")),
                                                           **options)
    except AutoparError:
        found = []
    if not found:
        raise AutoparError(f"autopar: plan='auto' found no plan the runtime supports for {world_size} ranks, "
                           f"a global batch of {global_batch} and this model; pass a plan explicitly.")
    plan, cost = found[0]
    log.info("plan='auto' chose %s: predicted %.3f s/step, %.1f GiB per GPU", plan, cost.step_time,
             cost.memory_per_gpu / 2**30)
    return plan
