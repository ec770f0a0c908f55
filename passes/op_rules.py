"""Sharding rules of autopar's own operators: the collectives the passes insert, the CP attention
and positions, and the vocabulary-parallel embedding and loss.

Registered in the one registry of ``passes/rules.py`` (``passes/shard_propagation.py``, the
registry's one reader, imports this module as it does the other families, which hold the
aten rules).  Each rule checks that the op is applied to what it was inserted
for (an all-gather to a shard, a reduction to a partial sum) and gives its output placement.
"""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.ops import collectives
from autopar.ops import cp_attention
from autopar.ops.whole_rows import sum_whole_rows
from .context import META_KEY
from .op_sets import CP_ATTENTION_OPS
from .reduction_rules import token_loss
from .rules import P, R, RuleContext, axis_of, canonical_dim, is_sharded, ndim_of, register

__all__ = ["all_gather_rule", "reduce_scatter_rule", "all_reduce_rule", "region_entry_rule",
           "vocab_embedding_rule", "vocab_ce_rule", "sum_whole_rows_rule", "local_shard_rule", "cp_positions_rule",
           "cp_gather_sequence_rule", "cp_table_rows_rule", "cp_attention_rule"]


@register(collectives.local_shard)
def local_shard_rule(node: Node, pls: list, rc: RuleContext):
    return Shard(node.args[1]) if node.args[2] == rc.axis else pls[0]


@register(cp_attention.cp_positions)
def cp_positions_rule(node: Node, pls: list, rc: RuleContext):
    """This rank's global positions: its tokens on the cp axis, the same on every rank of another."""
    return Shard(0) if node.args[1] == rc.axis else R


@register(cp_attention.cp_gather_sequence)
def cp_gather_sequence_rule(node: Node, pls: list, rc: RuleContext):
    """The whole sequence gathered over the cp axis: replicated there (``passes/cp_cores.py``); on
    another axis placed as its input (the gather keeps every other dim)."""
    if node.args[2] != rc.axis:
        return pls[0]
    if pls[0] != Shard(node.args[1]):
        raise rc.fail(node, f"gathers the sequence of a value placed {pls[0]}")
    return R


@register(cp_attention.cp_table_rows)
def cp_table_rows_rule(node: Node, pls: list, rc: RuleContext):
    """A replicated table's rows at this rank's global positions: its tokens on the cp axis."""
    if node.args[3] != rc.axis:
        return pls[0]
    if pls[0] != R:
        raise rc.fail(node, f"position rows of a table placed {pls[0]}")
    return Shard(node.args[1])


@register(*CP_ATTENTION_OPS)
def cp_attention_rule(node: Node, pls: list, rc: RuleContext):
    """Context-parallel attention of this rank's queries, keys and values ([b, h, s, d]) over the
    whole sequence (the op exchanges the keys and values): its output holds the same tokens."""
    q, k, v = pls[:3]
    seq = ndim_of(node) - 2
    if axis_of(node) != rc.axis:
        if q == k == v:
            return q
    elif all(p == Shard(seq) for p in (q, k, v)):
        return q
    raise rc.fail(node, f"context-parallel attention of q/k/v placed {q}, {k}, {v}")


@register(collectives.all_gather, collectives.gather_replicated)
def all_gather_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) != rc.axis:
        return pls[0]
    dim = canonical_dim(node.args[1], ndim_of(node))
    if pls[0] != Shard(dim):
        raise rc.fail(node, f"all-gather on dim {dim} of an input placed {pls[0]}")
    return R


@register(collectives.reduce_scatter)
def reduce_scatter_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) != rc.axis:
        return pls[0]
    if not isinstance(pls[0], Partial):
        raise rc.fail(node, f"reduce-scatter of an input placed {pls[0]}, expected a partial sum")
    return Shard(canonical_dim(node.args[1], ndim_of(node)))


@register(collectives.all_reduce, collectives.token_all_reduce)  # the latter: a data axis's share of a statistic
def all_reduce_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) != rc.axis:
        return pls[0]
    if not isinstance(pls[0], Partial):
        raise rc.fail(node, f"all-reduce of an input placed {pls[0]}, expected a partial sum")
    return R


@register(collectives.region_entry)
def region_entry_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) == rc.axis and not isinstance(pls[0], Replicate):
        raise rc.fail(node, f"tensor-parallel region entered with an input placed {pls[0]}")
    return pls[0]


@register(sum_whole_rows)
def sum_whole_rows_rule(node: Node, pls: list, rc: RuleContext):
    """A fused projection's weight laid out block by block, some blocks whole on every rank: the
    identity, on the parameter it was inserted for (sharded along its blocks' dim)."""
    dim = node.args[1]
    if axis_of(node) == rc.axis and pls[0] != Shard(dim):
        raise rc.fail(node, f"sum of the whole blocks of a weight placed {pls[0]}, expected Shard({dim})")
    return pls[0]


@register(collectives.vocab_parallel_embedding)
def vocab_embedding_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) != rc.axis:
        return pls[1]
    if pls[0] != Shard(0) or not isinstance(pls[1], Replicate):
        raise rc.fail(node, f"vocab-parallel embedding with weight {pls[0]} and ids {pls[1]}")
    return P


@register(collectives.vocab_parallel_cross_entropy)
def vocab_ce_rule(node: Node, pls: list, rc: RuleContext):
    if axis_of(node) != rc.axis:
        if rc.local_sizes and is_sharded(pls):
            return token_loss(node, pls[0], pls[1], node.args[4], False, rc, class_dim=ndim_of(node.args[0]) - 1)
        return pls[0]
    if pls[0] != Shard(ndim_of(node.args[0]) - 1) or not isinstance(pls[1], Replicate):
        raise rc.fail(node, f"vocab-parallel cross-entropy of logits {pls[0]} and target {pls[1]}")
    vocab = int(node.args[0].meta["val"].shape[-1])
    if vocab % rc.size and vocab in rc.uneven and len(node.args) < 7:  # padded vocabulary: mask the padding
        node.args = tuple(node.args[:6]) + (vocab,)
        if META_KEY in node.meta:
            node.meta[META_KEY].reason += f"; vocabulary {vocab} padded to {-(-vocab // rc.size) * rc.size}"
    return R
