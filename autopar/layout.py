"""Cut full tensors into a rank's local shards, and put shards back together.

A parameter's layout is a :class:`autopar.passes.context.ParamShard` per mesh axis: the
dim it is sharded along and, for fused projections, the blocks of that dim that are each
sharded on their own (so rank r keeps its part of q, of k and of v).  The runtime uses
:func:`shard_local` to build its parameters from the user's model and to load state
dicts, and :func:`gather_full` to rebuild the full tensors for ``state_dict()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["shard_local", "gather_full"]


def _blocks(t: torch.Tensor, shard) -> list[torch.Tensor]:
    return list(torch.split(t, list(shard.blocks), dim=shard.dim)) if shard.blocks else [t]


def shard_local(full: torch.Tensor, shards: dict, coords: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's piece of ``full``; ``coords`` maps axis -> (rank on axis, axis size)."""
    t = full
    for axis, shard in shards.items():
        rank, size = coords.get(axis, (0, 1))
        parts = [torch.chunk(b, size, dim=shard.dim)[rank] for b in _blocks(t, shard)]
        t = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
    return t.contiguous()


def gather_full(local: torch.Tensor, shards: dict, groups: dict, coords: dict) -> torch.Tensor:
    """Inverse of :func:`shard_local`: all-gather the pieces over each sharded axis."""
    t = local
    for axis, shard in reversed(list(shards.items())):
        rank, size = coords.get(axis, (0, 1))
        if size == 1:
            continue
        pieces = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(pieces, t.contiguous(), group=groups[axis].group)
        if shard.blocks:
            local_blocks = [b // size for b in shard.blocks]
            per_rank = [torch.split(p, local_blocks, dim=shard.dim) for p in pieces]
            t = torch.cat([torch.cat([pr[i] for pr in per_rank], dim=shard.dim)
                           for i in range(len(shard.blocks))], dim=shard.dim)
        else:
            t = torch.cat(pieces, dim=shard.dim)
    return t
