"""Where a MoE block's expert ids come from: the routings the MoE analysis starts from.

Part of the analysis stage (:mod:`autopar.frontend.analyze_moe` cuts the experts out from each
routing found here).  A *routing* is ``(source, index, width)``: ``index`` the integer ids
``[T, k]`` (or ``[b, s, k]``, flattened by the block) of the experts each token goes to, whose
values are provably indices over ``width`` router outputs, and ``source`` the node the routing
weights depend on (the experts are weighted by values computed from it, found by the block
analysis among its dependants).  Every routing is decided from the dataflow, never by names; the
finders are :data:`ROUTING_SOURCES`, each over the whole graph (a new kind of routing is one more
finder there):

- :func:`topk_routings`: an ``aten.topk`` over the router's ``E`` outputs (its indices; its values
  are the weights or what they are computed from);
- :func:`region_routings`: a ``torch.no_grad()`` region (``wrap_with_set_grad_enabled``, LongCat's
  router) whose graph returns a top-k's indices, read by the ``getitem`` of that output;
- :func:`max_routings`: ids the experts sort (flattened) or one-hot encode that are the indices of
  ``max``/``argmax`` over the last dim of ``E`` scores, one column per slot, concatenated over the
  slots (PhiMoE's sparse mixer: the first expert by a max, the second by a max of the scores with
  the first masked out, each sampled by a Gumbel max in train mode);
- ``table_routings`` (:mod:`autopar.frontend.moe_table_routing`): ids read from a table by the token
  ids (DeepSeek-V4's hash routing).

A block may sort ids computed from a routing's (:func:`remapped_index`: LongCat's fold of zero
experts, Ergo's row per slot), unless those are a routing of their own (:func:`is_routing_ids`).
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr
from autopar.frontend.fx_utils import module_path, within
from autopar.frontend.moe_table_routing import table_routings
from autopar.frontend.op_sets import RESHAPE_OPS

aten = torch.ops.aten

__all__ = ["Routing", "ROUTING_SOURCES", "routings", "topk_routings", "region_routings", "max_routings",
           "max_ids", "remapped_index", "is_routing_ids", "in_module", "node_shape", "is_float", "item", "static_size"]

Routing = tuple[Node, Node, int]  # (source, index, width)
_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled  # a torch.no_grad() region's node


def in_module(node: Node, prefix: str) -> bool:
    """Was ``node`` traced inside module ``prefix`` (the top level for ``""``)?"""
    return within(module_path(node), prefix)


def node_shape(node) -> tuple:
    """Sizes as ints or sympy expressions (compared structurally: no guards on unbacked sizes)."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(v, torch.Tensor):
        return ()
    return tuple(sym_expr(s) if isinstance(s, torch.SymInt) else int(s) for s in v.shape)


def is_float(node) -> bool:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(v, torch.Tensor) and v.dtype.is_floating_point


def item(node: Node, i: int) -> Node | None:
    """The ``getitem`` reading output ``i`` of a multi-output ``node``."""
    return next((u for u in node.users if u.target is operator.getitem and u.args[1] == i), None)


def static_size(size) -> int | None:
    """A size as an int; None for a symbolic one (a top-k over the positions, a sparse attention
    indexer's, picks keys, not experts)."""
    return int(size) if getattr(size, "is_Integer", isinstance(size, int)) else None


def topk_routings(gm: GraphModule) -> list[Routing]:
    """Every ``aten.topk`` over a static last dim: its indices over that many router outputs."""
    return [(n, index, width) for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.topk.default
            and (index := item(n, 1)) is not None and (width := static_size(node_shape(n.args[0])[-1])) is not None]


def region_routings(gm: GraphModule) -> list[Routing]:
    """The top-k indices every ``torch.no_grad()`` region returns, read outside it."""
    return [r for n in gm.graph.nodes if n.target is _REGION for r in _region_routings(gm, n)]


def _region_routings(gm: GraphModule, region: Node) -> list[Routing]:
    sub = getattr(gm, region.args[1].target, None)
    if not isinstance(sub, GraphModule):
        return []
    outputs = list(next(n for n in sub.graph.nodes if n.op == "output").args[0])
    found = []
    for i, out in enumerate(outputs):
        if isinstance(out, Node) and out.target is operator.getitem and out.args[1] == 1 \
                and out.args[0].target == aten.topk.default and (index := item(region, i)) is not None \
                and (width := static_size(node_shape(out.args[0].args[0])[-1])) is not None:
            found.append((region, index, width))
    return found


_SORTS = (aten.sort.default, aten.sort.stable)
_CONCATS = (aten.cat.default, aten.concat.default)


def _routed_ids(node: Node) -> Node | None:
    """The ids ``node`` routes by: the 2-D (or more) integer tensor a sort of its flattening, or a
    one-hot encoding, reads."""
    flat = node.args[0] if node.args else None
    if node.target in _SORTS and isinstance(flat, Node) and flat.target in RESHAPE_OPS and len(node_shape(flat)) == 1:
        ids = flat.args[0]
    elif node.target is aten.one_hot.default:
        ids = flat
    else:
        return None
    return ids if isinstance(ids, Node) and len(node_shape(ids)) >= 2 and not is_float(ids) else None


def _max_column(node: Node) -> tuple[Node, int] | None:
    """``(max, width)`` when ``node`` is one slot's column ``[..., 1]`` of the indices of a ``max`` /
    ``argmax`` over the last dim of ``width`` (static) scores: ``max(x, -1, keepdim=True)[1]``, or
    its indices without the kept dim unsqueezed at the end."""
    if node.target is aten.unsqueeze.default and node.args[1] in (-1, len(node_shape(node)) - 1):
        node, kept = node.args[0], False
    else:
        kept = True
    if node.target is operator.getitem and node.args[1] == 1 and node.args[0].target is aten.max.dim:
        top = node.args[0]
    elif node.target is aten.argmax.default:
        top = node
    else:
        return None
    x, dim = top.args[0], top.args[1] if len(top.args) > 1 else top.kwargs.get("dim")
    keepdim = bool(top.args[2] if len(top.args) > 2 else top.kwargs.get("keepdim", False))
    shape = node_shape(x)
    if not shape or dim is None or dim % len(shape) != len(shape) - 1 or keepdim != kept:
        return None
    width = static_size(shape[-1])
    return (top, width) if width is not None else None


def max_ids(ids: Node) -> tuple[Node, int] | None:
    """``(first slot's max, E)`` when every column of ``ids`` is the indices of a max over the last dim
    of ``E`` scores (the same ``E``), concatenated over the slots along the last dim (or one such
    column alone): each id is then an index below ``E``."""
    columns = [ids]
    if ids.target in _CONCATS:
        ndim, dim = len(node_shape(ids)), ids.args[1] if len(ids.args) > 1 else ids.kwargs.get("dim", 0)
        if not ndim or dim % ndim != ndim - 1:
            return None
        columns = list(ids.args[0])
    found = [_max_column(c) if isinstance(c, Node) else None for c in columns]
    if not found or None in found or len({width for _, width in found}) != 1:
        return None
    return found[0]


def max_routings(gm: GraphModule) -> list[Routing]:
    """The ids a node of the graph (a sort of their flattening, a one-hot) routes by, when they are max
    indices over the slots (:func:`max_ids`; PhiMoE: a Gumbel max per slot in train mode, the second
    over the scores with the first expert masked out).  The source is the first slot's max: the
    routing weights are computed from the scores at its indices."""
    found = []
    for n in gm.graph.nodes:
        ids = _routed_ids(n) if n.op == "call_function" else None
        if ids is not None and (picks := max_ids(ids)) is not None:
            found.append((picks[0], ids, picks[1]))
    return found


# The finders of routings, each over the whole graph (``gm -> routings``); :func:`routings` keeps
# the first routing found for each index.
ROUTING_SOURCES: tuple[Callable[[GraphModule], list[Routing]], ...] = (topk_routings, region_routings, max_routings,
                                                                     table_routings)


def routings(gm: GraphModule) -> list[Routing]:
    """Every routing of the graph (:data:`ROUTING_SOURCES`), each index once, in the graph order of
    the indices."""
    found, seen = [], set()
    for source in ROUTING_SOURCES:
        for routing in source(gm):
            if routing[1] not in seen:
                seen.add(routing[1])
                found.append(routing)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return sorted(found, key=lambda r: order[r[1]])


def remapped_index(index: Node, down: set[Node], scope: str) -> Node | None:
    """The ``[N, k']`` expert ids the experts sort by, when the block computes them from the top-k's:
    the 2-D input of the block's one sort of flattened ids.  LongCat folds choices past its routed
    experts onto them with a ``where`` (``[T, k]``); Ergo gives each (token, slot) a row of its own
    (``idx.reshape(-1, 1)``, the tokens repeated per slot: ``[T * k, 1]``).  ``moe_dispatch``
    refuses ids outside the experts at run time, so a fold the graph does not bound stops there,
    never silently."""
    sorts = [n for n in down if n.target in _SORTS and in_module(n, scope)
             and n.args[0].target in RESHAPE_OPS and len(node_shape(n.args[0])) == 1]
    if len(sorts) != 1:
        return None
    ids = sorts[0].args[0].args[0]
    if ids is index or ids not in down or len(node_shape(ids)) != 2 or is_float(ids) or is_routing_ids(ids):
        return None  # another routing's ids (a group-limited router's last top-k) are a routing of their own
    return ids


def is_routing_ids(node: Node) -> bool:
    """Whether ``node`` is the ids of a routing of its own: a top-k's indices, read directly or
    through a ``torch.no_grad()`` region, or max indices over the slots (:func:`max_ids`)."""
    if node.target is operator.getitem:
        src = node.args[0]
        if src.target == aten.topk.default:
            return node.args[1] == 1
        if src.target is _REGION:
            return any(i is node for _, i, _ in _region_routings(src.graph.owning_module, src))
    return max_ids(node) is not None
