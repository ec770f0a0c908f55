"""ZeRO-3: parameters are gathered per unit just before their first use in the program.

Runs last (after shard propagation and the data-parallel pass), only for ``zero=3``.  The
trainable parameters are grouped into units: one per decoder layer (``structure.layers``
prefixes; a MoE layer's experts form a second unit, sharded over the ranks holding the same
experts) and two for the rest of the model: the parameters first read before the first layer's
(the embedding) and the others (final norm and LM head).  So under pp each unit belongs to one
pipeline chunk (``passes/pipeline.py`` copies a gather into the chunk that uses it), and without
pp the head's unit is released once the head's backward has reduce-scattered it, while the
embedding's is not re-gathered in backward (the lookup's backward reads only the indices;
a tied head's backward, or an embedding norm's, does read it, and then it is):
one unit of both would stay gathered from the head's backward to the embedding's, the whole
backward.  For each
unit the pass inserts ``autopar.ops.zero_gather.zero_gather(unit)`` right before the first node that
reads one of its parameters, and a ``getitem`` per parameter that replaces the parameter's
``get_attr``.  The parameter attributes stay in the module (the runtime keeps their
names and layouts for state dicts) but the program no longer reads them: at run time
:class:`autopar.runtime.gradients.zero_fsdp.FullyShardedSync` holds the parameters only as ``dp`` shards.

The unit's parameter names are recorded in the gather node's provenance
(``node.meta["autopar"].params``), which is where the runtime reads the units from.
Neighbours: ``passes/data_parallel.py`` (gradient buckets, ZeRO stages 0-2), :mod:`autopar.runtime.gradients.zero`
(the runtime side), ``cost/comm.py`` (one gather per unit and micro-batch, forward and
backward, and one gradient reduce-scatter per unit and micro-batch).
"""
from __future__ import annotations

import operator

from torch.fx import GraphModule

from autopar.ops.zero_gather import zero_gather
from .context import PassContext, PassResult, provenance

__all__ = ["zero3_pass", "zero_units"]


def zero_units(gm: GraphModule, ctx: PassContext) -> list[list[str]]:
    """Trainable parameter names grouped by decoder layer (a MoE layer's experts in a unit of
    their own: they shard over other ranks, see ``passes/data_parallel.py``), then the rest, in
    parameter order, split into what is first read before the first layer and the others."""
    layers = list(ctx.structure.layers)
    experts = set(ctx.expert_params)
    groups: dict[tuple[int, bool], list[str]] = {}
    before = _read_before_layers(gm, layers)
    for name, p in gm.named_parameters():
        if not p.requires_grad:
            continue
        unit = next((i for i, prefix in enumerate(layers) if name.startswith(prefix + ".")), None)
        if unit is None:
            unit = -1 if name in before else len(layers)
        groups.setdefault((unit, name in experts), []).append(name)
    return [groups[u] for u in sorted(groups)]


def _read_before_layers(gm: GraphModule, layers: list[str]) -> set[str]:
    """Parameters outside the layers first read (by graph order of their readers' users) before
    any parameter of a layer is."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    first: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            at = min(order[u] for u in node.users)
            first[node.target] = min(at, first.get(node.target, at))
    in_layers = [i for name, i in first.items() if any(name.startswith(p + ".") for p in layers)]
    start = min(in_layers, default=len(order))
    return {name for name, i in first.items() if i < start}


def zero3_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("zero3_pass")
    units = zero_units(gm, ctx)
    unit_of = {name: u for u, names in enumerate(units) for name in names}
    graph = gm.graph
    readers: dict[str, list] = {}
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in unit_of:
            readers.setdefault(node.target, []).append(node)
    order = {node: i for i, node in enumerate(graph.nodes)}
    # Units in the order the program first reads them, so the unit index is the gather order.
    first_use = {}
    for name, nodes in readers.items():
        users = [user for n in nodes for user in n.users]
        if users:
            first = min(users, key=order.__getitem__)
            u = unit_of[name]
            if u not in first_use or order[first] < order[first_use[u]]:
                first_use[u] = first
    used_units = sorted(first_use, key=lambda u: order[first_use[u]])
    ordered = [units[u] for u in used_units]
    for new_index, old in enumerate(used_units):
        names = units[old]
        with graph.inserting_before(first_use[old]):
            gather = graph.call_function(zero_gather, (new_index,))
            provenance(gather, "zero3_pass", "dp", f"ZeRO-3 all-gather of unit {new_index} before first use",
                       params=tuple(names))
            for j, name in enumerate(names):
                item = graph.create_node("call_function", operator.getitem, (gather, j),
                                         name=name.replace(".", "_") + "_full")
                for attr in readers.get(name, []):
                    if "val" in attr.meta:
                        item.meta["val"] = attr.meta["val"]
                    attr.replace_all_uses_with(item)
                    graph.erase_node(attr)
                    result.num_rewritten += 1
        result.num_inserted += 1
    unused = [n for u, names in enumerate(units) if u not in first_use for n in names]
    if unused:
        result.notes.append(f"parameters never read by the program stay unsharded: {unused[:3]}")
    result.notes.append(f"{len(ordered)} ZeRO-3 units")
    return result
