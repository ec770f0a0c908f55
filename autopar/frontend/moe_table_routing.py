"""Hash routing: MoE experts chosen by a table lookup of the token ids, not by a top-k.

DeepSeek-V4's first layers route each token to the experts in row ``input_ids[t]`` of a fixed
``[vocab, k]`` table (``tid2eid``); a learned router still scores every expert, and the chosen
experts are weighted by their scores gathered at the looked-up ids.  The experts region is the
usual one (the (token, slot) pairs sorted by expert, a histogram of the sorted ids for each
expert's rows), so once the ids are found :mod:`autopar.frontend.analyze_moe` cuts it out like any
routing's.  Found by dataflow, never by names:

- the ids ``idx [T, k]``: an integer 2-D tensor whose flattening is sorted, and whose values are a
  table's rows (``table[i]``, ``table`` a ``[V, k]`` integer buffer or parameter of the graph and
  ``i`` a 1-D index), through casts and reshapes;
- the number of experts ``E``: a histogram of the sorted ids with one bin per id in ``[0, E - 1]``
  (``histc(ids, bins=E, min=0, max=E - 1)``).

The graph cannot prove a table's values lie in ``[0, E - 1]`` (the buffer is loaded with the
checkpoint, maybe after compiling): the passes check them at run time
(``autopar.ops.moe.checked_expert_ids``, inserted by ``passes/expert_parallel.py``; ``moe_dispatch``
under ep).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from autopar.frontend.op_sets import RESHAPE_OPS

__all__ = ["table_routings", "table_lookup"]

aten = torch.ops.aten

_SORTS = (aten.sort.default, aten.sort.stable)
_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
                    aten.alias.default, aten.detach.default})


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_int(node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and not v.dtype.is_floating_point and not v.dtype.is_complex \
        and v.dtype is not torch.bool


def _source(node: Node) -> Node:
    """``node`` through casts and reshapes (the same values)."""
    while isinstance(node, Node) and node.op == "call_function" and (node.target in _CASTS or node.target in RESHAPE_OPS):
        node = node.args[0]
    return node


def table_lookup(node: Node) -> Node | None:
    """The ``table[i]`` that ``node`` holds the values of (through casts and reshapes): a 2-D integer
    buffer or parameter of the graph read at a 1-D index, one row per token.  None otherwise."""
    src = _source(node)
    if src.op != "call_function" or src.target is not aten.index.Tensor or len(src.args[1]) != 1:
        return None
    table, (index,) = src.args[0], src.args[1]
    t, i = _val(table), _val(index)
    if table.op != "get_attr" or not _is_int(table) or t.dim() != 2 or not isinstance(i, torch.Tensor) \
            or i.dim() != 1:
        return None
    return src


def _histogram_bins(sort: Node) -> int | None:
    """``E`` of a ``histc(bins=E, min=0, max=E - 1)`` of the sort's values (through casts)."""
    values = next((u for u in sort.users if u.target is operator.getitem and u.args[1] == 0), None)
    todo = [values] if values is not None else []
    while todo:
        for u in todo.pop().users:
            if u.op != "call_function":
                continue
            if u.target in _CASTS:
                todo.append(u)
            elif u.target is aten.histc.default:
                bins = u.args[1] if len(u.args) > 1 else u.kwargs.get("bins", 100)
                lo = u.args[2] if len(u.args) > 2 else u.kwargs.get("min", 0)
                hi = u.args[3] if len(u.args) > 3 else u.kwargs.get("max", 0)
                if isinstance(bins, int) and bins > 1 and lo == 0 and hi == bins - 1:
                    return bins
    return None


def table_routings(gm: GraphModule) -> list[tuple[Node, Node, int]]:
    """``(lookup, index, width)`` of every routing whose ids are a table lookup, in graph order:
    ``index`` the ``[T, k]`` ids whose flattening the experts sort, ``lookup`` the ``table[i]``
    they hold, ``width`` the number of experts their histogram counts (see the module docstring)."""
    found = []
    for sort in gm.graph.nodes:
        if sort.op != "call_function" or sort.target not in _SORTS:
            continue
        flat = sort.args[0]
        if not isinstance(flat, Node) or flat.target not in RESHAPE_OPS or _val(flat) is None or _val(flat).dim() != 1:
            continue
        ids = flat.args[0]
        if not _is_int(ids) or _val(ids).dim() != 2 or (lookup := table_lookup(ids)) is None:
            continue
        width = _histogram_bins(sort)
        if width is not None and all(i is not ids for _, i, _ in found):
            found.append((lookup, ids, width))
    return found
