"""Sharding rules for splits and concatenations: split, chunk, tensor_split, cat, stack, pad.

Splitting a sharded dim is exact only at the parts of a tensor laid out by blocks (a fused
projection, a concatenation of sharded parts: ``passes/block_layout.py``), each part's local
sizes then the rank's share; ``tensor_split`` at positions splits another dim only (a mixer's
sequence cut into chunks).  Concatenating along a sharded dim lays the result out by blocks;
along another dim, replicated parts are cut to the rank's slice.  Registered in the one registry
of ``passes/rules.py``.
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.frontend.op_sets import SPLIT_OPS
from .block_layout import BLOCKS_KEY, WHOLE_KEY, cat_blocks
from .rules import R, RuleContext, ndim_of, register, shape_of, size_expr
from .view_rules import block_edges

aten = torch.ops.aten

__all__ = ["split_rule", "tensor_split_rule", "cat_rule", "stack_rule", "pad_rule"]


@register(*SPLIT_OPS)
def split_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    num_out = len(node.meta["val"])
    if not isinstance(pl, Shard):
        return tuple([pl] * num_out)
    nd = ndim_of(node.args[0])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    if dim != pl.dim:
        return tuple([pl] * num_out)
    # Splitting the sharded dim is only right when the producer was sharded block by block
    # (a fused projection), so each local part is that rank's share of each global part.
    if not node.args[0].meta.get("autopar_blocks"):
        raise rc.fail(node, f"splits the sharded dim {dim} of a tensor that was not sharded block-wise",
                      "Fused projections must be recognised by the TP pass; report the model.")
    args = list(node.args)
    blocks = node.args[0].meta["autopar_blocks"]
    edges, local, whole = block_edges(node, blocks, rc)
    sizes = [int(size_expr(v.shape[dim])) for v in node.meta["val"]]
    cuts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    if len(sizes) < len(blocks) and set(cuts) <= set(edges) and node.target == aten.split_with_sizes.default:
        return _split_groups(node, dim, cuts, edges, local, whole, pl)
    if [size_expr(c) for c in cuts] != [size_expr(e) for e in edges]:  # each part must be one whole block
        raise rc.fail(node, f"splits a dim laid out by blocks {tuple(blocks)} into parts of {sizes}, not at the blocks",
                      "Each rank holds its share of every block side by side; only a split at exactly the blocks "
                      "gives each part its share.")
    if any(whole):  # parts kept whole on every rank: only a split at exactly the blocks is known
        if node.target != aten.split_with_sizes.default or list(node.args[1]) != list(blocks):
            raise rc.fail(node, f"splits a fused projection with whole blocks {blocks} other than at them")
        args[1] = [b - a for a, b in zip(local, local[1:])]
    elif node.target == aten.split_with_sizes.default:
        args[1] = [rc.local_size(node, s) for s in node.args[1]]
    elif node.target == aten.split.Tensor:
        args[1] = rc.local_size(node, node.args[1])
    node.args = tuple(args)
    return tuple(R if w else pl for w in whole) if any(whole) else tuple([pl] * num_out)


def _split_groups(node: Node, dim: int, cuts: list, edges: list, local: list, whole: tuple, pl: Shard) -> tuple:
    """A split whose parts are each several blocks (a Mamba-2 projection's ``z | x B C | dt``, its
    middle part split again after the convolution): each part gets the local sizes of its blocks,
    and is replicated when all of them are whole, an even shard when it is one sharded block, and
    else laid out by its blocks (on its item, which shard propagation reads)."""
    whole = whole or (False,) * (len(edges) - 1)
    spans = [(edges.index(a), edges.index(b)) for a, b in zip(cuts, cuts[1:])]
    args = list(node.args)
    args[1] = [local[j] - local[i] for i, j in spans]
    node.args = tuple(args)
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    out = []
    for k, (i, j) in enumerate(spans):
        if all(whole[i:j]):
            out.append(R)
            continue
        out.append(pl)
        if j - i > 1 and k in items:
            items[k].meta[BLOCKS_KEY] = tuple(edges[m + 1] - edges[m] for m in range(i, j))
            if any(whole[i:j]):
                items[k].meta[WHOLE_KEY] = tuple(whole[i:j])
    return tuple(out)


@register(aten.tensor_split.indices)
def tensor_split_rule(node: Node, pls: list, rc: RuleContext):
    """``tensor_split(x, positions, dim)`` along a dim other than the sharded one keeps the shard
    in every piece.  Along it, a split at the dim's whole size (a mixer's chunked part of all its
    ``s`` positions, and an empty rest) keeps the rank's share whole and leaves it nothing else on
    every rank; at other positions the pieces are not the rank's shares: refused."""
    pl, num_out = pls[0], len(node.meta["val"])
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % ndim_of(node.args[0])
    if isinstance(pl, Shard) and dim == pl.dim:
        size = size_expr(node.args[0].meta["val"].shape[dim])
        indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
        at_end = [size_expr(i.meta["val"] if isinstance(i, Node) else i) == size for i in indices]
        if not (at_end and all(at_end)):
            raise rc.fail(node, f"splits the sharded dim {dim} at positions")
    return tuple([pl] * num_out)


def _legacy_empty(node: Node) -> bool:
    """A 1-D tensor of size 0, which ``cat`` skips (a KV cache's initial value)."""
    return shape_of(node) == (0,)


@register(aten.cat.default)
def cat_rule(node: Node, pls: list, rc: RuleContext):
    parts = [(a, p) for a, p in zip(node.args[0], pls) if not _legacy_empty(a)]
    if len(parts) == 1:  # a copy of the one part that is not skipped
        return parts[0][1]
    pls = [p for _, p in parts]
    shards = {p for p in pls if isinstance(p, Shard)}
    if not shards and not any(isinstance(p, Partial) for p in pls):
        return R
    nd = ndim_of(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if len(shards) == 1 and all(isinstance(p, (Shard, Replicate)) for p in pls):
        (pl,) = shards
        if pl.dim != dim:
            _slice_replicated(node, parts, pl.dim, rc)
            return pl
        if all(p == pl for p in pls) and not rc.local_sizes:
            return cat_blocks(node, [a for a, _ in parts], dim, rc)
    raise rc.fail(node, f"concatenates inputs placed {pls} along dim {dim}")


def _slice_replicated(node: Node, parts: list, dim: int, rc: RuleContext) -> None:
    """Give ``node`` this rank's slice along ``dim`` of each replicated part of a cat / stack
    whose other parts are sharded on ``dim`` (a token-type embedding concatenated with sequence
    shards, a per-head tensor with head shards): every part has the full size on that dim, so
    the slice is exactly the rank's share (no communication)."""
    for arg, pl in parts:
        if isinstance(pl, Replicate):
            if size_expr(shape_of(arg)[dim]) in rc.uneven:
                raise rc.fail(node, f"joins replicated {arg.name} with parts split unevenly on dim {dim}")
            rc.shard_operand(node, arg, dim, f"this rank's slice of replicated {arg.name}, joined with "
                                             f"parts sharded on dim {dim} (no communication)")


@register(aten.stack.default)
def stack_rule(node: Node, pls: list, rc: RuleContext):
    shards = {p for p in pls if isinstance(p, Shard)}
    if not shards and not any(isinstance(p, Partial) for p in pls):
        return R
    dim = (node.args[1] if len(node.args) > 1 else 0) % ndim_of(node)
    if len(shards) == 1 and all(isinstance(p, (Shard, Replicate)) for p in pls):
        (pl,) = shards
        _slice_replicated(node, list(zip(node.args[0], pls)), pl.dim, rc)
        return Shard(pl.dim + (1 if dim <= pl.dim else 0))
    raise rc.fail(node, f"stacks inputs placed {pls}")



@register(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node: Node, pls: list, rc: RuleContext):
    """``pad(x, [lo_last, hi_last, lo_prev, hi_prev, ...])``: padding other dims keeps the shard (a
    mixer's sequence padded to whole chunks); padding the sharded dim would put the pad on every
    rank's slice: refused, as is a partial sum (a non-zero pad value would be counted per rank)."""
    pl = pls[0]
    if isinstance(pl, Replicate):
        return pl
    pad = list(node.args[1])
    at = ndim_of(node.args[0]) - 1 - pl.dim if isinstance(pl, Shard) else None
    if isinstance(pl, Shard) and not any(pad[2 * at:2 * at + 2]):
        return pl
    raise rc.fail(node, f"pads {pad} a tensor placed {pl}")
