"""The device mesh and this rank's process groups, one per mesh axis.

The world is ``pp x dp x cp x tp``, outer to inner, so tp varies fastest and consecutive
ranks (one node, NVLink) form the tp groups (docs/architecture.md, "Mesh and ranks"); the
layout and the derived axes' rank groups are :mod:`autopar.plan_space`'s (:data:`MESH_AXES`,
:func:`autopar.plan_space.axis_groups`).  Groups come from ``init_device_mesh`` with named
axes; more are derived:

* ``dp_cp``: dense gradients and the loss are averaged over ``dp * cp`` ranks under CP;
* ``ep`` / ``edp``: expert parallelism folds over the ``dp * cp`` ranks of one stage
  (:func:`expert_groups`);
* ``world``: every rank, for the global gradient norm (:mod:`autopar.runtime.gradients.clipping`);
* ``pp_embed``: the first and last pipeline stage of an LM head tied to the embedding, which
  sum the copies' gradients (:func:`embedding_group`).

Neighbours: :class:`autopar.runtime.module.ParallelModule` owns the groups and hands them
to the step context (:mod:`autopar.ops.step`) that the program's operators read.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autopar.compat import flatten_mesh
from autopar.ops.step import AxisGroup
from autopar.plan_space import MESH_AXES, axis_groups

__all__ = ["MESH_AXES", "world", "build_groups", "expert_groups", "embedding_group", "local_device"]


def world() -> tuple[int, int]:
    """(world size, rank) of the default process group, (1, 0) without one."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def local_device() -> torch.device:
    """The device a rank computes on: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def expert_groups(plan) -> dict[str, AxisGroup]:
    """The ``ep`` groups (ranks of one stage and tp index holding different tokens, ep consecutive
    dp*cp indices) and the ``edp`` groups (ranks holding the same experts: the other dp*cp/ep
    token slices times tp), built on every rank in the same order."""
    out = {}
    for axis in ("ep", "edp"):
        lists = axis_groups(axis, **plan.degrees, ep=plan.ep)
        group, _ = dist.new_subgroups_by_enumeration(lists)
        size = len(lists[0])
        out[axis] = AxisGroup(group, size, dist.get_rank(group) if size > 1 else 0)
    return out


def build_groups(plan, *, experts: bool, tied_pp_ranks: tuple[int, ...] = ()) -> dict[str, AxisGroup]:
    """This rank's group on every axis the plan's program uses (empty without a process group).

    ``tied_pp_ranks``: the pp ranks holding copies of a tied embedding, which form the
    ``pp_embed`` groups (one per dp, cp, tp coordinate)."""
    if not dist.is_initialized():
        return {}
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, tuple(plan.degrees[a] for a in MESH_AXES), mesh_dim_names=MESH_AXES)
    groups = {a: AxisGroup(mesh.get_group(a), mesh.size(i), mesh.get_local_rank(a))
              for i, a in enumerate(MESH_AXES)}
    groups["world"] = AxisGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())  # the gradient norm
    if plan.cp > 1:  # dense gradients and the loss are averaged over dp*cp (cost model axis "dp_cp")
        flat = flatten_mesh(mesh, ("dp", "cp"), "dp_cp")
        groups["dp_cp"] = AxisGroup(flat.get_group(), flat.size(), flat.get_local_rank())
    if experts:
        groups.update(expert_groups(plan))
    if tied_pp_ranks:
        groups["pp_embed"] = embedding_group(plan, tied_pp_ranks)
    return groups


def embedding_group(plan, tied_pp_ranks: tuple[int, ...]) -> AxisGroup:
    """The ranks at pipeline indices ``tied_pp_ranks`` with this rank's dp, cp and tp indices
    (Megatron's embedding group), built on every rank in the same order."""
    lists = [[pp_group[i] for i in tied_pp_ranks] for pp_group in axis_groups("pp", **plan.degrees)]
    group, _ = dist.new_subgroups_by_enumeration(lists)
    me = dist.get_rank()
    inside = any(me in ranks_ for ranks_ in lists)
    return AxisGroup(group, len(tied_pp_ranks), dist.get_rank(group) if inside else -1)
