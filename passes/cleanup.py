"""Normalise the exported graph: one name per tensor, and no export-time shape checks.

Tied weights (an LM head sharing the embedding's table) reach the graph under two
attribute names for one tensor.  Every later stage keys layouts and gradients by name, so
this pass points every ``get_attr`` at one canonical name per tensor and drops the aliases.

``torch.export`` leaves ``aten._assert_tensor_metadata`` nodes and a ``_guards_fn`` call
that check the *global* example's shapes, dtypes and guards.  After sharding, every rank
sees local shapes, so the checks would fire (or be meaningless).  This pass removes them
deliberately, first in the pipeline; the removal is logged.

Neighbours: ``passes/runner.py`` runs it; ``autopar/trace.py`` produced the graph.
"""
from __future__ import annotations

from torch.fx import GraphModule

from autopar.compat import ASSERT_METADATA_OPS, is_guards_call
from .context import PassContext, PassResult

__all__ = ["cleanup_pass"]

def _dedupe_tied(gm: GraphModule, result: PassResult) -> None:
    canonical: dict[int, str] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        canonical.setdefault(id(t), name)
    aliases: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, leaf = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner) if owner else gm, leaf)
        name = canonical.get(id(value))
        if name is not None and name != node.target:
            aliases[node.target] = name
            node.target = name
    for alias, name in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)
        result.notes.append(f"'{alias}' is tied to '{name}'")


def cleanup_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("cleanup_pass")
    _dedupe_tied(gm, result)
    for node in list(gm.graph.nodes):
        is_check = node.op == "call_function" and node.target in ASSERT_METADATA_OPS
        is_guard = is_guards_call(node)
        if (is_check or is_guard) and not node.users:
            gm.graph.erase_node(node)
            result.num_rewritten += 1
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards_fn"):
            delattr(gm, name)
    gm.graph.eliminate_dead_code()
    result.notes.append(f"removed {result.num_rewritten} export-time shape/dtype checks")
    return result
