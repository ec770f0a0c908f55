"""Small FX helpers shared by the structure analysis (``analyze``, ``analyze_moe``) and the passes.

Where a node came from (its module path in ``nn_module_stack``) and the reshape ops that
sit between a projection and its users.
"""
from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["module_path", "within", "RESHAPE_OPS", "SHAPED_FILLS", "reshape_chain"]

aten = torch.ops.aten

RESHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int}
# Fills shaped like their input: they read its shape (and dtype), never its values.
SHAPED_FILLS = {aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
                aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default}


def module_path(node: Node) -> str:
    """Innermost module path of a node ("" for the top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return "" if path.startswith("_empty") else path


def within(path: str, prefix: str) -> bool:
    """Whether module ``path`` is ``prefix`` or inside it."""
    return path == prefix or path.startswith(prefix + ".")


def reshape_chain(node: Node) -> list[Node]:
    """``node`` and the single-user reshapes that follow it (Conv1D-style ``view`` around addmm)."""
    chain = [node]
    while len(chain[-1].users) == 1 and next(iter(chain[-1].users)).target in RESHAPE_OPS:
        chain.append(next(iter(chain[-1].users)))
    return chain
