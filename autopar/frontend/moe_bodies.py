"""The experts' own computation cut out of a traced MoE block as a graph of its own, and the graph
walks the MoE analysis shares.

Part of the MoE analysis (:mod:`autopar.frontend.analyze_moe` finds the blocks and calls
:func:`extract_body` for each; ``passes/expert_parallel.py`` and ``passes/dense_expert_parallel.py``
run the bodies on a rank's rows or experts).  A body is every node computing the experts' output
from their inputs (the routed tokens, the per-expert offsets or scores, each row's expert id) and
parameters; anything else it would read is refused, so the body is exactly the user's expert code.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from autopar.errors import AutoparError, describe_node

aten = torch.ops.aten

__all__ = ["descendants", "ancestors", "order", "param_only", "walk_inputs", "body_members", "extract_body"]


def _reach(roots: list[Node], step) -> set[Node]:
    out: set[Node] = set()
    todo = list(roots)
    while todo:
        for n in step(todo.pop()):
            if n not in out:
                out.add(n)
                todo.append(n)
    return out


def descendants(roots: list[Node]) -> set[Node]:
    """Every node that (transitively) uses one of ``roots``."""
    return _reach(roots, lambda n: n.users)


def ancestors(node: Node) -> set[Node]:
    return _reach([node], lambda n: n.all_input_nodes)


def order(node: Node) -> int:
    return node.meta["_autopar_order"]


def walk_inputs(out: Node, tokens: Node) -> list[Node]:
    """Nodes where a backward walk from ``out`` leaves the body (stops at tokens and parameters)."""
    seen, stops, todo = set(), [], [out]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in seen or a is tokens or a.op == "get_attr":
                continue
            seen.add(a)
            if a.op == "call_function" and (tokens in ancestors(a) or param_only(a)):
                todo.append(a)
            else:
                stops.append(a)
    return stops


def param_only(node: Node) -> bool:
    return all(a.op == "get_attr" or (a.op == "call_function" and param_only(a)) for a in node.all_input_nodes)


def body_members(inputs: list[Node], out: Node) -> tuple[set[Node], list[Node]]:
    """The nodes computing ``out`` from ``inputs`` and parameters, and the parameters they read
    (in graph order); refused where they read anything else."""
    routed = descendants(inputs)
    members: set[Node] = {out}
    used_params: list[Node] = []
    todo = [out]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in inputs or a in members:
                continue
            if a.op == "get_attr":
                if a not in used_params:
                    used_params.append(a)
                continue
            if a.op != "call_function" or not (a in routed or param_only(a)):
                raise AutoparError(f"autopar: the expert computation at {describe_node(n)} also reads "
                                   f"'{a.name}'; expected experts that depend only on their tokens and "
                                   "parameters. Use a plan with ep=1 and tp=1 for this model.")
            members.add(a)
            todo.append(a)
    return members, sorted(used_params, key=order)


def extract_body(tokens: Node, offsets: Node | None, out: Node, *, ids: Node | None = None,
                 offsets_name: str = "offsets") -> tuple[GraphModule, list[str]]:
    """The computation from ``tokens`` (and ``offsets``, and the rows' expert ``ids``) to ``out``
    as its own GraphModule.

    Its placeholders are ``tokens``, then ``offsets`` (named ``offsets_name``: dense experts'
    scores) and ``ids`` (each if given), then every parameter it uses, in the returned order; the
    body holds no state of its own.  ``ids`` may only index per-expert parameters (``p[ids]``):
    under ep a rank's ids count its own experts.
    """
    members, used_params = body_members([tokens] + [a for a in (offsets, ids) if a is not None], out)
    graph = Graph()
    env: dict[Node, Node] = {tokens: graph.placeholder("tokens")}
    if offsets is not None:
        env[offsets] = graph.placeholder(offsets_name)
    if ids is not None:
        env[ids] = graph.placeholder("expert_ids")
        bad = [u for u in ids.users if u in members and not (
            u.target is aten.index.Tensor and u.args[0].op == "get_attr" and list(u.args[1]) == [ids])]
        if bad:
            raise AutoparError(f"autopar: the expert computation at {describe_node(bad[0])} uses the sorted "
                               "expert ids other than to read a per-expert parameter; expected p[ids]. "
                               "Use a plan with ep=1 and tp=1 for this model.")
    for i, p in enumerate(used_params):
        env[p] = graph.placeholder(f"p{i}")
    for n in sorted(members, key=order):
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[out])
    body = GraphModule(torch.nn.Module(), graph)
    for n in body.graph.nodes:
        n.meta.pop("_autopar_order", None)
    return body, [p.target for p in used_params]
