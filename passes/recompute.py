"""Activation recompute: the regions the plan recomputes become checkpointed bodies.

Runs after ZeRO-3 and before the pipeline cut (``passes/runner.py``), for
``recompute=selective`` or ``full``.  Each region to recompute is cut out of the program
into a GraphModule *body* whose placeholders are the values it reads from outside
(activations, parameters, ZeRO-3's gathered views, positions) and whose outputs are the
values read after it; a :class:`autopar.ops.recompute.Recompute` module registered on the
program (``recompute_<module path>``) runs the body under ``torch.utils.checkpoint``, and
``getitem`` nodes hand its outputs to the rest of the graph.  The regions are those the
cost model prices (``cost/memory.py``):

* ``selective``: for every attention region (``autopar.frontend.analyze``), the attention
  op and everything between it and the row projection reading its output, that projection
  included (o_proj): the attention output and its log-sum-exp are not kept, q, k and v (the
  body's inputs) are.  For every MLP region, the activation path from the column
  projections' outputs to the row projection, included (down_proj): silu(gate) and the
  product (or gelu(up)) are not kept, gate and up are.  Neither body holds a collective but
  a CP attention's own (K,V around the ring, their all-gather, Ulysses' all-to-alls), which
  the recomputation runs again in backward.
* ``full``: every decoder layer (``structure.layers``; a node belongs to the layer in its
  ``nn_module_stack``), less the values that depend on no parameter (positions, masks: the
  pipeline pass recomputes those per chunk) and less the layer's trailing collective and
  what follows it (the reduce-scatter or all-reduce after down_proj and the residual add):
  the layer keeps only its input.  Nodes outside the layer that lie between its nodes on a
  path (a bias the TP pass moved behind a reduction) join the body, the others move before
  or after it, so each body is one run of nodes.  The body's other forward collectives (the SP
  all-gathers before q/k/v and gate/up and the reduce-scatter after o_proj, or TP's
  all-reduce after o_proj) run again in backward, where ``cost/comm.py`` counts them.

Torch's early stop ends each recomputation at the last tensor the body saves, so the row
projection that ends every region (its GEMM) is not run again.  Under pipeline
parallelism the pass runs before the cut: each body lies inside one layer, so in one
chunk.  Every inserted node (the module call, its ``getitem`` outputs, the body's
placeholders) records its provenance.  A model without recognisable layers (or regions,
for ``selective``) and mixture-of-experts layers are refused with an ``autopar:`` error.

Neighbours: :mod:`autopar.ops.recompute` (the runtime side: checkpoint, dropout streams,
comm phases, the memory meter), ``cost/memory.py`` and ``cost/comm.py`` (what it saves
and re-sends), ``autopar/support.py`` (the plans it runs with).
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.errors import AutoparError
from autopar.frontend.fx_utils import module_path, within
from autopar.frontend.op_sets import PROJECTION_OPS
from autopar.ops.recompute import Recompute
from autopar.ops.zero_gather import zero_gather
from .context import COPIED_META, META_KEY, PassContext, PassResult, provenance
from .op_sets import CP_ATTENTION_OPS, PROGRAM_ATTENTION_OPS

__all__ = ["recompute_pass", "RecomputeRegion", "find_regions"]

_PASS = "recompute_pass"
# A selective region starts at an attention op: SDPA, its dropout form or a CP variant (whose
# collectives then run again in backward, where cost/comm.py counts them), and ends at a
# projection as the earlier passes leave it (TP turns a row-parallel Conv1D addmm into mm + bias).


@dataclasses.dataclass(frozen=True)
class RecomputeRegion:
    """One region to recompute: ``kind`` ``layer``, ``attention`` or ``mlp``, the model module
    it comes from, and its nodes in graph order."""

    kind: str
    module: str
    nodes: tuple[Node, ...]


def _layer_nodes(graph, layer: str) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function"
            and any(path == layer for path, _ in (n.meta.get("nn_module_stack") or {}).values())]


def _free(graph, params: set[str]) -> set[Node]:
    """Values that depend on no parameter (inputs, buffers and what is computed from them only)."""
    free: set[Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or (n.op == "get_attr" and n.target not in params):
            free.add(n)
        elif n.op == "call_function" and n.target is not zero_gather and all(i in free for i in n.all_input_nodes):
            free.add(n)
    return free


def _forward_collective(node: Node) -> bool:
    meta = node.meta.get(META_KEY)
    return bool(meta is not None and meta.bytes and "fwd" in meta.bytes)


def _layer_region(gm: GraphModule, layer: str, free: set[Node]) -> RecomputeRegion | None:
    nodes = [n for n in _layer_nodes(gm.graph, layer) if n not in free]
    if not nodes:
        return None
    last = max((i for i, n in enumerate(nodes) if _forward_collective(n)), default=None)
    if last is not None and not any(n.target in PROJECTION_OPS for n in nodes[last:]):
        # The trailing collective and what follows it (a moved bias, the residual add) stay outside.
        nodes = nodes[:last]
    return RecomputeRegion("layer", layer, tuple(nodes))


def _reach(start, within_nodes: set[Node], upstream: bool = False) -> set[Node]:
    """Nodes of ``within_nodes`` reachable from ``start`` (included) along users, or inputs if ``upstream``."""
    seen: set[Node] = set()
    todo = [n for n in start if n in within_nodes]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(x for x in (n.all_input_nodes if upstream else n.users) if x in within_nodes)
    return seen


def _between(start: list[Node], end: Node) -> list[Node]:
    """Nodes on a path from any of ``start`` (excluded) to ``end`` (included), in graph order."""
    ancestors = _reach([end], set(end.graph.nodes), upstream=True)
    reached = _reach([u for s in start for u in s.users], ancestors)
    return [n for n in end.graph.nodes if n in reached]


def _find(graph, module: str, targets) -> list[Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in targets and module_path(n) == module]


def _selective_regions(gm: GraphModule, structure) -> list[RecomputeRegion]:
    regions = []
    for region in structure.regions:
        rows = [n for row in region.rows for n in _find(gm.graph, row.module, PROJECTION_OPS)]
        if region.kind == "attention":
            start = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in PROGRAM_ATTENTION_OPS
                     and within(module_path(n), region.module)]
            include_start = True
        else:
            start = [n for col in region.columns for n in _find(gm.graph, col.module, PROJECTION_OPS)]
            include_start = False
        if not start or len(rows) != 1:
            raise AutoparError(
                f"autopar: recompute=selective found no {region.kind} op and single row projection in "
                f"'{region.module}' after the earlier passes; use recompute=full (or none) for this model.")
        nodes = _between(start, rows[0])
        if include_start:
            nodes = [n for n in gm.graph.nodes if n in set(start) | set(nodes)]
        if any(_forward_collective(n) and n.target not in CP_ATTENTION_OPS for n in nodes):
            raise AutoparError(
                f"autopar: recompute=selective would recompute a collective in '{region.module}'; this is an "
                "autopar bug, please report it with the plan.")
        regions.append(RecomputeRegion(region.kind, region.module, tuple(nodes)))
    return regions


def find_regions(gm: GraphModule, structure, mode: str) -> list[RecomputeRegion]:
    """The regions ``recompute=mode`` recomputes in ``gm`` (see the module docstring)."""
    if structure.moe:
        raise AutoparError(
            f"autopar: recompute={mode} on a mixture-of-experts model is not supported yet (the expert "
            f"bodies and their routed activations are not cut into recomputed regions); use recompute=none.")
    if mode == "full":
        if not structure.layers:
            raise AutoparError(
                "autopar: recompute=full found no decoder layers in this model (a ModuleList of blocks "
                "whose paths end in an index, e.g. 'model.layers.0'); use recompute=none.")
        free = _free(gm.graph, {name for name, _ in gm.named_parameters()})
        regions = [_layer_region(gm, layer, free) for layer in structure.layers]
        return [r for r in regions if r is not None]
    if mode == "selective":
        if not structure.regions:
            raise AutoparError(
                "autopar: recompute=selective found no attention or MLP region in this model (linear "
                "projections around an attention op, or two levels of linears); use recompute=none.")
        return _selective_regions(gm, structure)
    raise AutoparError(f"autopar: recompute_pass runs for recompute=selective or full, not {mode!r}")


# ---- cutting a region out of the graph ---------------------------------------------------

def _make_contiguous(graph: Graph, members: set[Node]) -> None:
    """Make the region one run of nodes: the other nodes between its first and last node that
    lie on a path from the region back into it join it (a bias the TP pass moved behind a
    reduction, inside a layer); of the rest, those the region reads move before it, the others
    after it."""
    order = list(graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    first, last = min(index[n] for n in members), max(index[n] for n in members)
    span = [n for n in order[first:last + 1] if n not in members]
    if not span:
        return
    in_span = set(span)
    feeds = _reach({i for m in members for i in m.all_input_nodes}, in_span, upstream=True)
    between = feeds & _reach({u for m in members for u in m.users}, in_span)
    members |= between
    head, anchor = order[first], order[last]
    for n in span:
        if n in feeds and n not in between:
            head.prepend(n)
    for n in span:
        if n not in feeds:
            anchor.append(n)
            anchor = n


def _stack_to(node: Node, module: str) -> dict:
    """``node``'s module stack up to and including ``module``."""
    out = {}
    for key, (path, kind) in (node.meta.get("nn_module_stack") or {}).items():
        out[key] = (path, kind)
        if path == module:
            break
    return out


def _copy_meta(src: Node, dst: Node) -> None:
    for key in COPIED_META:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _attr_name(gm: GraphModule, module: str) -> str:
    base = "recompute_" + re.sub(r"\W", "_", module)
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _outline(gm: GraphModule, region: RecomputeRegion, reason: str) -> Node:
    """Replace ``region``'s nodes by a call of a :class:`Recompute` body; returns the call."""
    graph = gm.graph
    members = set(region.nodes)
    _make_contiguous(graph, members)
    ordered = [n for n in graph.nodes if n in members]
    inputs = list(dict.fromkeys(i for n in ordered for i in n.all_input_nodes if i not in members))
    outputs = [n for n in ordered if any(u not in members for u in n.users)]
    body_graph = Graph()
    env: dict[Node, Node] = {}
    for x in inputs:
        ph = body_graph.placeholder(x.name)
        _copy_meta(x, ph)
        provenance(ph, _PASS, None, f"input of the body recomputed for {region.module}")
        env[x] = ph
    for n in ordered:
        env[n] = body_graph.node_copy(n, lambda x: env[x])
    body_graph.output(tuple(env[o] for o in outputs))
    body = GraphModule(torch.nn.Module(), body_graph, class_name="RecomputeBody")
    name = _attr_name(gm, region.module)
    gm.add_submodule(name, Recompute(body, region.kind, region.module))
    with graph.inserting_after(ordered[-1]):
        call = graph.call_module(name, tuple(inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    call.meta["nn_module_stack"] = _stack_to(ordered[0], region.module)
    call.meta["stack_trace"] = ordered[0].meta.get("stack_trace")
    provenance(call, _PASS, None, reason, role="recompute")
    anchor = call
    for j, o in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, j))
        _copy_meta(o, item)
        provenance(item, _PASS, None, f"output {j} of the body recomputed for {region.module}")
        o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        anchor = item
    for n in reversed(ordered):
        graph.erase_node(n)
    return call


_REASONS = {
    "layer": "recompute=full: the decoder layer {m} runs again in backward from its input",
    "attention": "recompute=selective: the attention core of {m} (through its output projection) runs again "
                 "in backward; its output and log-sum-exp are not kept",
    "mlp": "recompute=selective: the activation function of {m} (through the down projection) runs again in "
           "backward; its outputs are not kept",
}


def recompute_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult(_PASS)
    mode = ctx.plan.recompute
    regions = find_regions(gm, ctx.structure, mode)
    for region in regions:
        _outline(gm, region, _REASONS[region.kind].format(m=region.module))
        result.num_inserted += 1
        result.num_rewritten += len(region.nodes)
    kinds = sorted({r.kind for r in regions})
    result.notes.append(f"recompute={mode}: {len(regions)} regions ({', '.join(kinds)})")
    return result
