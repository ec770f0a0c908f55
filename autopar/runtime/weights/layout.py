"""Cut full tensors into a rank's local shards, and put shards back together.

A parameter's layout is a :class:`autopar.passes.context.ParamShard` per mesh axis: the
dim it is sharded along and, for fused projections, the blocks of that dim that are each
sharded on their own (so rank r keeps its part of q, of k and of v), or kept whole on every
rank (``ParamShard.whole``: a fused QKV's single KV head under KV-head replication).  The runtime uses
:func:`shard_local` to build its parameters from the user's model and to load state
dicts, and :func:`gather_full` to rebuild the full tensors for ``state_dict()``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["shard_local", "gather_full", "local_index", "padded_rows", "pad_piece", "unpad_piece"]


def padded_rows(size: int, n: int) -> int:
    """Rows per rank of a dim of ``size`` split over ``n`` ranks, padded up (vocabulary padding)."""
    return -(-size // n)


def _pad(t: torch.Tensor, shard, n: int) -> torch.Tensor:
    """``t`` zero-padded along ``shard.dim`` to ``n * ceil(size / n)`` rows (uneven vocabulary shards)."""
    if shard.size is None or t.shape[shard.dim] % n == 0:
        return t
    extra = padded_rows(t.shape[shard.dim], n) * n - t.shape[shard.dim]
    shape = list(t.shape)
    shape[shard.dim] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=shard.dim)


def _blocks(t: torch.Tensor, shard) -> list[torch.Tensor]:
    return list(torch.split(t, list(shard.blocks), dim=shard.dim)) if shard.blocks else [t]


def _whole(shard) -> tuple[bool, ...]:
    """Per block: kept whole on every rank (``ParamShard.whole``) rather than sharded."""
    return shard.whole or (False,) * len(shard.blocks or (None,))


def shard_local(full: torch.Tensor, shards: dict, coords: dict[str, tuple[int, int]]) -> torch.Tensor:
    """This rank's piece of ``full``; ``coords`` maps axis -> (rank on axis, axis size)."""
    t = full
    for axis, shard in shards.items():
        rank, size = coords.get(axis, (0, 1))
        if shard.owner is not None:
            t = t if rank == shard.owner or size == 1 else t.narrow(shard.dim, 0, 0)
            continue
        if shard.size is not None:
            t = _pad(t, shard, size)
        parts = [b if whole else torch.chunk(b, size, dim=shard.dim)[rank]
                 for b, whole in zip(_blocks(t, shard), _whole(shard))]
        t = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
    return t.contiguous()


def local_index(shape: tuple[int, ...], shards: dict, coords: dict[str, tuple[int, int]]) -> list[torch.Tensor | None]:
    """Which positions of the full tensor along each dim this rank's piece keeps (None: all),
    the same cut as :func:`shard_local` made on index vectors instead of the tensor, so a
    checkpoint reader can read just the piece."""
    kept: list[torch.Tensor | None] = [None] * len(shape)
    for axis, shard in shards.items():
        rank, size = coords.get(axis, (0, 1))
        dim = shard.dim
        idx = kept[dim] if kept[dim] is not None else torch.arange(shape[dim])
        if shard.owner is not None:
            idx = idx if rank == shard.owner or size == 1 else idx[:0]
        elif shard.size is not None and shard.size % size:
            per = padded_rows(shard.size, size)  # the padding rows are not in the full tensor
            idx = idx[rank * per:(rank + 1) * per]
        else:
            blocks = list(torch.split(idx, list(shard.blocks))) if shard.blocks else [idx]
            idx = torch.cat([b if whole else torch.chunk(b, size)[rank] for b, whole in zip(blocks, _whole(shard))])
        kept[dim] = idx
    return [None if k is not None and len(k) == n and bool((k == torch.arange(n)).all()) else k
            for k, n in zip(kept, shape)]


def pad_piece(piece: torch.Tensor, full_shape: tuple, shards: dict, coords: dict) -> torch.Tensor:
    """A piece read at :func:`local_index` padded with zero rows to this rank's local shape, which
    an uneven (vocabulary-padded) shard makes longer than the piece: what :func:`shard_local` cuts."""
    if not any(s.size is not None for s in shards.values()):
        return piece
    local = shard_local(torch.empty(full_shape, device="meta"), shards, coords).shape
    for dim, n in enumerate(local):
        if piece.shape[dim] < n:
            shape = list(piece.shape)
            shape[dim] = n - piece.shape[dim]
            piece = torch.cat([piece, piece.new_zeros(shape)], dim=dim)
    return piece


def unpad_piece(local: torch.Tensor, kept: tuple[int, ...]) -> torch.Tensor:
    """This rank's tensor without its padding rows: the first ``kept`` positions along each dim."""
    for dim, n in enumerate(kept):
        if local.shape[dim] != n:
            local = local.narrow(dim, 0, n)
    return local


def _broadcast_owned(t: torch.Tensor, shard, group, full_shape) -> torch.Tensor:
    assert full_shape is not None, "gathering an owner-held tensor needs its full shape"
    out = t if t.shape == tuple(full_shape) else t.new_empty(full_shape)
    dist.broadcast(out, group=group, group_src=shard.owner)
    return out


def gather_full(local: torch.Tensor, shards: dict, groups: dict, coords: dict,
                full_shape: tuple | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_local`: all-gather the pieces over each sharded axis.

    ``full_shape`` is needed for tensors held whole by one rank (``ParamShard.owner``)."""
    t = local
    for axis, shard in reversed(list(shards.items())):
        rank, size = coords.get(axis, (0, 1))
        if size == 1:
            continue
        if shard.owner is not None:
            t = _broadcast_owned(t, shard, groups[axis].group, full_shape)
            continue
        pieces = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(pieces, t.contiguous(), group=groups[axis].group)
        if shard.blocks:
            per_rank = [torch.split(p, list(shard.local_blocks(size)), dim=shard.dim) for p in pieces]
            t = torch.cat([per_rank[0][i] if whole else torch.cat([pr[i] for pr in per_rank], dim=shard.dim)
                           for i, whole in enumerate(_whole(shard))], dim=shard.dim)
        else:
            t = torch.cat(pieces, dim=shard.dim)
        if shard.size is not None and t.shape[shard.dim] != shard.size:
            t = t.narrow(shard.dim, 0, shard.size)  # drop the vocabulary padding
    return t
