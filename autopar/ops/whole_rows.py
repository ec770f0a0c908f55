"""The gradient sum of a fused projection's blocks that every tensor-parallel rank keeps whole.

A fused QKV projection with a single KV head (multi-query attention, GPT-BigCode's ``c_attn``)
under KV-head replication is laid out block by block (``ParamShard.whole``,
``passes/tensor_parallel.py``): each rank holds its share of the query block and the key and
value blocks whole.  The query rows' gradient is then this rank's own, but the key and value
rows' gradient is a partial sum over tp (each rank's query heads read the whole KV head), so
those rows alone must be summed over the axis.  The passes insert :func:`sum_whole_rows` on the
parameter right before its use: forward is the identity, backward all-reduces the whole blocks'
rows of the gradient (one call per tensor, phase ``bwd``) and passes the sharded rows as they are.

A tensor whose channels are a concatenation of parts each split over tp (a linear-attention mixer's
``cat((q, k, v))`` before its depthwise convolution) is laid out block by block as well: a
replicated operand that meets it (the convolution's weight) is cut by :func:`local_blocks`, this
rank's share of every block, side by side; backward puts the gradient back at those rows and
zeros elsewhere (a partial sum over tp, which gradient placement marks and the DP pass sums).
A dim holding the heads merged behind the batch ([b * heads, ...], runs of ``heads``) meets a
replicated operand the same way (Bloom's ALiBi bias over every head): :func:`local_runs` cuts
this rank's share of every run.

Neighbours: :mod:`autopar.ops.collectives` (the recorder, the groups), its placement rule in
``passes/op_rules.py``, its gradient check in ``passes/gradient_placement.py``, and the cost
model's row for it (``cost/comm.py``, ``FUSED_KV``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.ops.collectives import find_group, record

__all__ = ["sum_whole_rows", "whole_numel", "local_blocks", "local_runs"]


def _local_sizes(sizes, whole, n: int) -> list[int]:
    return [s if w else s // n for s, w in zip(sizes, whole)]


def whole_numel(shape, dim: int, sizes, whole) -> int:
    """Elements of the whole blocks of a tensor of ``shape`` (blocks ``sizes`` along ``dim``)."""
    rest = 1
    for i, s in enumerate(shape):
        rest *= int(s) if i != dim else 1
    return rest * sum(s for s, w in zip(sizes, whole) if w)


class _SumWholeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, dim, sizes, whole, axis, tag):
        ctx.dim, ctx.sizes, ctx.whole, ctx.axis, ctx.tag = dim, sizes, whole, axis, tag
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        g = find_group(ctx.axis)
        if g is None or g.size == 1:
            return grad, None, None, None, None, None
        out = grad.contiguous().clone()
        parts = out.split(_local_sizes(ctx.sizes, ctx.whole, g.size), dim=ctx.dim)
        kept = [p for p, w in zip(parts, ctx.whole) if w]
        flat = torch.cat([p.reshape(-1) for p in kept])
        record("all_reduce", ctx.axis, flat, "bwd", ctx.tag)
        dist.all_reduce(flat, group=g.group)
        offset = 0
        for p in kept:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out, None, None, None, None, None


def sum_whole_rows(w: torch.Tensor, dim: int, sizes: list[int], whole: list[bool], axis: str,
                   tag: str = "") -> torch.Tensor:
    """``w`` as is; backward sums the gradient of its whole blocks (``sizes`` along ``dim``, global
    sizes; ``whole`` per block) over ``axis`` and keeps the sharded blocks' rows."""
    return _SumWholeRows.apply(w, dim, list(sizes), list(whole), axis, tag)


def _ranks(axis: str) -> tuple[int, int]:
    """(ranks on ``axis``, this rank's index): (1, 0) outside a process group."""
    g = find_group(axis)
    return (g.size, g.rank) if g is not None else (1, 0)


class _LocalBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, sizes, axis, whole):
        n, rank = _ranks(axis)
        ctx.dim, ctx.shape, ctx.sizes, ctx.n, ctx.rank, ctx.whole = dim, x.shape, sizes, n, rank, whole
        parts = [p if kept else p.chunk(n, dim=dim)[rank] for p, kept in zip(x.split(sizes, dim=dim), whole)]
        return torch.cat(parts, dim=dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.shape)
        local = [s if kept else s // ctx.n for s, kept in zip(ctx.sizes, ctx.whole)]
        start = 0
        for size, kept, piece in zip(ctx.sizes, ctx.whole, grad.split(local, dim=ctx.dim)):
            at = start if kept else start + ctx.rank * piece.shape[ctx.dim]
            out.narrow(ctx.dim, at, piece.shape[ctx.dim]).copy_(piece)
            start += size
        return out, None, None, None, None


def local_blocks(x: torch.Tensor, dim: int, sizes: list[int], axis: str,
                 whole: list[bool] | None = None) -> torch.Tensor:
    """This rank's share of each block (``sizes`` along ``dim``, global sizes) of a replicated ``x``,
    concatenated in block order (no communication); a block flagged in ``whole`` is taken whole
    (shared by every rank: a Mamba-2 mixer's B and C channels).  Backward puts the gradient back at
    those rows, zeros elsewhere."""
    return _LocalBlocks.apply(x, dim, list(sizes), axis, list(whole or [False] * len(sizes)))


class _LocalRuns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, run, axis):
        n, rank = _ranks(axis)
        ctx.dim, ctx.shape, ctx.run, ctx.n, ctx.rank = dim, x.shape, run, n, rank
        runs = x.unflatten(dim, (-1, run))
        return runs.narrow(dim + 1, rank * (run // n), run // n).flatten(dim, dim + 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_zeros(ctx.shape)
        part = ctx.run // ctx.n
        out.unflatten(ctx.dim, (-1, ctx.run)).narrow(ctx.dim + 1, ctx.rank * part, part).copy_(
            grad.unflatten(ctx.dim, (-1, part)))
        return out, None, None, None


def local_runs(x: torch.Tensor, dim: int, run: int, axis: str) -> torch.Tensor:
    """This rank's share of every run of ``run`` elements along ``dim`` of a replicated ``x`` (no
    communication); backward puts the gradient back at those elements, zeros elsewhere."""
    return _LocalRuns.apply(x, dim, int(run), axis)
