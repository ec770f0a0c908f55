"""The aten op families autopar recognises in a traced graph, each written once.

The structure analysis (``analyze``, ``analyze_moe``, ``attention_dims``, ``spec_dims``,
``loss``) and the passes (``passes/``) match nodes against these sets; the sets that also
hold autopar's own operators (the attention ops of a rewritten program, the CP variants)
are ``passes/op_sets.py``, which the frontend cannot import.  A new member goes here, so
every reader sees it.
"""
from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["SDPA", "SDPA_ARGS", "sdpa_args", "ATTENTION_OPS", "SOFTMAX_OPS", "LOG_SOFTMAX_OPS", "RESHAPE_OPS",
           "SIZED_RESHAPE_OPS", "SPLIT_OPS", "PROJECTION_OPS", "SHAPED_FILLS", "RANDOM_DRAWS",
           "CAST_OPS"]

aten = torch.ops.aten

# ``scaled_dot_product_attention`` and its arguments in schema order (``scale`` and
# ``enable_gqa`` are keyword-only in the schema, so a traced node has at most six positional).
SDPA = aten.scaled_dot_product_attention.default
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# The attention ops of a traced graph (an eager core, a softmax between two matmuls, is found
# from SOFTMAX_OPS by ``attention_dims``).
ATTENTION_OPS = frozenset({SDPA})
SOFTMAX_OPS = frozenset({aten.softmax.int, aten._softmax.default, aten._safe_softmax.default})
LOG_SOFTMAX_OPS = frozenset({aten.log_softmax.int, aten._log_softmax.default})
# Ops that only reshape: the elements keep their row-major order.
RESHAPE_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                         aten.flatten.using_ints, aten.unflatten.int})
# The reshapes that take the full output sizes as a list (``args[1]``).
SIZED_RESHAPE_OPS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
SPLIT_OPS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
# A linear projection by op: ``linear``, Conv1D's ``addmm``, and ``mm`` (a 2-D ``x @ w``; also a
# row-parallel Conv1D after the TP pass, its bias added after the reduction).  The router search
# (``analyze_moe``) and the recompute regions match these; ``attention_dims`` keeps its own set
# for its head walk (``linear``, ``addmm`` and ``matmul``: Falcon's ``x @ w.T``, which ``analyze``
# takes for a linear).
PROJECTION_OPS = frozenset({aten.linear.default, aten.addmm.default, aten.mm.default})
# Casts of a tensor to another dtype (or none: a no-op ``x.float()`` of fp32).  A parameter cast on
# its way to a projection is still that projection's weight (Ergo's ``F.linear(x.float(),
# self.weight.float())``), and a column's input cast before it still enters the region.
CAST_OPS = frozenset({aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout})
# Fills shaped like their input: they read its shape (and dtype), never its values.
SHAPED_FILLS = frozenset({aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                          aten.full_like.default, aten.new_zeros.default, aten.new_ones.default,
                          aten.new_empty.default, aten.new_full.default})

# Ops that draw from the default generator (dropout has its own streams: autopar/ops/rng.py).
RANDOM_DRAWS = frozenset({
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
    aten.exponential_.default, aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float,
    aten.bernoulli_.Tensor, aten.bernoulli.default, aten.bernoulli.p, aten.multinomial.default, aten.rand.default,
    aten.randn.default, aten.randint.default, aten.randint.low, aten.randperm.default, aten.cauchy_.default,
    aten.geometric_.default, aten.log_normal_.default, aten.random_.default, getattr(aten.random_, "from"), aten.random_.to,
    aten.normal.Tensor_float, aten.poisson.default,
})


def sdpa_args(node: Node) -> dict:
    """An SDPA node's arguments by name (positional and keyword)."""
    return {**dict(zip(SDPA_ARGS, node.args)), **node.kwargs}
