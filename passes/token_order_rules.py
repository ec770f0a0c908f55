"""Token-order rules: how a rank's tokens enter a rank-local order, are counted, and come back.

The placements and the facts about keys they rest on are ``passes/token_order.py`` (its
docstring is the argument); row-wise work on regrouped rows is ``passes/token_order_rowwise.py``.
These rules are asked first on a data axis (``RuleContext.local_sizes``: dp, micro-batches, cp)
by ``passes/shard_propagation.py``; each returns None where it does not apply, and an input in a
rank-local order that no rule places is refused there.

- *into an order*: ``sort`` of a 1-D tensor of the rank's tokens (its values are the tokens
  regrouped, its indices their positions), ``where(mask)`` (the selected elements: positions of
  their tokens, coordinates as data), ``arange`` over the rank's tokens written at a sort's
  positions (the inverse permutation);
  ``positions // k`` is the token of a slot when each token's ``k`` slots are consecutive;
- *gathers*: ``x[positions]`` of the rank's rows takes them into the order; a replicated table
  read at regrouped keys is regrouped; ``y[inverse]`` brings regrouped rows back;
- *counts*: a histogram or one-hot sum of all the keys, with every key proven at least the first
  bin's start (keys past the last bin sort after every bin), is the rank's counts per bin;
  their cumulative sum the offsets of each bin's rows in the sorted
  order, their items the sizes of each bin's segment;
- *grouped work*: a grouped matmul on rows sorted by the keys its offsets count gives each row
  its own bin's matrix, so row ``j`` still depends on element ``j`` only; a split by the counts
  and a concatenation of every segment in order likewise;
- *back*: ``index_put`` / ``index_add`` at the order's positions write each row at its token.
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from .rules import P, R, RuleContext, canonical_dim, ndim_of, register_token_order, shape_of, size_expr
from .token_order import (InversePositions, KeyCounts, Positions, Regrouped, ascending, distinct_per_row,
                          is_sort, is_token_order, key_range, key_root, order_space, same_size, token_major)
from .token_order_rowwise import reduce_rule

__all__ = ["sort_rule", "arange_rule", "selection_rule", "index_rule", "index_put_rule", "index_add_rule",
           "histc_counts_rule", "one_hot_counts", "grouped_mm_rule", "segments_rule", "join_rule",
           "checked_extreme_rule"]

aten = torch.ops.aten


def _pl(node, rc: RuleContext):
    return rc.placements.get(node, R) if isinstance(node, Node) else R


def _arg(node: Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


# --- into an order ---------------------------------------------------------------------

@register_token_order(aten.sort.default, aten.sort.stable)
def sort_rule(node: Node, pls: list, rc: RuleContext):
    """Sorting the rank's tokens (a 1-D tensor) regroups them: (values, their positions)."""
    x = node.args[0]
    if pls[0] != Shard(0) or ndim_of(x) != 1:
        return None
    return Regrouped(0, node), Positions(node, 1)


_PUTS = (aten.index_put_.default, aten.index_put.default)


@register_token_order(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange_rule(node: Node, pls: list, rc: RuleContext):
    """``arange`` as long as the rank's tokens, written at an order's positions (``inv[perm] =
    arange``): the rank's own positions 0..n-1, not the one device's.  Used otherwise (an index of
    the rank's rows, a mask's batch index) it stays the natural rows its shape says."""
    start = 0 if node.target is aten.arange.default else node.args[0]
    step = _arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
    if rc.token_dim(node) is None or start != 0 or step != 1 or not node.users:
        return None
    if not all(u.target in _PUTS and u.args[2] is node and u.args[0] is not node and node not in u.args[1]
               for u in node.users):
        return None
    return Positions(None, 1)


@register_token_order(aten.where.default)
def selection_rule(node: Node, pls: list, rc: RuleContext):
    """``where(mask)`` of a mask of the rank's tokens selects its true elements: along the mask's
    token dim their positions, along its other dims their coordinates (data of each element)."""
    pl = pls[0]
    if not isinstance(pl, Shard):
        return None
    return tuple(Positions(node, 1) if d == pl.dim else Regrouped(0, node) for d in range(ndim_of(node.args[0])))


@register_token_order(operator.getitem)
def getitem_rule(node: Node, pls: list, rc: RuleContext):
    src = pls[0] if pls else None
    return src[node.args[1]] if isinstance(src, (tuple, list)) and is_token_order(src) else None


@register_token_order(aten.floor_divide.default, aten.div.Tensor_mode, aten.div.Scalar_mode)
def slot_token_rule(node: Node, pls: list, rc: RuleContext):
    """``positions // k`` of a sort over slots: the token of each slot, when every token's ``k``
    slots are consecutive in the sorted tensor (:func:`~passes.token_order.token_major`)."""
    pl, k = pls[0], node.args[1]
    if not isinstance(pl, Positions) or not is_sort(pl.order) or not isinstance(k, int) or k <= 0:
        return None
    if node.target is not aten.floor_divide.default and node.kwargs.get("rounding_mode") not in ("floor", "trunc"):
        return None  # positions are >= 0: truncation is the floor
    return Positions(pl.order, pl.div * k) if token_major(pl.order, pl.div * k, rc) else None


# --- gathers and scatters ---------------------------------------------------------------

def _rows_by_positions(x: Node, d: int, pos: Positions, rc: RuleContext) -> bool:
    """``pos`` counts the rows of dim ``d`` of ``x``: its order's space divided by ``pos.div``."""
    return pos.order is not None and same_size(order_space(pos.order, rc), size_expr(shape_of(x)[d]) * pos.div)


@register_token_order(aten.index.Tensor)
def index_rule(node: Node, pls: list, rc: RuleContext):
    """``x[i0, i1, ...]`` with 1-D indices: the rank's rows at the positions of an order (into it),
    a replicated table at regrouped keys (regrouped), regrouped rows at the inverse positions of
    their sort (back to the natural order)."""
    x, indices = node.args[0], list(node.args[1])
    px = _pl(x, rc)
    at = [d for d, i in enumerate(indices) if i is not None]
    pis = {d: _index_pl(indices[d], rc) for d in at}
    if not is_token_order([px, *pis.values()]) or any(ndim_of(indices[d]) != 1 for d in at):
        return None
    length = shape_of(indices[at[0]])[0]
    if any(not same_size(shape_of(indices[d])[0], length) for d in at):
        return None
    out = at[0] if at == list(range(at[0], at[-1] + 1)) else 0  # where advanced indexing puts the rows
    if isinstance(px, Shard) and isinstance(pis.get(px.dim), Positions):
        pos = pis[px.dim]
        # the other indices are data of the same elements (a selection's coordinates), or constants
        if _rows_by_positions(x, px.dim, pos, rc) and all(_element_data(indices[d], pis[d], pos.order)
                                                           for d in at if d != px.dim):
            return Regrouped(out, pos.order)
        return None
    if isinstance(px, Replicate):
        orders = {(p.order, p.segment, p.of) for p in pis.values() if isinstance(p, Regrouped) and p.dim == 0}
        if len(orders) == 1 and all(isinstance(p, Regrouped) or _broadcast_const(indices[d], p)
                                    for d, p in pis.items()):
            order, segment, of = orders.pop()
            return Regrouped(out, order, segment, of)
        return None
    if isinstance(px, Regrouped) and px.segment is None and at == [px.dim] and pis[px.dim] == InversePositions(px.order) \
            and same_size(length, shape_of(x)[px.dim]) and same_size(order_space(px.order, rc), length):
        return Shard(out)
    return None


def _index_pl(index: Node, rc: RuleContext):
    """An index's placement; a 1-D boolean mask of the rank's rows (X-MOD's ``h[lang_ids == k]``)
    indexes as the positions of its true elements (``where(mask)``), in their natural order."""
    pl = _pl(index, rc)
    val = index.meta.get("val") if isinstance(index, Node) else None
    if pl == Shard(0) and isinstance(val, torch.Tensor) and val.dtype == torch.bool and val.dim() == 1:
        return Positions(index, 1)
    return pl


def _element_data(index: Node, pl, order) -> bool:
    return (isinstance(pl, Regrouped) and pl.dim == 0 and pl.order is order and pl.segment is None) \
        or _broadcast_const(index, pl)


def _broadcast_const(index: Node, pl) -> bool:
    return isinstance(pl, Replicate) and shape_of(index) == (1,)


@register_token_order(*_PUTS)
def index_put_rule(node: Node, pls: list, rc: RuleContext):
    """``dest[positions] = values`` along the rank's rows: regrouped values written at their own
    positions are the natural rows (a sort writes every row, a selection its rows over a natural
    ``dest``); ``arange`` written at a sort's positions is its inverse permutation."""
    dest, indices, values = node.args[0], list(node.args[1]), node.args[2]
    accumulate = _arg(node, 3, "accumulate", False)
    pd, pv = _pl(dest, rc), _pl(values, rc)
    pi = _index_pl(indices[0], rc) if len(indices) == 1 and indices[0] is not None else None
    if not isinstance(pi, Positions) or pi.order is None or pi.div != 1 or pd != Shard(0):
        return None
    if not same_size(order_space(pi.order, rc), shape_of(dest)[0]):
        return None
    if isinstance(pv, Positions) and pv.order is None and is_sort(pi.order) and not accumulate \
            and same_size(shape_of(values)[0], shape_of(dest)[0]):
        # in place, ``dest`` itself now holds the inverse: nothing else may read it as natural rows
        if node.target is aten.index_put_.default and set(dest.users) != {node}:
            return None
        return InversePositions(pi.order)
    if pv == Regrouped(0, pi.order):
        return Shard(0)
    return None


@register_token_order(aten.index_add.default, aten.index_add_.default)
def index_add_rule(node: Node, pls: list, rc: RuleContext):
    """``dest.index_add(d, positions, rows)``: each regrouped row added at its token's row of the
    rank's natural ``dest`` (the sum over a token's slots, as on one device)."""
    dest, dim, index, src = node.args[:4]
    dim = canonical_dim(dim, ndim_of(dest))
    pd, pi, ps = _pl(dest, rc), _pl(index, rc), _pl(src, rc)
    if pd != Shard(dim) or not isinstance(pi, Positions) or pi.order is None:
        return None
    if ps != Regrouped(dim, pi.order) or not _rows_by_positions(dest, dim, pi, rc):
        return None
    return Shard(dim)


# --- counts of the keys -------------------------------------------------------------------

@register_token_order(aten.histc.default)
def histc_counts_rule(node: Node, pls: list, rc: RuleContext):
    """A histogram of every key, each proven at least ``min``: the rank's rows per bin (the bins
    are monotone in the key, so sorted keys fall in bin order; keys above ``max``, LongCat's zero
    experts, are left out of every bin and sort after all of them, so they shift no bin's offset).
    One bin over the data's own range (``min == max == 0``) counts every key.  Unproven: a share
    (``P``)."""
    pl, x = pls[0], node.args[0]
    if not isinstance(pl, (Shard, Regrouped)):
        return None
    bins, lo, hi = _arg(node, 1, "bins", 100), _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    keys = key_range(x)  # None unless x holds every element of proven keys (a selection's rows do not)
    if keys is not None and (lo < hi and lo <= keys[0] or bins == 1 and lo == hi == 0):
        return KeyCounts(key_root(x), "counts", bins)
    # a histogram does not see the order: of regrouped rows it is the rank's share, as of natural ones
    return None if isinstance(pl, Shard) else P


def one_hot_counts(node: Node, rc: RuleContext):
    """``scatter(zeros[T, E], 1, idx, 1).sum(0)``: with distinct top-k indices per row in
    ``[0, E)``, the rank's count of each index (JetMoE's expert sizes)."""
    x = node.args[0]
    while x.op == "call_function" and x.target in (aten.to.dtype, aten._to_copy.default):
        x = x.args[0]
    dims = [canonical_dim(d, 2) for d in node.args[1]] if ndim_of(node.args[0]) == 2 else None
    if dims != [0] or _pl(node.args[0], rc) != Shard(0) or x.target not in (aten.scatter.value, aten.scatter_.value):
        return None
    base, dim, idx, value = x.args[:4]
    num = shape_of(x)[1]
    keys = key_range(idx)
    if canonical_dim(dim, 2) != 1 or value != 1 or base.target not in (aten.zeros.default, aten.zeros_like.default,
                                                                        aten.new_zeros.default):
        return None
    if not distinct_per_row(idx) or keys is None or keys[0] < 0 or keys[1] >= num:
        return None
    return KeyCounts(key_root(idx), "counts", int(num))


@register_token_order(aten.sum.dim_IntList)
def sum_rule(node: Node, pls: list, rc: RuleContext):
    """A one-hot count of keys, or a sum over other dims than regrouped rows'."""
    return one_hot_counts(node, rc) or reduce_rule(node, pls, rc)


@register_token_order(aten.cumsum.default)
def offsets_rule(node: Node, pls: list, rc: RuleContext):
    pl, x = pls[0], node.args[0]
    if isinstance(pl, KeyCounts) and pl.kind == "counts" and canonical_dim(node.args[1], 1) == 0:
        return KeyCounts(pl.keys, "offsets", pl.bins)
    if x.target is aten.histc.default and pl == P:
        raise rc.fail(node, f"it sums up the histogram {x.name} of keys the graph does not prove at least the "
                            f"start of its range [{_arg(x, 2, 'min', 0)}, {_arg(x, 3, 'max', 0)}] (indices of a "
                            "top-k or max are; a table lookup is not): a key below it would shift every expert's "
                            "rows by a count of this rank's tokens",
                      f"Use a plan without {rc.axis} (and without micro-batches on dp), or route with a top-k "
                      "or max over the experts.")
    return None


@register_token_order(aten.unbind.int)
def count_items_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, KeyCounts) and pl.kind == "counts" and canonical_dim(_arg(node, 1, "dim", 0), 1) == 0:
        return tuple(KeyCounts(pl.keys, "item", pl.bins, e) for e in range(pl.bins))
    return None


# Where a count of the rank's rows may go as a number: split sizes, and the runtime checks on them.
_SIZE_USERS = frozenset({aten.split_with_sizes.default, aten._assert_scalar.default,
                         aten.sym_constrain_range_for_size.default})


# Where a number may go that only a runtime check reads.
_CHECK_USERS = frozenset({aten._assert_scalar.default, aten.sym_constrain_range_for_size.default})


def _only_sizes(node: Node, allowed: frozenset = _SIZE_USERS) -> bool:
    todo, seen = [node], set()
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in allowed:
                continue
            if user.op == "call_function" and getattr(user.target, "__module__", None) in ("_operator", "operator"):
                todo.append(user)  # SymInt arithmetic and comparisons, checked by the users above
                continue
            return False
    return True


@register_token_order(aten.max.default, aten.min.default)
def checked_extreme_rule(node: Node, pls: list, rc: RuleContext):
    """The largest (smallest) element of the rank's rows read only by a runtime check (XLM's
    ``assert lengths.max().item() <= slen``): every rank checks its own rows, so the checks pass
    together exactly when the one device's check of all rows passes; the number goes nowhere else."""
    if not isinstance(pls[0], Shard) or not node.users:
        return None
    numbers = list(node.users)
    if not all(u.target in (aten.item.default, aten._local_scalar_dense.default) and _only_sizes(u, _CHECK_USERS)
               for u in numbers):
        return None
    return R


@register_token_order(aten.sym_size.int)
def size_rule(node: Node, pls: list, rc: RuleContext):
    """A size of regrouped rows: the rank's token count where it holds a token symbol (data axes
    track those by expression); a selection's count only where checked or sizing a segment."""
    if not is_token_order(pls[0]):
        return None
    held = size_expr(node.meta["val"]).free_symbols & rc.token_symbols
    return R if held or _only_sizes(node) else None


@register_token_order(aten.item.default, aten._local_scalar_dense.default)
def count_number_rule(node: Node, pls: list, rc: RuleContext):
    """One bin's count as a number: kept only where it sizes the bin's segment (or is checked)."""
    pl = pls[0]
    return pl if isinstance(pl, KeyCounts) and pl.kind == "item" and _only_sizes(node) else None


# --- grouped work on the sorted rows ------------------------------------------------------

def _sorted_by_counted_keys(rows, counts, kind: str) -> bool:
    """``rows`` are sorted ascending by the keys that ``counts`` (of ``kind``) count."""
    return (isinstance(rows, Regrouped) and rows.dim == 0 and rows.segment is None and is_sort(rows.order)
            and ascending(rows.order) and isinstance(counts, KeyCounts) and counts.kind == kind
            and counts.keys is key_root(rows.order.args[0]))


@register_token_order("transformers::grouped_mm_fallback", aten._grouped_mm.default)
def grouped_mm_rule(node: Node, pls: list, rc: RuleContext):
    """A grouped matmul (``rows[offs[e-1]:offs[e]] @ w[e]``) on rows sorted by the keys whose
    offsets it takes: each row meets its own bin's matrix, a function of its element only."""
    rows, weight = _pl(node.args[0], rc), _pl(node.args[1], rc)
    offs = _pl(_arg(node, 2, "offs"), rc)
    bias = _arg(node, 3, "bias")
    if not _sorted_by_counted_keys(rows, offs, "offsets") or not isinstance(weight, Replicate):
        return None
    if ndim_of(node.args[0]) != 2 or (bias is not None and not isinstance(_pl(bias, rc), Replicate)):
        return None
    return rows


@register_token_order(aten.split_with_sizes.default)
def segments_rule(node: Node, pls: list, rc: RuleContext):
    """Sorted rows split by the counts of their keys: segment ``e`` holds bin ``e``'s rows."""
    pl = pls[0]
    sizes, dim = node.args[1], canonical_dim(_arg(node, 2, "dim", 0), ndim_of(node.args[0]))
    if not isinstance(pl, Regrouped):
        return None
    if dim != pl.dim:
        return tuple([pl] * len(sizes))  # along another dim: every piece keeps the rows
    counts = [_pl(s, rc) for s in sizes]
    if not all(_sorted_by_counted_keys(pl, c, "item") and c.bin == e and c.bins == len(sizes)
               for e, c in enumerate(counts)):
        return None
    return tuple(Regrouped(0, pl.order, e, len(sizes)) for e in range(len(sizes)))


@register_token_order(aten.cat.default, aten.concat.default)
def join_rule(node: Node, pls: list, rc: RuleContext):
    """Every segment of a split by counts, in bin order, joined back: the sorted rows again; a
    join along another dim of rows in one order keeps them."""
    parts = [_pl(a, rc) for a in node.args[0]]
    if not is_token_order(parts):
        return None
    dim = canonical_dim(_arg(node, 1, "dim", 0), ndim_of(node))
    first = parts[0]
    if not all(isinstance(p, Regrouped) and (p.order, p.dim) == (first.order, first.dim) for p in parts):
        return None
    if dim != first.dim:
        return first if len(set(parts)) == 1 else None
    if first.of == len(parts) and [p.segment for p in parts] == list(range(len(parts))):
        return Regrouped(first.dim, first.order)
    return None
