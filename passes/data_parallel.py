"""Data parallelism: gradient synchronisation buckets over ``dp`` (and partial-gradient axes).

Every rank of a ``dp`` group runs the same program on its slice of the batch, so the graph
itself does not change.  What changes is what happens after backward: each gradient is
averaged over ``dp``; gradients that shard propagation found to be partial sums over
another axis (e.g. norm weights on sequence shards under SP, axis ``tp``) are first summed
over that axis.  Gradients are grouped into buckets of at most ``bucket_bytes`` local bytes,
in reverse parameter order (the order backward produces them), one collective per bucket;
the packing rule is :func:`autopar.plan_space.pack_buckets`, which the cost model
(``cost/buckets.py``) counts with too.

The runtime (:mod:`autopar.runtime`) executes the buckets; this pass only decides them, so
they can be printed with the program and counted by the cost model.
"""
from __future__ import annotations

from torch.fx import GraphModule

from autopar.plan_space import data_axis, pack_buckets

from .context import GradBucket, PassContext, PassResult

__all__ = ["data_parallel_pass", "local_param_bytes"]


def local_param_bytes(gm: GraphModule, ctx: PassContext, name: str) -> int:
    p = gm.get_parameter(name)
    shards = ctx.param_shards.get(name, {})
    nbytes = p.numel() * p.element_size()
    for axis, shard in shards.items():
        n = ctx.axis_sizes[axis]
        # blocks kept whole (a fused QKV's KV head): this rank holds them and its share of the rest
        nbytes = nbytes * sum(shard.local_blocks(n)) // p.shape[shard.dim] if shard.whole else nbytes // n
    return nbytes  # an owner-held tensor (an expert): the average over the axis


def _buckets(gm: GraphModule, ctx: PassContext, names: list[str], axis: str, average: bool,
             cap: int, divisor: int | None = None) -> list[GradBucket]:
    """``names`` packed into buckets of at most ``cap`` local bytes, in backward's (reverse) order."""
    order = list(reversed(names))
    sizes = [local_param_bytes(gm, ctx, name) for name in order]
    return [GradBucket(axis, tuple(order[i] for i in run), average, sum(sizes[i] for i in run), divisor)
            for run in pack_buckets(sizes, cap)]


def data_parallel_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("data_parallel_pass")
    cap = ctx.bucket_bytes
    experts = set(ctx.expert_params)
    all_names = [n for n, p in gm.named_parameters() if p.requires_grad]
    names = [n for n in all_names if n not in experts]
    buckets = result.grad_buckets
    partial_axes = sorted({a for axes in ctx.grad_partial_axes.values() for a in axes})
    for axis in partial_axes:
        members = [n for n in names if axis in ctx.grad_partial_axes.get(n, set())]
        buckets += _buckets(gm, ctx, members, axis, False, cap)
    cp = ctx.axis_sizes.get("cp", 1)
    dp_cp = ctx.axis_sizes.get("dp", 1) * cp  # the degree of dp*cp
    if dp_cp > 1:  # dense weights are replicated over dp*cp ranks
        buckets += _buckets(gm, ctx, names, data_axis(cp), True, cap)
    moe = [n for n in all_names if n in experts]
    if moe and (dp_cp > 1 or ctx.axis_sizes.get("tp", 1) > 1):
        # An expert's gradient on its owner sums every token routed to it from the ep group;
        # summed over the ranks holding the same experts (edp: the other dp*cp/ep token slices,
        # times tp under sp) it covers all dp*cp slices, so it is averaged by dp*cp.
        plain = ctx.axis_sizes.get("ep", 1) == 1 and ctx.axis_sizes.get("tp", 1) == 1
        axis = data_axis(cp) if plain else "edp"  # edp is dp*cp itself then
        buckets += _buckets(gm, ctx, moe, axis, True, cap, divisor=dp_cp)
    result.notes.append(f"{len(buckets)} gradient buckets")
    return result
