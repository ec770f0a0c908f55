"""Sequence parallelism (Megatron SP) on top of tensor parallelism, axis ``tp``.

Outside the tensor-parallel regions (norms, residual adds, dropout) activations are
sharded along the sequence instead of replicated.  This pass rewrites the boundaries the
TP pass created:

- each region entry (identity forward / all-reduce backward) becomes an ``all_gather``
  along the sequence dim (backward: reduce-scatter);
- each all-reduce after a row-parallel projection or the vocabulary-parallel embedding
  becomes a ``reduce_scatter`` along the sequence dim (backward: all-gather).

Each all-gather keeps its sequence shard for backward and all-gathers it again there
(``regather``, :mod:`autopar.ops.regather`; Korthikanti et al.): the GEMMs after it save
``1/tp`` of their input, for one more all-gather per gather in backward.  The forward
volume equals TP's all-reduce; activation memory outside the regions drops by ``tp``.
Shard propagation (``passes/shard_propagation.py``) then places every op in between on
sequence shards, and marks replicated weights used there (the norms) as having partial
gradients, which the DP pass sums over ``tp``.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar.compat import rename_node
from autopar.errors import AutoparError, describe_node
from autopar.frontend.op_sets import SIZED_RESHAPE_OPS
from autopar.ops import collectives
from .context import META_KEY, PassContext, PassResult, provenance
from .rules import seq_size_dims, shape_of, size_expr
from .tensor_parallel import AXIS
from .view_rules import dim_groups

aten = torch.ops.aten

__all__ = ["sequence_parallel_pass"]

_PASS = "sequence_parallel_pass"

# TP boundary op -> (SP op, the TP roles it replaces, why)
_REWRITES = {
    collectives.region_entry: (collectives.all_gather, ("column_input", "lm_head_input"),
                               "gather sequence shards"),
    collectives.all_reduce: (collectives.reduce_scatter, ("row_output", "embedding_output"),
                             "reduce-scatter to sequence shards"),
}


def _seq_dim(node: Node, ctx: PassContext) -> int | None:
    """The dim of ``node``'s value that holds the sequence: its size is the traced sequence size (a
    symbol, or the length export specialised the sequence to)."""
    found = seq_size_dims(node, ctx.seq_symbol)
    # A specialised length may also be the size of another dim (hidden 32 at length 32): ambiguous.
    return found[0] if len(found) == 1 else None


def _no_seq_dim(node: Node, ctx: PassContext) -> AutoparError:
    val = node.meta.get("val")
    return AutoparError(
        f"autopar: sequence parallelism needs the sequence dimension on the activation at "
        f"{describe_node(node)}, found shape {tuple(getattr(val, 'shape', ()))} without the traced "
        f"sequence size {ctx.seq_symbol}; use a plan without 'sp' for this model.")


def _merged_seq(x: Node, ctx: PassContext) -> tuple[int, Node, list[int], int] | None:
    """Where ``x`` holds the sequence merged with other dims into one (OPT's layers flatten batch and
    sequence: ``reshape(-1, hidden)``): ``(dim, src, dims, at)``, the dim of ``x`` made by the view of
    ``src`` that merged ``src``'s ``dims``, the sequence being ``dims[at]``, found by following
    ``x``'s producers through the ops that keep that dim's size.  None where no such view is found."""
    ndim = len(shape_of(x))
    merged = [d for d, size in enumerate(shape_of(x)) if ctx.seq_symbol in size_expr(size).free_symbols]
    if len(merged) != 1:
        return None
    d, node = merged[0], x
    for _ in range(64):
        if node.target in SIZED_RESHAPE_OPS and isinstance(node.args[0], Node):
            src = node.args[0]
            for gi, gj in dim_groups(shape_of(src), shape_of(node)):
                seq = [i for i, k in enumerate(gi) if size_expr(shape_of(src)[k]) == ctx.seq_symbol]
                if gj == [d] and len(gi) > 1 and seq:
                    return d, src, gi, seq[0]
            return None
        same = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)
                and len(shape_of(a)) == ndim and size_expr(shape_of(a)[d]) == size_expr(shape_of(node)[d])]
        if not same:
            return None
        node = same[0]
    return None


def _size_args(gm: GraphModule, of: Node, dims: list[int], before: Node) -> list:
    """``of``'s sizes at ``dims`` as view arguments: ints, or ``sym_size`` nodes for symbolic sizes."""
    out = []
    for k in dims:
        size = shape_of(of)[k]
        if isinstance(size, int):
            out.append(size)
            continue
        with gm.graph.inserting_before(before):
            node = gm.graph.call_function(aten.sym_size.int, (of, k))
        node.meta["val"] = size
        out.append(node)
    return out


def _reshape(gm: GraphModule, x: Node, sizes: list, val, before: Node) -> Node:
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(aten.reshape.default, (x, sizes))
    node.meta.update(val=val, nn_module_stack=before.meta.get("nn_module_stack", {}),
                     stack_trace=before.meta.get("stack_trace"))
    return node


def _unmerge_around(gm: GraphModule, node: Node, ctx: PassContext) -> int:
    """Give the collective ``node`` its input with the merged sequence split back out (a view to the
    merged dims), and its users the result merged again; the sequence's dim in that view.  Shard
    propagation then checks the layout: the merged dim holds the rank's share of every run of the
    sequence (``passes/block_layout.py``'s "every" layout), which only views back may split."""
    x = node.args[0]
    found = _merged_seq(x, ctx)
    if found is None:
        raise _no_seq_dim(x, ctx)
    d, src, dims, at = found
    shape, ndim = shape_of(x), len(shape_of(x))
    sizes = (_size_args(gm, x, list(range(d)), node) + _size_args(gm, src, dims, node)
             + _size_args(gm, x, list(range(d + 1, ndim)), node))
    split_val = x.meta["val"].reshape(list(shape[:d]) + [shape_of(src)[k] for k in dims] + list(shape[d + 1:]))
    split = _reshape(gm, x, sizes, split_val, node)
    provenance(split, _PASS, AXIS, "split the merged sequence back out for its collective", role="sp_view")
    node.args = (split,) + tuple(node.args[1:])
    node.meta["val"] = split_val  # a collective's value, in global shapes, is its input's
    users = list(node.users)
    back = _reshape(gm, node, list(sizes[:d]) + [-1] + list(sizes[d + len(dims):]), x.meta["val"], node.next)
    provenance(back, _PASS, AXIS, "merge the sequence back as the model had it", role="sp_view")
    for user in users:
        user.replace_input_with(node, back)
    return d + at


def sequence_parallel_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult(_PASS)
    if ctx.seq_symbol is None:
        raise AutoparError("autopar: sequence parallelism needs a symbolic sequence dimension, but the "
                           "model was traced with a fixed sequence length; use a plan without 'sp'.")
    for node in list(gm.graph.nodes):
        meta = node.meta.get(META_KEY)
        role = meta.role if meta else None
        rewrite = _REWRITES.get(node.target)
        if rewrite is None or role not in rewrite[1]:
            continue
        new_target, _, reason = rewrite
        dim = _seq_dim(node.args[0], ctx)
        if dim is None:
            dim = _unmerge_around(gm, node, ctx)
        node.target = new_target
        node.args = (node.args[0], dim, AXIS, node.args[2])
        if new_target is collectives.all_gather:  # backward all-gathers the saved shard again (ops/regather.py)
            node.kwargs = {"regather": True}
        rename_node(node, new_target.__name__)
        provenance(node, _PASS, AXIS, f"{reason}: {meta.reason}", role=role)
        result.num_rewritten += 1
    return result
