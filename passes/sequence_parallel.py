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

from autopar.compat import rename_node, sym_expr
from autopar.ops import collectives
from autopar.errors import AutoparError, describe_node
from .context import META_KEY, PassContext, PassResult, provenance
from .tensor_parallel import AXIS

__all__ = ["sequence_parallel_pass"]

_PASS = "sequence_parallel_pass"

# TP boundary op -> (SP op, the TP roles it replaces, why)
_REWRITES = {
    collectives.region_entry: (collectives.all_gather, ("column_input", "lm_head_input"),
                               "gather sequence shards"),
    collectives.all_reduce: (collectives.reduce_scatter, ("row_output", "embedding_output"),
                             "reduce-scatter to sequence shards"),
}


def _seq_dim(node: Node, ctx: PassContext) -> int:
    val = node.meta.get("val")
    for d, size in enumerate(getattr(val, "shape", ())):
        if isinstance(size, torch.SymInt) and sym_expr(size) == ctx.seq_symbol:
            return d
    raise AutoparError(
        f"autopar: sequence parallelism needs the sequence dimension on the activation at "
        f"{describe_node(node)}, found shape {tuple(getattr(val, 'shape', ()))} without the traced "
        f"sequence size {ctx.seq_symbol}; use a plan without 'sp' for this model.")


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
        x = node.args[0]
        node.target = new_target
        node.args = (x, _seq_dim(x, ctx), AXIS, node.args[2])
        if new_target is collectives.all_gather:  # backward all-gathers the saved shard again (ops/regather.py)
            node.kwargs = {"regather": True}
        rename_node(node, new_target.__name__)
        provenance(node, _PASS, AXIS, f"{reason}: {meta.reason}", role=role)
        result.num_rewritten += 1
    return result
