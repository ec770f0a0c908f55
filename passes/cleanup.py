"""Remove export-time checks that no longer hold once shapes are rewritten to local shards.

``torch.export`` leaves ``aten._assert_tensor_metadata`` nodes and a ``_guards_fn`` call
that check the *global* example's shapes, dtypes and guards.  After sharding, every rank
sees local shapes, so the checks would fire (or be meaningless).  This pass removes them
deliberately, first in the pipeline; the removal is logged.

Neighbours: ``passes/runner.py`` runs it; ``autopar/trace.py`` produced the graph.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from .context import PassContext, PassResult

__all__ = ["cleanup_pass"]

_CHECK_OPS = {torch.ops.aten._assert_tensor_metadata.default}


def cleanup_pass(gm: GraphModule, plan, ctx: PassContext) -> PassResult:
    result = PassResult("cleanup_pass")
    for node in list(gm.graph.nodes):
        is_check = node.op == "call_function" and node.target in _CHECK_OPS
        is_guard = node.op == "call_module" and str(node.target).startswith("_guards_fn")
        if (is_check or is_guard) and not node.users:
            gm.graph.erase_node(node)
            result.num_rewritten += 1
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards_fn"):
            delattr(gm, name)
    gm.graph.eliminate_dead_code()
    result.notes.append(f"removed {result.num_rewritten} export-time shape/dtype checks")
    return result
