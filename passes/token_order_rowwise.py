"""Token-order rules of row-wise work on regrouped rows: element-wise ops, views, projections.

A value placed ``Regrouped(dim, order)`` (``passes/token_order.py``) holds, at row ``j`` along
``dim``, a function of the element the order puts at ``j``.  Work that treats every row alike and
reads nothing of other rows keeps that: element-wise ops with operands in the same order or
replicated and constant along the rows, views that keep the rows, a projection by a replicated
matrix, reductions and normalisations over other dims, splits along other dims.  A replicated
operand that varies along the rows (it would pair values with positions of the rank-local order)
and operands in different orders are not placed, so ``propagate`` refuses them.  Fills shaped like
a regrouped value are constants: as long as the rank's tokens they are its natural rows.

The rules that move tokens into and out of an order are ``passes/token_order_rules.py``, which
also registers ``sum`` (a one-hot count, else :func:`reduce_rule`).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from autopar.frontend.op_sets import SOFTMAX_OPS, LOG_SOFTMAX_OPS
from .pointwise_rules import POINTWISE_OPS
from .rules import R, RuleContext, canonical_dim, ndim_of, register_token_order, shape_of
from .token_order import InversePositions, Positions, Regrouped, same_size

__all__ = ["elementwise_rule", "view_rule", "projection_rule", "reduce_rule", "fill_like_rule"]

aten = torch.ops.aten

_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
                    aten.alias.default, aten.detach.default})


def _pl(node, rc: RuleContext):
    return rc.placements.get(node, R) if isinstance(node, Node) else R


def _tensor_args(node: Node) -> list[Node]:
    return [a for a in node.args if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


@register_token_order(*POINTWISE_OPS, aten.div_.Tensor, aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor,
                      aten.clamp_.default, aten.masked_fill_.Scalar)
def elementwise_rule(node: Node, pls: list, rc: RuleContext):
    """Operands in one order (aligned by broadcasting), or replicated and constant along its rows;
    a cast of positions keeps them."""
    args = _tensor_args(node)
    places = [_pl(a, rc) for a in args]
    if len(args) == 1 and isinstance(places[0], (Positions, InversePositions)) and node.target in _CASTS \
            and not node.meta["val"].dtype.is_floating_point:
        return places[0]
    out_ndim, found = ndim_of(node), None
    for a, p in zip(args, places):
        if isinstance(p, Regrouped):
            aligned = dataclasses.replace(p, dim=p.dim + out_ndim - ndim_of(a))
            if found not in (None, aligned):
                return None
            found = aligned
        elif not isinstance(p, Replicate):
            return None  # natural rows, positions, shares: another order than the rows'
    if found is None:
        return None
    for a, p in zip(args, places):
        d = found.dim - (out_ndim - ndim_of(a))
        if isinstance(p, Replicate) and d >= 0 and shape_of(a)[d] != 1:
            return None  # a replicated value along the rows would pair values with rank-local positions
    return found


def _moved(pl: Regrouped, dim: int) -> Regrouped:
    return dataclasses.replace(pl, dim=dim)


@register_token_order(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                      aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int,
                      aten.transpose.int, aten.expand.default)
def view_rule(node: Node, pls: list, rc: RuleContext):
    """Views that keep each row's elements in that row (the rows' dim moves with its position)."""
    pl, x = pls[0], node.args[0]
    if not isinstance(pl, Regrouped):
        return None
    nd, target = ndim_of(x), node.target
    if target is aten.unsqueeze.default:
        d = canonical_dim(node.args[1], nd + 1)
        return _moved(pl, pl.dim + (1 if d <= pl.dim else 0))
    if target in (aten.squeeze.dim, aten.select.int):
        d = canonical_dim(node.args[1], nd)
        return None if d == pl.dim else _moved(pl, pl.dim - (1 if d < pl.dim else 0))
    if target is aten.transpose.int:
        a, b = (canonical_dim(d, nd) for d in node.args[1:3])
        return _moved(pl, {a: b, b: a}.get(pl.dim, pl.dim))
    if target is aten.slice.Tensor:
        d = canonical_dim(node.args[1] if len(node.args) > 1 else 0, nd)
        whole = same_size(shape_of(node)[d], shape_of(x)[d]) and (node.args[2:3] or [0])[0] in (0, None)
        return pl if d != pl.dim or whole else None
    if target is aten.expand.default:  # new leading dims shift the rows' dim; expanding it is refused
        dim = pl.dim + ndim_of(node) - nd
        return _moved(pl, dim) if same_size(shape_of(node)[dim], shape_of(x)[pl.dim]) else None
    # a reshape keeping the leading rows dim: every row's elements stay in it (row-major order)
    if pl.dim == 0 and ndim_of(node) >= 1 and same_size(shape_of(node)[0], shape_of(x)[0]):
        return pl
    return None


@register_token_order(aten.linear.default, aten.mm.default, aten.matmul.default)
def projection_rule(node: Node, pls: list, rc: RuleContext):
    """Rows times a replicated matrix (a per-expert projection): each row's own product."""
    x = node.args[0]
    pl = _pl(x, rc)
    others = [a for a in node.args[1:] if isinstance(a, Node)]
    if not isinstance(pl, Regrouped) or pl.dim == ndim_of(x) - 1 or not all(isinstance(_pl(a, rc), Replicate)
                                                                           for a in others):
        return None
    if node.target is not aten.linear.default and ndim_of(node.args[1]) != 2:
        return None  # a batched matmul pairs rows with the other operand's batch
    return pl


def reduce_rule(node: Node, pls: list, rc: RuleContext):
    """A reduction or normalisation over dims other than the rows': each row's own."""
    pl, x = pls[0], node.args[0]
    if not isinstance(pl, Regrouped) or not all(isinstance(_pl(a, rc), Replicate) for a in _tensor_args(node)[1:]):
        return None  # a norm's weight, say, must be the same for every row
    nd, target = ndim_of(x), node.target
    if target in SOFTMAX_OPS or target in LOG_SOFTMAX_OPS:
        return pl if canonical_dim(node.args[1], nd) != pl.dim else None
    if target in (aten.rms_norm.default, aten.layer_norm.default):
        return pl if pl.dim < nd - len(node.args[1]) else None
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else list(range(nd))
    dims = {canonical_dim(d, nd) for d in ([dims] if isinstance(dims, int) else dims)}
    keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if pl.dim in dims:
        return None  # over the rows: an order-free reduction is not needed by any MoE glue seen
    return pl if keep else _moved(pl, pl.dim - sum(1 for d in dims if d < pl.dim))


register_token_order(*SOFTMAX_OPS, *LOG_SOFTMAX_OPS, aten.rms_norm.default, aten.layer_norm.default, aten.mean.dim,
                     aten.amax.default, aten.amin.default)(reduce_rule)


@register_token_order(aten.split.Tensor, aten.chunk.default)
def split_rule(node: Node, pls: list, rc: RuleContext):
    """Splits along another dim than the rows': every piece keeps them."""
    pl, x = pls[0], node.args[0]
    dim = canonical_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), ndim_of(x))
    if not isinstance(pl, Regrouped) or dim == pl.dim:
        return None
    return tuple([pl] * len(node.meta["val"]))


@register_token_order(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                      aten.full_like.default)
def fill_like_rule(node: Node, pls: list, rc: RuleContext):
    """A constant shaped like a value in a rank-local order: its natural rows where it is as long
    as the rank's tokens; else a constant in the value's order (the same in any order)."""
    pl = pls[0]
    if not isinstance(pl, (Regrouped, Positions, InversePositions)):
        return None
    dim = rc.token_dim(node)
    if dim is not None:
        return Shard(dim)
    return pl if isinstance(pl, Regrouped) else None
