"""Small FX helpers shared by the structure analysis (``analyze``, ``analyze_moe``) and the passes.

Where a node came from (its module path in ``nn_module_stack``) and the reshapes that sit
between a projection and its users (the op families themselves are ``op_sets``).
"""
from __future__ import annotations

from torch.fx import Node

from autopar.frontend.op_sets import RESHAPE_OPS

__all__ = ["module_path", "within", "reshape_chain"]


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
