"""The heads of an attention core, read from its operands' shapes (for ``analyze``).

Two forms of the core are recognised:

- an attention op (``scaled_dot_product_attention``): q ``[b, a, s, d]``, k ``[b, g', s, d]``;
- *eager* attention, a softmax between two matmuls (Gemma 2's soft-capped scores): the scores
  ``q @ k^T`` (q ``[b, a, s, d]``, k^T ``[b, g', d, s]``), elementwise ops (scale, soft cap,
  mask), the softmax over the keys, then ``probs @ v``.

In both, GQA written as a broadcast (``expand`` / ``broadcast_to``) of the KV heads before the
core makes ``g' = a``; the KV heads ``g`` are ``g'`` over the copies the broadcast makes.
:func:`strip_gqa` undoes Llama's ``repeat_kv`` right before the op (``passes/context_parallel.py``
then moves ``g`` heads); a broadcast followed by other ops (Falcon's RoPE after the expand) stays.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar.frontend.op_sets import SIZED_RESHAPE_OPS, SOFTMAX_OPS

aten = torch.ops.aten

__all__ = ["attention_dims", "eager_attention_dims", "strip_gqa"]

_MATMUL = aten.matmul.default
_LINEARS = {aten.linear.default, aten.addmm.default, _MATMUL}
_FULL_SLICE_END = 2 ** 62


def attention_dims(op: Node) -> tuple[int, int, int]:
    """``(heads, kv heads, head dim)`` of an attention op."""
    return _core_dims(op.args[0], op.args[1], bool(op.kwargs.get("enable_gqa")))


def eager_attention_dims(gm: GraphModule) -> tuple[int, int, int] | None:
    """``(heads, kv heads, head dim)`` of the first eager attention core of ``gm``, or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in SOFTMAX_OPS:
            scores = _scores_matmul(node)
            if scores is not None and _feeds_matmul(node):
                return _core_dims(scores.args[0], scores.args[1], False)
    return None


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _head_shaped(node) -> bool:
    val = _val(node)
    return val is not None and val.dim() == 4


def _scores_matmul(softmax: Node, depth: int = 8) -> Node | None:
    """The ``q @ k^T`` of 4-D head-shaped operands a few ops (along first inputs) before ``softmax``."""
    node = softmax.args[0]
    for _ in range(depth):
        if not isinstance(node, Node) or node.op != "call_function":
            return None
        if node.target is _MATMUL:
            return node if _head_shaped(node.args[0]) and _head_shaped(node.args[1]) else None
        node = node.args[0] if node.args else None
    return None


def _feeds_matmul(softmax: Node, depth: int = 4) -> bool:
    """Do the probabilities reach the first operand of a 4-D matmul (``probs @ v``) within a few ops?"""
    todo = [(softmax, 0)]
    while todo:
        node, level = todo.pop()
        for user in node.users:
            if user.target is _MATMUL and user.args[0] is node and _head_shaped(user.args[1]):
                return True
            if level < depth:
                todo.append((user, level + 1))
    return False


def _core_dims(q: Node, k: Node, enable_gqa: bool) -> tuple[int, int, int]:
    qv, kv = _val(q), _val(k)
    num_heads, head_dim = int(qv.shape[-3]), int(qv.shape[-1])
    num_kv_heads = int(kv.shape[-3])
    if enable_gqa:
        return num_heads, num_kv_heads, head_dim
    # GQA written as a broadcast (expand / broadcast_to) + reshape of K: the copies it makes of each
    # KV head (Llama's [b, kv, 1, s, d] -> [b, kv, rep, s, d]; Falcon's [b, s, g, 1, d] -> [b, s, g, rep, d]).
    node = k
    while isinstance(node, Node) and node.op == "call_function":
        if node.target in (aten.expand.default, aten.broadcast_to.default) and node.args[0].meta["val"].dim() == 5:
            before, after = node.args[0].meta["val"].shape, node.meta["val"].shape
            copies = 1
            for a, b in zip(before, after):
                if isinstance(a, int) and isinstance(b, int) and a == 1 and b > 1:
                    copies *= b
            num_kv_heads //= copies
            break
        if node.target in _LINEARS:
            break
        node = _main_input(node)
    return num_heads, num_kv_heads, head_dim


def _main_input(node: Node) -> Node | None:
    """The input a head-shaped value comes from: the first argument, or for a ``cat`` (a KV
    cache's legacy empty tensor joined to the new keys) its largest part."""
    first = node.args[0] if node.args else None
    if isinstance(first, (list, tuple)):
        parts = [p for p in first if isinstance(p, Node) and isinstance(p.meta.get("val"), torch.Tensor)]
        return max(parts, key=lambda p: p.meta["val"].dim(), default=None)
    return first


def _is_full_slice(node: Node) -> bool:
    return (node.op == "call_function" and node.target is aten.slice.Tensor
            and (len(node.args) < 3 or node.args[2] in (0, None))
            and (len(node.args) < 4 or node.args[3] is None or node.args[3] >= _FULL_SLICE_END))


def _skip_slices(node: Node) -> Node:
    while _is_full_slice(node):
        node = node.args[0]
    return node


def strip_gqa(node: Node) -> tuple[Node, int]:
    """``reshape(expand(unsqueeze(x, 2)))`` that repeats K/V heads -> (x, groups); else (node, 1)."""
    r = node
    if r.op != "call_function" or r.target not in SIZED_RESHAPE_OPS:
        return node, 1
    e = _skip_slices(r.args[0])
    if e.op != "call_function" or e.target is not aten.expand.default:
        return node, 1
    u = _skip_slices(e.args[0])
    if u.op != "call_function" or u.target is not aten.unsqueeze.default or u.args[1] != 2:
        return node, 1
    groups = e.args[1][2]
    if not isinstance(groups, int) or groups < 1:
        return node, 1
    return _skip_slices(u.args[0]), groups
