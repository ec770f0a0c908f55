"""Sharding rules where activations meet weights: linear, addmm, mm, batched matmul, outer
products, attention, a depthwise convolution, and the embedding lookup.

A column-parallel weight (sharded on its output features) shards the output's last dim; a
row-parallel one (sharded on its input features, meeting an input sharded alike) leaves a
partial sum, which the TP pass reduces right after.  Attention keeps its heads' shard
(replicated K and V, under KV-head replication, are cut to this rank's query heads first).
A depthwise convolution (a mixer's ``conv1d`` over its channels, ``groups`` = channels) keeps the
rank's channels: its weight and bias are cut to them (block by block where the channels are
parts side by side, ``passes/block_layout.py``); over the sequence it needs every position's
neighbours, so a sequence shard is refused.  Registered in the one registry of ``passes/rules.py``.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.frontend.op_sets import SIZED_RESHAPE_OPS
from .op_sets import SDPA_OPS
from .rules import P, R, RuleContext, ndim_of, register, shape_of, size_expr
from .view_rules import view_rule

__all__ = ["linear_rule", "addmm_rule", "mm_rule", "batched_matmul_rule", "outer_rule", "sdpa_rule",
           "conv1d_rule", "embedding_rule"]

aten = torch.ops.aten


# --- matmuls --------------------------------------------------------------------------

@register(aten.linear.default)
def linear_rule(node: Node, pls: list, rc: RuleContext):
    x, w = pls[0], pls[1]
    b = pls[2] if len(pls) > 2 else R
    nd = ndim_of(node)
    if isinstance(w, Shard) and w.dim == 0 and isinstance(x, Replicate) and not isinstance(b, Partial):
        if isinstance(b, Replicate) and len(pls) > 2:
            raise rc.fail(node, "column-parallel weight with a replicated bias")
        return Shard(nd - 1)
    if isinstance(w, Shard) and w.dim == 1 and isinstance(x, Shard) and x.dim == nd - 1:
        if len(pls) > 2:
            raise rc.fail(node, "row-parallel linear still has its bias (the TP pass moves it after the reduction)")
        return P
    if isinstance(w, Replicate) and isinstance(b, Replicate):
        if isinstance(x, Shard) and x.dim < nd - 1:
            return x
        if isinstance(x, (Replicate, Partial)):
            return x
    raise rc.fail(node, f"input {x}, weight {w}, bias {b} do not form a column- or row-parallel linear")


@register(aten.addmm.default)
def addmm_rule(node: Node, pls: list, rc: RuleContext):
    b, x, w = pls
    if isinstance(w, Shard) and w.dim == 1 and isinstance(x, Replicate) and isinstance(b, Shard):
        return Shard(1)
    if isinstance(w, Shard) and w.dim == 0 and isinstance(x, Shard) and x.dim == 1 and isinstance(b, Replicate):
        raise rc.fail(node, "row-parallel addmm with a bias (the TP pass should have split the bias)")
    if all(isinstance(p, Replicate) for p in (b, w)) and isinstance(x, Shard) and x.dim == 0:
        return x
    raise rc.fail(node, f"bias {b}, input {x}, weight {w} do not form a column- or row-parallel addmm")


@register(aten.mm.default)
def mm_rule(node: Node, pls: list, rc: RuleContext):
    x, w = pls
    if isinstance(x, Replicate) and isinstance(w, Shard) and w.dim == 1:
        return Shard(1)
    if isinstance(x, Shard) and x.dim == 1 and isinstance(w, Shard) and w.dim == 0:
        return P
    if isinstance(x, Shard) and x.dim == 0 and isinstance(w, Replicate):
        return x
    raise rc.fail(node, f"operands {x}, {w} do not form a parallel matmul")


@register(aten.matmul.default, aten.bmm.default)
def batched_matmul_rule(node: Node, pls: list, rc: RuleContext, operands: tuple | None = None):
    """``operands``: the two matrices' nodes where they are not the op's first two arguments (baddbmm)."""
    a, b = pls
    x, y = operands or node.args[:2]
    nd = ndim_of(node)
    if isinstance(a, Replicate) and isinstance(b, Replicate):
        return R
    if {type(a), type(b)} == {Partial, Replicate}:  # linear in each operand: the partial sum stays one
        return P
    if isinstance(a, Shard) and isinstance(b, Shard):
        da, db = a.dim + nd - ndim_of(x), b.dim + nd - ndim_of(y)
        if da == db and da < nd - 2:
            return Shard(da)
    if isinstance(a, Shard) and isinstance(b, Replicate) and a.dim + nd - ndim_of(x) < nd - 1:
        return _batch_shard(node, y, a.dim + nd - ndim_of(x), rc)
    if isinstance(a, Replicate) and isinstance(b, Shard) and b.dim + nd - ndim_of(y) < nd - 2:
        return _batch_shard(node, x, b.dim + nd - ndim_of(y), rc)
    if isinstance(a, Replicate) and isinstance(b, Shard) and ndim_of(y) >= 2 \
            and b.dim == ndim_of(y) - 1:  # columns of b: e.g. inv_freq @ positions (RoPE)
        return Shard(nd - 1)
    if isinstance(a, Shard) and isinstance(b, Shard) and not rc.local_sizes and ndim_of(y) == 2 \
            and a.dim == ndim_of(x) - 1 and b.dim == 0:  # row-parallel ``x @ w.T``: partial sums
        return P
    raise rc.fail(node, f"operands {a}, {b} are not sharded on a common batch dim")


def _batch_shard(node: Node, replicated: Node, dim: int, rc: RuleContext) -> Shard:
    """The output is sharded on ``dim`` (a batch dim, or the rows of the first operand); where
    ``dim`` is a batch dim of the ``replicated`` operand at full size (not broadcast), that operand
    is sliced to this rank's part first (a state built with ``zeros`` over every head, met by
    the rank's heads): no communication."""
    nd = ndim_of(node)
    d = dim - (nd - ndim_of(replicated))
    if dim < nd - 2 and 0 <= d < ndim_of(replicated) - 2 and shape_of(replicated)[d] != 1:
        rc.shard_operand(node, replicated, d)
    return Shard(dim)


@register(aten.baddbmm.default)
def baddbmm_rule(node: Node, pls: list, rc: RuleContext):
    """``beta * input + alpha * (batch1 @ batch2)``: the product placed as ``bmm`` places it, the
    added input placed like the product; a replicated input at full size along the product's
    sharded dim is cut to this rank's part (Bloom's ALiBi bias over every head, [b * heads, 1, s],
    met by the rank's heads: its share of every run of heads)."""
    inp, b1, b2 = pls
    if any(isinstance(p, Partial) for p in pls):
        raise rc.fail(node, f"a partial sum in baddbmm {pls}")
    if isinstance(b1, Replicate) and isinstance(b2, Replicate):
        if isinstance(inp, Shard):
            raise rc.fail(node, f"adds a product of replicated batches to an input placed {inp}")
        return R
    product = batched_matmul_rule(node, [b1, b2], rc, operands=(node.args[1], node.args[2]))
    if isinstance(product, Shard) and isinstance(inp, Replicate):
        d = product.dim - (3 - ndim_of(node.args[0]))
        if d >= 0 and size_expr(shape_of(node.args[0])[d]) != 1:
            rc.shard_operand(node, node.args[0], d)
    elif inp != product and not (isinstance(inp, Shard) and isinstance(product, Shard)
                                 and inp.dim + 3 - ndim_of(node.args[0]) == product.dim):
        raise rc.fail(node, f"adds a product placed {product} to an input placed {inp}")
    return product


@register(aten.outer.default)
def outer_rule(node: Node, pls: list, rc: RuleContext):
    """``outer(a, b)[i, j] = a[i] * b[j]``: a's shard is the rows, b's the columns (not both)."""
    a, b = pls
    if isinstance(a, Partial) or isinstance(b, Partial):
        if isinstance(a, Replicate) or isinstance(b, Replicate):
            return a if isinstance(a, Partial) else b
        raise rc.fail(node, f"outer product of {a} and {b}")
    if isinstance(a, Shard) and isinstance(b, Shard):
        raise rc.fail(node, "outer product of two sharded vectors")
    return Shard(0) if isinstance(a, Shard) else Shard(1) if isinstance(b, Shard) else R


@register(aten.einsum.default)
def einsum_rule(node: Node, pls: list, rc: RuleContext):
    """``einsum(equation, operands)`` by the letters of the equation: every sharded operand must be
    split on one letter; a letter the output keeps gives its position's shard (an operand holding
    the letter unsplit is sliced to the rank's part, where sizes are global), a summed letter split
    in every operand holding it gives partial sums.  One partial operand among replicated ones
    stays partial (einsum is linear in each operand)."""
    equation = node.args[0].replace(" ", "")
    ins, out = equation.split("->") if "->" in equation else (equation, None)
    subs = ins.split(",")
    if out is None or "." in equation or len(subs) != len(pls):
        raise rc.fail(node, f"einsum '{equation}' without an explicit output or with an ellipsis")
    partial = [i for i, pl in enumerate(pls) if isinstance(pl, Partial)]
    if partial:
        if len(partial) == 1 and all(isinstance(pl, Replicate) for i, pl in enumerate(pls) if i != partial[0]):
            return pls[partial[0]]
        raise rc.fail(node, f"einsum '{equation}' of partial operands {pls}")
    letters = {subs[i][pl.dim] for i, pl in enumerate(pls) if isinstance(pl, Shard)}
    if not letters:
        return R
    if len(letters) > 1:
        raise rc.fail(node, f"einsum '{equation}' of operands split on different letters {sorted(letters)}")
    (letter,) = letters
    holding = [i for i, sub in enumerate(subs) if letter in sub]
    if any(sub.count(letter) > 1 for sub in subs) or out.count(letter) > 1:
        raise rc.fail(node, f"einsum '{equation}' repeats the split letter '{letter}'")
    if letter not in out:
        if rc.local_sizes or not all(isinstance(pls[i], Shard) for i in holding):
            raise rc.fail(node, f"einsum '{equation}' sums over the split letter '{letter}' of {pls}")
        return P
    for i in holding:
        if isinstance(pls[i], Replicate) and size_expr(shape_of(node.args[1][i])[subs[i].index(letter)]) != 1:
            rc.shard_operand(node, node.args[1][i], subs[i].index(letter))
    return Shard(out.index(letter))


# --- attention and the embedding ------------------------------------------------------

def _replicated_kv(node: Node, pls: list, heads: int, rc: RuleContext) -> list:
    """Query heads sharded, K or V replicated (KV-head replication, ``passes/tensor_parallel.py``):
    an operand broadcast to every query head is cut to this rank's heads (the broadcast of one KV
    head made to this rank's copies only, :func:`_local_copies`; else a ``local_shard`` of it,
    whose backward makes its gradient partial); one KV head read by every query head
    (``enable_gqa``) serves this rank's query heads as it is.  Returns the placements the op then
    sees."""
    q = pls[0]
    if rc.local_sizes or not (isinstance(q, Shard) and q.dim == heads):
        return pls
    out = list(pls)
    num_heads = shape_of(node.args[0])[heads]
    for i in (1, 2):
        if not isinstance(pls[i], Replicate):
            continue
        kv_heads = shape_of(node.args[i])[heads]
        if kv_heads == num_heads and _local_copies(node.args[i], heads, rc):
            out[i] = Shard(heads)
        elif kv_heads == num_heads:
            rc.shard_operand(node, node.args[i], heads,
                             f"KV-head replication: this rank's query heads' copies of the replicated "
                             f"{'keys' if i == 1 else 'values'} {node.args[i].name} (no communication)")
            out[i] = Shard(heads)
        elif kv_heads == 1 and node.kwargs.get("enable_gqa"):
            out[i] = Shard(heads)  # the one KV head is every local query head's
        else:
            raise rc.fail(node, f"{'key' if i == 1 else 'value'} with {kv_heads} replicated heads meets "
                                f"{num_heads} query heads split over {rc.axis}",
                          "KV-head replication needs K and V broadcast to every query head before the "
                          "attention op (as repeat_kv does), or a tp that divides the KV heads.")
    return out


def _local_copies(kv: Node, heads: int, rc: RuleContext) -> bool:
    """One KV head broadcast to every query head (``repeat_kv`` of multi-query attention:
    ``expand`` ``[.., 1, 1, s, d] -> [.., 1, n, s, d]``, then ``reshape`` to ``[.., n, s, d]``, each
    used once): the broadcast makes only this rank's ``n/tp`` copies instead, so no rank builds
    every query head's copy (the two ops' sizes rewritten, placed on the copies).  Returns
    whether it did; otherwise the caller slices the broadcast's result."""
    expand = kv.args[0] if kv.target in SIZED_RESHAPE_OPS else None
    if expand is None or expand.target is not aten.expand.default or len(kv.users) != 1 \
            or len(expand.users) != 1 or rc.placements is None:
        return False
    src, out, merged = ([size_expr(x) for x in shape_of(n)] for n in (expand.args[0], expand, kv))
    if len(out) != len(merged) + 1 or len(src) != len(out) or out[:heads] != merged[:heads] \
            or out[heads + 2:] != merged[heads + 1:] or out[heads] != 1 or src[heads + 1] != 1 \
            or out[heads + 1] != merged[heads]:
        return False
    sizes = list(expand.args[1])
    sizes[heads + 1] = rc.local_size(expand, sizes[heads + 1])
    expand.args = (expand.args[0], sizes, *expand.args[2:])
    rc.placements[expand] = Shard(heads + 1)
    rc.placements[kv] = view_rule(kv, [Shard(heads + 1)], rc)
    return True


@register(*SDPA_OPS)
def sdpa_rule(node: Node, pls: list, rc: RuleContext):
    pls = _replicated_kv(node, pls, ndim_of(node) - 3, rc)
    q, k, v = pls[:3]
    nd = ndim_of(node)
    heads = nd - 3
    if all(isinstance(p, Shard) and p.dim == heads for p in (q, k, v)):
        for mask, pl in zip(node.args[3:4], pls[3:4]):
            if isinstance(pl, Replicate) and shape_of(mask)[heads - (nd - ndim_of(mask))] not in (1,):
                raise rc.fail(node, "the attention mask has one entry per head; heads are sharded")
        return Shard(heads)
    if all(isinstance(p, Replicate) for p in pls):
        return R
    if all(isinstance(p, Shard) and p.dim == 0 for p in (q, k, v)):
        return Shard(0)
    raise rc.fail(node, f"q/k/v placements {q}, {k}, {v}; expected all sharded on the heads dim {heads}")


@register(aten.conv1d.default)
def conv1d_rule(node: Node, pls: list, rc: RuleContext):
    """``conv1d(x [b, c, s], w [c_out, c_in / groups, k], bias, stride, padding, dilation, groups)``:
    batch rows are independent; a depthwise convolution (``groups`` = c = c_out) keeps each channel's
    own, so channel shards stay (``groups`` becomes the local count); the sequence dim is refused."""
    x, params = pls[0], pls[1:]
    if not any(isinstance(p, (Shard, Partial)) for p in pls):
        return R
    args = list(node.args) + [None, [1], [0], [1], 1][len(node.args) - 2:]
    channels, groups = shape_of(node.args[0])[1], args[6]
    if isinstance(x, Shard) and x.dim == 0 and all(isinstance(p, Replicate) for p in params):
        return x
    if isinstance(x, Shard) and x.dim == 1 and groups == channels == shape_of(node.args[1])[0] and \
            all(isinstance(p, Replicate) for p in params) and not rc.local_sizes:
        for arg in (a for a in (node.args[1], args[2]) if isinstance(a, Node)):
            rc.shard_operand(node, arg, 0, f"the channels of depthwise conv weight {arg.name} this rank holds")
        args[:3] = (list(node.args) + [None])[:3]  # the operands as cut
        blocks, whole = node.args[0].meta.get("autopar_blocks"), node.args[0].meta.get("autopar_whole")
        args[6] = (sum(b if w else rc.local_size(node, b) for b, w in zip(blocks, whole)) if blocks and whole
                   else rc.local_size(node, groups))  # blocks kept whole keep all their channels
        node.args = tuple(args)
        return x
    if isinstance(x, Shard) and x.dim == 2:
        raise rc.fail(node, "a convolution along the sharded sequence: each position reads its kernel's "
                            "neighbours, which another rank holds",
                      f"The module is a sequence mixer (a state-space or linear-attention layer) that needs the "
                      f"whole sequence; use a plan without {rc.axis} for this model.")
    raise rc.fail(node, f"convolution with input, weight and bias placed {pls} (groups={groups}, {channels} channels)")


@register(aten.embedding.default)
def embedding_rule(node: Node, pls: list, rc: RuleContext):
    w, ids = pls[:2]
    if isinstance(w, Replicate) and not isinstance(ids, Partial):
        return ids
    raise rc.fail(node, f"embedding with weight {w} and indices {ids}",
                  "The TP pass replaces vocabulary-sharded embeddings with vocab_parallel_embedding.")
