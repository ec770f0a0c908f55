"""Token order on a data axis: the placements of this rank's tokens regrouped, and their proofs.

On a data axis (``dp`` and micro-batches, :mod:`passes.batch_propagation`; ``cp``,
:mod:`passes.context_parallel`) a rank holds some of the batch's tokens, and a value placed
``Shard(d)`` holds this rank's rows of the one-device value along ``d``, in their natural order.
An MoE block run as traced regroups them: it sorts its (token, slot) pairs by expert, counts the
rows of each expert, runs each expert on its segment, and scatters the rows back.  Those steps
cross tokens, yet on a rank they only permute and count the rank's own tokens, so the block's
result is this rank's rows of the one-device result.  The placements below carry that argument
through the graph, one op at a time (their rules: ``passes/token_order_rules.py``):

- :class:`Regrouped` ``(dim, order)``: along ``dim``, row ``j`` is a function of the element that
  the *order* (a ``sort`` of a 1-D token tensor, or a ``where(mask)`` selection of a token mask)
  puts at ``j``, and of replicated values; nothing else.  ``segment=e`` (``of`` bins): only the
  rows of bin ``e`` of the sorted keys (a ``split`` by their counts);
- :class:`Positions` ``(order, div)``: an index tensor whose value at ``j`` is the position of
  the order's element ``j`` in the rank's natural rows, floor-divided by ``div``
  (``order=None``: ``arange`` over the rank's rows, each row its own position);
- :class:`InversePositions` ``(order)``: natural rows, value ``i`` is where row ``i`` sits in the
  sort ``order`` (the inverse permutation, ``inv[perm] = arange``);
- :class:`KeyCounts` ``(keys, kind)``: the rank's rows counted per bin of the key tensor ``keys``
  (``kind``: ``counts``, their cumulative ``offsets``, or one bin's ``item``), with no key
  below the first bin (a key past the last bin is in no bin and sorts after all of them).  It
  is also a share of the batch's counts: any other use reads it as ``P``.

Every other use of a regrouped value (a position-dependent op, a value leaving the region in
the rank's order, an op without a token-order rule) is refused by ``propagate``.  The facts the
rules need about keys (which tensor, what range, distinct per row) are proven here from the
graph, never from names.
"""
from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
from torch.fx import Node

from autopar.ops.moe import checked_expert_ids
from .rules import P, TokenOrder, size_expr

__all__ = ["TokenOrder", "Regrouped", "Positions", "InversePositions", "KeyCounts", "is_token_order", "as_share",
           "key_root", "key_range", "distinct_per_row", "order_space", "is_sort", "ascending", "token_major",
           "same_size"]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class Regrouped(TokenOrder):
    dim: int
    order: Node
    segment: int | None = None  # the rows of bin ``segment`` of ``of`` bins only
    of: int | None = None

    def __repr__(self) -> str:
        seg = "" if self.segment is None else f", segment {self.segment} of {self.of}"
        return f"Regrouped({self.dim}, by {self.order.name}{seg})"


@dataclasses.dataclass(frozen=True)
class Positions(TokenOrder):
    order: Node | None  # None: an ``arange`` over the rank's rows
    div: int = 1
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class InversePositions(TokenOrder):
    order: Node
    dim: int = 0


@dataclasses.dataclass(frozen=True)
class KeyCounts(TokenOrder):
    keys: Node
    kind: str  # "counts" | "offsets" | "item"
    bins: int
    bin: int | None = None

    def __repr__(self) -> str:
        return f"KeyCounts({self.kind} of {self.keys.name}{'' if self.bin is None else f', bin {self.bin}'})"


def is_token_order(pl) -> bool:
    if isinstance(pl, (tuple, list)):
        return any(is_token_order(p) for p in pl)
    return isinstance(pl, TokenOrder)


def as_share(pl):
    """What a rule outside this family may read: counts of the rank's rows are its share (``P``)
    of the batch's counts; the other token-order placements have no such reading (kept)."""
    if isinstance(pl, (tuple, list)):
        return type(pl)(as_share(p) for p in pl)
    return P if isinstance(pl, KeyCounts) else pl


# Ops that keep a tensor's elements as a multiset (and their values): a key passes through them.
_SAME_KEYS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                        aten.unsqueeze.default, aten.squeeze.dim, aten.to.dtype, aten._to_copy.default,
                        aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach.default})
# Ops whose output ``getitem(op, 1)`` holds indices along a dim of the input.
_INDEX_OPS = frozenset({aten.topk.default, aten.max.dim, aten.min.dim, aten.sort.default, aten.sort.stable})
_ARG_OPS = frozenset({aten.argmax.default, aten.argmin.default})
_CATS = frozenset({aten.cat.default, aten.concat.default, aten.stack.default})


def _is_item(node: Node, op_set, index: int) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and node.args[1] == index
            and isinstance(node.args[0], Node) and node.args[0].target in op_set)


def is_sort(order) -> bool:
    return isinstance(order, Node) and order.target in (aten.sort.default, aten.sort.stable)


def key_root(node: Node) -> Node:
    """The tensor whose elements ``node`` holds as a multiset: through views, casts and the sorted
    values of a sort (a histogram or the counts of ``node`` are those of the root)."""
    while node.op == "call_function":
        if node.target in _SAME_KEYS:
            node = node.args[0]
        elif _is_item(node, {aten.sort.default, aten.sort.stable}, 0):
            node = node.args[0].args[0]
        else:
            break
    return node


def _dim_of(op: Node) -> int:
    if op.target in (aten.sort.default, aten.sort.stable):
        dim = op.args[1] if len(op.args) > 1 and isinstance(op.args[1], int) else op.kwargs.get("dim", -1)
    elif op.target is aten.topk.default:
        dim = op.args[2] if len(op.args) > 2 else op.kwargs.get("dim", -1)
    else:
        dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    return dim


def key_range(node: Node) -> tuple[int, int] | None:
    """Integer bounds of every element of ``node`` where the graph proves them: indices along a
    dim of size ``n`` (top-k, max, argmax, a sort's indices) lie in ``[0, n - 1]``; ids checked at
    run time (``checked_expert_ids``: a hash router's table lookup) in the range checked; a
    concatenation of such keys lies in the union; a fill of some of them adds its value.  None
    when not proven."""
    root = key_root(node)
    if root.op != "call_function":
        return None
    if root.target is checked_expert_ids:
        return 0, int(root.args[1]) - 1
    if root.target in _CATS:
        ranges = [key_range(piece) for piece in root.args[0]]
        if not ranges or any(r is None for r in ranges):
            return None
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
    if root.target is aten.masked_fill.Scalar and isinstance(root.args[2], int):
        return _filled_range(root)
    if root.target is aten.where.self:
        return _where_range(root)
    inner = _region_output(root)
    if inner is not None:  # computed inside a no_grad region (a higher-order op with its own graph)
        return key_range(inner)
    if _is_item(root, _INDEX_OPS, 1) or root.target in _ARG_OPS:
        op = root.args[0] if root.target is operator.getitem else root
        dim = _dim_of(op)
        shape = op.args[0].meta["val"].shape
        if dim is None:  # argmax over every element
            n = size_expr(op.args[0].meta["val"].numel())
        else:
            n = size_expr(shape[dim % len(shape)])
        return (0, int(n) - 1) if n.is_Integer else None
    return None


def _region_output(node: Node) -> Node | None:
    """``getitem(region, i)`` of a higher-order op that runs a graph of its own (``torch.no_grad()``
    traced as ``wrap_with_set_grad_enabled``): that graph's ``i``-th output node."""
    if node.target is not operator.getitem or not isinstance(node.args[0], Node):
        return None
    call = node.args[0]
    owner = call.graph.owning_module
    bodies = [getattr(owner, a.target, None) for a in call.args if isinstance(a, Node) and a.op == "get_attr"]
    bodies = [b for b in bodies if isinstance(b, torch.fx.GraphModule)]
    if call.op != "call_function" or len(bodies) != 1:
        return None
    (out,) = [n for n in bodies[0].graph.nodes if n.op == "output"]
    results = out.args[0]
    return results[node.args[1]] if isinstance(results, (tuple, list)) and node.args[1] < len(results) else None


def _filled_range(node: Node) -> tuple[int, int] | None:
    """``x.masked_fill(mask, v)``: ``x``'s range and ``v``; where ``mask`` is ``x == c`` for an end
    ``c`` of that range (a "no expert" index folded onto expert 0), without ``c``."""
    x, mask, value = node.args[:3]
    base = key_range(x)
    if base is None:
        return None
    lo, hi = base
    if mask.op == "call_function" and mask.target is aten.eq.Scalar and key_root(mask.args[0]) is key_root(x) \
            and lo < hi and mask.args[1] in (lo, hi):
        lo, hi = (lo + 1, hi) if mask.args[1] == lo else (lo, hi - 1)
    return min(lo, value), max(hi, value)


# A comparison with an int: the range of ``x`` where it holds (True) and where it does not.
_SPLITS = {
    aten.ge.Scalar: lambda lo, hi, c: ((max(lo, c), hi), (lo, min(hi, c - 1))),
    aten.gt.Scalar: lambda lo, hi, c: ((max(lo, c + 1), hi), (lo, min(hi, c))),
    aten.lt.Scalar: lambda lo, hi, c: ((lo, min(hi, c - 1)), (max(lo, c), hi)),
    aten.le.Scalar: lambda lo, hi, c: ((lo, min(hi, c)), (max(lo, c + 1), hi)),
}


# Integer arithmetic with a constant whose range _arith_range follows.
_ARITH = {aten.add.Tensor: operator.add, aten.sub.Tensor: operator.sub, aten.mul.Tensor: operator.mul,
          aten.floor_divide.default: operator.floordiv}


def _where_range(node: Node) -> tuple[int, int] | None:
    """``where(x >= c, f(x), g(x))``: each branch's range with ``x`` narrowed to where it is taken
    (LongCat folds its zero experts ``x >= n`` onto ``(x - n) * n // z``, inside ``[0, n)`` only
    because ``x >= n`` there).  The union of the branches taken; None when one is not proven."""
    cond, then, other = node.args[:3]
    if not (isinstance(cond, Node) and cond.target in _SPLITS and isinstance(cond.args[0], Node)
            and isinstance(cond.args[1], int) and not isinstance(cond.args[1], bool)):
        return None
    x = cond.args[0]
    base = key_range(x)
    if base is None:
        return None
    ranges = []
    for branch, narrowed in zip((then, other), _SPLITS[cond.target](*base, cond.args[1])):
        if narrowed[0] > narrowed[1]:
            continue  # never taken
        r = _arith_range(branch, x, narrowed)
        if r is None:
            return None
        ranges.append(r)
    return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None


def _arith_range(node, x: Node, x_range: tuple[int, int]) -> tuple[int, int] | None:
    """Range of ``node``, an int arithmetic of ``x`` (``+ - *`` an int, ``//`` a positive int)
    with ``x`` in ``x_range``, or of proven keys."""
    if isinstance(node, int) and not isinstance(node, bool):
        return node, node
    if not isinstance(node, Node):
        return None
    if node is x:
        return x_range
    fn = _ARITH.get(node.target)
    if fn is not None and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], int):
        inner, c = _arith_range(node.args[0], x, x_range), node.args[1]
        if inner is None or (node.target is aten.floor_divide.default and c <= 0):
            return None
        ends = [fn(end, c) for end in inner]  # each op is monotone in its tensor operand
        return min(ends), max(ends)
    return key_range(node)


def distinct_per_row(node: Node) -> bool:
    """``node`` is top-k indices (through views): within a row along top-k's dim no index repeats."""
    root = key_root(node)
    return _is_item(root, {aten.topk.default}, 1) and _dim_of(root.args[0]) % root.meta["val"].dim() \
        == root.meta["val"].dim() - 1


def ascending(order: Node) -> bool:
    if order.target is aten.sort.stable:
        return not order.kwargs.get("descending", False)
    return not (order.args[2] if len(order.args) > 2 else order.kwargs.get("descending", False))


def order_space(order: Node, rc) -> sympy.Expr | None:
    """How many natural rows the order's positions count: a sort's whole 1-D input; a selection's
    mask along its token dim; a boolean mask indexing rows, its length."""
    val = order.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype == torch.bool:  # a 1-D mask used as an index: its rows
        return size_expr(val.shape[0])
    x = order.args[0]
    if is_sort(order):
        return size_expr(x.meta["val"].shape[0])
    dim = rc.token_dim(x)
    return None if dim is None else size_expr(x.meta["val"].shape[dim])


def same_size(a, b) -> bool:
    """Two sizes (ints, SymInts or sympy expressions) are equal for every batch and sequence."""
    if a is None or b is None:
        return False
    a, b = (x if isinstance(x, sympy.Basic) else size_expr(x) for x in (a, b))
    return sympy.simplify(a - b) == 0


def token_major(order: Node, div: int, rc) -> bool:
    """The sort's 1-D input flattens a tensor whose token dim is dim 0 and whose other dims hold
    ``div`` elements per token: position ``p // div`` is then the token of element ``p``, on this
    rank as on one device (the token's slots are consecutive in both)."""
    if div == 1:
        return True
    node = order.args[0]
    while True:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 1 and rc.token_dim(node) == 0:
            return same_size(val.numel(), size_expr(val.shape[0]) * div)
        if node.op != "call_function" or node.target not in _SAME_KEYS:
            return False
        node = node.args[0]
