"""Small FX helpers shared by the structure analysis (``analyze``, ``analyze_moe``) and the passes.

Where a node came from (its module path in ``nn_module_stack``) and the reshapes that sit
between a projection and its users (the op families themselves are ``op_sets``).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from autopar.frontend.op_sets import RESHAPE_OPS

__all__ = ["module_path", "within", "reshape_chain", "fused_chain", "fused_chain_dim"]


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


# Ops that read a tensor's shape, not its values: a projection whose output is also measured
# (Mamba's ``in_proj(x)`` whose length slices the convolution) still has one reader of its values.
_SHAPE_READS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
                          torch.ops.aten.sym_stride.int})


def value_users(node: Node) -> list[Node]:
    """The users of ``node`` that read its values (not only its sizes)."""
    return [u for u in node.users if u.target not in _SHAPE_READS]


def reshape_chain(node: Node) -> list[Node]:
    """``node`` and the single-user reshapes that follow it (Conv1D-style ``view`` around addmm)."""
    chain = [node]
    while len(value_users(chain[-1])) == 1 and value_users(chain[-1])[0].target in RESHAPE_OPS:
        chain.append(value_users(chain[-1])[0])
    return chain


def fused_chain(node: Node) -> list[Node]:
    """The nodes of :func:`fused_chain_dim`."""
    return fused_chain_dim(node)[0]


def fused_chain_dim(node: Node) -> tuple[list[Node], int]:
    """:func:`reshape_chain`, then the single-user unsqueezes and transposes that keep the features
    whole: what sits between a fused projection and the split of its parts (GPT-BigCode's
    ``c_attn(x).unsqueeze(1).split(...)``, LFM's ``in_proj(x).transpose(-1, -2).chunk(3, dim=-2)``),
    and the dim of the chain's last node that holds the projection's features."""
    chain = reshape_chain(node)
    val = chain[-1].meta.get("val")
    dim = val.dim() - 1 if hasattr(val, "dim") else -1
    while dim >= 0 and len(value_users(chain[-1])) == 1:
        user = value_users(chain[-1])[0]
        ndim = user.meta["val"].dim() if hasattr(user.meta.get("val"), "dim") else 0
        if user.target is torch.ops.aten.unsqueeze.default and ndim:
            at = user.args[1] % ndim
            if at == ndim - 1 and dim == ndim - 2:  # a new last dim behind the features
                break
            dim += at <= dim
        elif user.target is torch.ops.aten.transpose.int and ndim:
            a, b = user.args[1] % ndim, user.args[2] % ndim
            dim = b if dim == a else a if dim == b else dim
        else:
            break
        chain.append(user)
    return chain, dim
