"""Random draws over a dp rank's rows, made as one device makes them (part of the batch propagation).

The batch propagation places every node on ``dp``; a draw from the default generator over the
rank's rows (``exponential_``, ``rand_like``, ... of ``RANDOM_DRAWS``; PhiMoE's sampling router)
is marked there by ``passes/draw_rules.py`` with its row dim.  :func:`rewrite_draws` turns each
into :func:`autopar.ops.draws.rows_draw`: the whole batch's tensor drawn with the same op, this
rank's rows kept, so every rank's generator advances as one device's and its rows get one
device's numbers (exact when the ranks' default generators are seeded alike; the op's docstring).

That needs the rank's rows to be one block of the batch's rows along the draw's row dim, in
order: the runtime hands rank ``r`` the rows ``r * B/dp .. (r+1) * B/dp`` of every input's dim 0,
and row-wise work keeps them so.  A view that merges the row dim behind another dim (a
``[s, b, h]`` tensor viewed as ``[s * b, h]``) interleaves them; :func:`_rows_out_of_order` finds
such a view between the inputs and a draw, and the draw is refused there.  Refused as well, with
an ``autopar:`` error naming the draw: any draw under micro-batches or pipeline stages (each
micro-batch draws again, and a later stage's generator has not made the earlier stages' draws),
and a draw over rows inside a graph of its own that is not a ``torch.no_grad()`` region of the
top graph.  Draws that hold no row are made as they are (the same numbers on every rank), and a
draw whose numbers nothing reads (BigBird's forward initialises layers it then drops) is left
alone under micro-batches too.

Neighbours: ``passes/batch_propagation.py`` (calls it), ``passes/draw_rules.py`` (the marks).
"""
from __future__ import annotations

import math

import sympy
import torch
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError, describe_node
from autopar.frontend.op_sets import RANDOM_DRAWS, RESHAPE_OPS
from autopar.ops import draws
from .context import COPIED_META, provenance
from .draw_rules import DRAW_KEY
from .grad_mode_regions import GRAD_MODE_REGION
from .rules import size_expr

__all__ = ["rewrite_draws"]

aten = torch.ops.aten
_PASS = "batch_propagation_pass"


def _graphs(gm: GraphModule) -> list[GraphModule]:
    return [gm] + [m for _, m in gm.named_modules() if isinstance(m, GraphModule) and m is not gm]


def _draws(gm: GraphModule) -> list[tuple[GraphModule, Node]]:
    return [(g, n) for g in _graphs(gm) for n in g.graph.nodes
            if n.op == "call_function" and n.target in RANDOM_DRAWS]


def rewrite_draws(gm: GraphModule, plan, batch: frozenset) -> int:
    """Make every marked draw over the rank's rows the whole batch's draw (see the module docstring);
    ``batch``: the batch-size symbols of the inputs.  Returns how many were rewritten."""
    found = _draws(gm)
    if not found:
        return 0
    live = _live(found, gm)
    if live and (plan.mb > 1 or plan.pp > 1):
        why = (f"with {plan.mb} micro-batches each micro-batch draws again" if plan.pp == 1 else
               f"with {plan.pp} pipeline stages a later stage's generator has not made the earlier stages' draws")
        raise AutoparError(
            f"autopar: {describe_node(live[0])} draws random numbers from the default generator, which one "
            f"device calls once per draw for the whole batch; {why}, so the numbers are not one device's. Use a "
            "plan with mb=1 and pp=1 for this model, or train it without the sampling (a router in eval mode "
            "routes deterministically).")
    proven: set[Node] = set()
    changed, count = set(), 0
    for owner, node in found:
        if owner is not gm and _region(owner, gm) is None:
            raise AutoparError(
                f"autopar: {describe_node(node)} draws random numbers from the default generator in a graph of its "
                "own (an MoE expert body, run on the rows routed to this rank), which one device draws for its "
                "own rows in another order. Use a plan without dp for this model.")
        if DRAW_KEY not in node.meta:
            continue
        where = _rows_out_of_order(node, gm, batch, proven)
        if where is not None:
            raise AutoparError(
                f"autopar: {describe_node(node)} draws random numbers for this rank's rows, which one device draws "
                f"for the whole batch; they are one block of the batch's rows only while every view keeps the "
                f"batch's rows outermost, and {describe_node(where)} does not (it merges the rows behind another "
                "dim, or they reach it from where the graph cannot follow). Use a plan without dp for this model.")
        _rewrite(owner, node)
        changed.add(owner)
        count += 1
    for owner in changed - {gm}:
        owner.recompile()
    return count


# Ops whose output is a view of their first input: an in-place fill of the view fills the base.
_VIEWS = frozenset({aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
                    aten.reshape.default, aten.slice.Tensor, aten.select.int, aten.transpose.int, aten.permute.default,
                    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default,
                    aten.as_strided.default, aten.t.default, aten.narrow.default, aten.unflatten.int,
                    aten.flatten.using_ints})


def _live(found: list[tuple[GraphModule, Node]], gm: GraphModule) -> list[Node]:
    """The draws whose numbers reach the graph's outputs: the draw itself, or (an in-place fill) a
    reader of the tensor it fills, through views, feeds them.  A draw nothing reads (BigBird's forward
    initialises layers it throws away) only advances the generator.  Every draw in a graph of its own
    counts as read."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    needed, todo = set(), [output]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in needed:
                needed.add(a)
                todo.append(a)
    live = []
    for owner, node in found:
        filled, base = [node], node.args[0] if node.args else None
        while isinstance(base, Node):  # the tensor an in-place fill writes, and what it views
            filled.append(base)
            base = base.args[0] if base.target in _VIEWS and base.args else None
        if owner is not gm or node in needed or any(u in needed for f in filled for u in f.users):
            live.append(node)
    return live


def _rewrite(owner: GraphModule, node: Node) -> None:
    dim = node.meta[DRAW_KEY]
    op = f"{node.target.name()}.{node.target._overloadname}"
    with owner.graph.inserting_before(node):
        new = owner.graph.call_function(draws.rows_draw, (op, dim, "dp", *node.args), dict(node.kwargs))
    for key in COPIED_META:
        if key in node.meta:
            new.meta[key] = node.meta[key]
    provenance(new, _PASS, None, f"{op} drawn for the whole batch (this rank's rows along dim {dim} kept): one "
                                 "device's numbers for them")
    node.replace_all_uses_with(new)
    owner.graph.erase_node(node)


def _row_dim(node, batch: frozenset) -> int | None:
    """The dim of ``node``'s value whose size holds the batch size (None: none, or not one tensor)."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dims = [d for d, s in enumerate(val.shape) if size_expr(s).free_symbols & batch]
    return dims[0] if len(dims) == 1 else None


def _holds_rows(node: Node, batch: frozenset) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and any(size_expr(s).free_symbols & batch for s in v.shape) for v in vals)


def _outer(node: Node, dim: int) -> sympy.Expr:
    """The product of ``node``'s sizes before ``dim``: how many blocks the rows lie in."""
    return math.prod((size_expr(s) for s in node.meta["val"].shape[:dim]), start=sympy.Integer(1))


def _same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.simplify(a - b) == 0


def _region(body: GraphModule, top: GraphModule) -> Node | None:
    """The top graph's ``torch.no_grad()`` region whose body is ``body`` (None: none)."""
    return next((n for n in top.graph.nodes if n.target is GRAD_MODE_REGION
                 and getattr(top, n.args[1].target, None) is body), None)


def _operand(placeholder: Node, top: GraphModule) -> Node | None:
    """The top graph's operand a ``torch.no_grad()`` region's body placeholder takes (None elsewhere)."""
    region = _region(placeholder.graph.owning_module, top)
    index = [n for n in placeholder.graph.nodes if n.op == "placeholder"].index(placeholder)
    operand = region.args[2 + index] if region is not None and len(region.args) > 2 + index else None
    return operand if isinstance(operand, Node) else None


def _rows_out_of_order(draw: Node, top: GraphModule, batch: frozenset, proven: set) -> Node | None:
    """The first node (walking back from ``draw`` over values that hold rows) where the rank's rows may
    stop being one block of the batch's in order: a view whose row dim has other blocks outside it than
    its input's, an input whose rows are not in dim 0, a graph of its own the walk cannot leave."""
    todo = [draw]
    while todo:
        n = todo.pop()
        if n in proven:
            continue
        proven.add(n)
        if n.op == "placeholder":
            if n.graph is not top.graph:
                outer = _operand(n, top)
                if outer is None:
                    return n
                todo.append(outer)
            elif _row_dim(n, batch) not in (0, None):
                return n
            continue
        if n.op != "call_function":
            continue
        if n.target in RESHAPE_OPS:
            src, dim = n.args[0], _row_dim(n, batch)
            src_dim = _row_dim(src, batch)
            if dim is None or src_dim is None or not _same(_outer(n, dim), _outer(src, src_dim)):
                return n
        todo.extend(a for a in n.all_input_nodes if _holds_rows(a, batch))
    return None
