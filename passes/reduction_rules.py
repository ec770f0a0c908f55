"""Sharding rules of reductions: sums, means, extrema, variance, softmax, histograms, differences
and cumulative sums along a dim, normalisation layers, and the cross-entropy loss.

A reduction over dims other than the sharded one keeps the shard.  Over the sharded dim of a
model axis (tp) a sum or mean is all-reduced across the ranks; on a data-sharded axis (dp, cp)
a mean or sum over this rank's tokens is its share of the batch's (``Partial("avg")`` or a
partial sum), as is its loss.  Registered in the one registry of ``passes/rules.py``.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.frontend.op_sets import LOG_SOFTMAX_OPS, SOFTMAX_OPS
from autopar.ops import collectives
from autopar.ops import cp_attention
from .context import provenance
from .rules import P, R, RuleContext, canonical_dim, ndim_of, register, shape_of, size_expr

__all__ = ["reduction_rule", "histc_rule", "full_reduction_rule", "diff_rule", "cumsum_rule", "norm_rule",
           "cross_entropy_rule", "token_loss", "vector_norm_rule"]

aten = torch.ops.aten


# --- reductions and normalisation -----------------------------------------------------

@register(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
          aten.argmax.default, aten.argmin.default, aten.logsumexp.default, *SOFTMAX_OPS, *LOG_SOFTMAX_OPS)
def reduction_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if not isinstance(pl, Shard):
        if isinstance(pl, Partial):
            raise rc.fail(node, "reduces a partial sum")
        return R
    in_ndim = ndim_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or dims == []:
        dims = list(range(in_ndim))
        if node.target not in _SHARE_OF_LOSS:
            raise rc.fail(node, "reduces over all dims of a sharded tensor")
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [canonical_dim(d, in_ndim) for d in dims]
    keepdim = node.target in SOFTMAX_OPS or node.target in LOG_SOFTMAX_OPS
    if not keepdim:
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if pl.dim in dims:
        if rc.local_sizes and node.target in _SHARE_OF_LOSS:
            # this rank's share of a mean over the tokens (the loss, a router's mean probability),
            # its part of a sum: equal token counts per rank make the mean of the means exact
            return _SHARE_OF_LOSS[node.target]
        if not rc.local_sizes and node.target in (aten.mean.dim, aten.sum.dim_IntList):
            return _reduce_across_ranks(node, dims, rc)
        raise rc.fail(node, f"reduces over the sharded dim {pl.dim}",
                      "Only reductions over unsharded dims are supported under this plan.")
    return _kept(pl, dims, keepdim)


def _kept(pl: Shard, dims: list[int], keepdim: bool) -> Shard:
    """The shard of a reduction over ``dims`` (canonical, without the sharded one): where its dim
    lands once the reduced dims are dropped (or kept, size 1)."""
    return Shard(pl.dim if keepdim else pl.dim - sum(1 for d in dims if d < pl.dim))


@register(aten.linalg_vector_norm.default)
def vector_norm_rule(node: Node, pls: list, rc: RuleContext):
    """``linalg_vector_norm(x, ord, dim, keepdim)`` over dims the shard does not hold keeps it (a
    per-head q/k norm under cp); over the sharded dim, or all dims, it is no sum of the ranks'
    parts: refused."""
    pl = pls[0]
    if not isinstance(pl, Shard):
        if isinstance(pl, Partial):
            raise rc.fail(node, "takes the norm of a partial sum")
        return R
    in_ndim = ndim_of(node.args[0])
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dims is None or dims == []:
        raise rc.fail(node, "takes the norm over all dims of a sharded tensor")
    dims = [canonical_dim(d, in_ndim) for d in ([dims] if isinstance(dims, int) else dims)]
    keepdim = bool(node.args[3]) if len(node.args) > 3 else bool(node.kwargs.get("keepdim", False))
    if pl.dim in dims:
        raise rc.fail(node, f"takes the norm over the sharded dim {pl.dim}",
                      "Only norms over unsharded dims are supported under this plan.")
    return _kept(pl, dims, keepdim)


def _reduce_across_ranks(node: Node, dims: list[int], rc: RuleContext):
    """A sum or mean over dims that include the sharded one (OLMo 2's q/k RMSNorm over the whole
    projection width): this rank's sum is a partial sum; an all-reduce makes it the whole sum,
    which a mean then divides by the global count.  The reduced value then meets this rank's
    shard again (the norm scales it), so its gradient is a partial sum too: a region entry
    after the all-reduce sums it in backward.  Returns the partial placement of ``node`` (now a
    sum); its users read the reduced value, replicated."""
    sizes = [size_expr(shape_of(node.args[0])[d]) for d in dims]
    count = sympy.prod(sizes)
    if node.target is aten.mean.dim and not count.is_Integer:
        raise rc.fail(node, f"averages over the sharded dim together with dims of symbolic size {sizes}",
                      "Only means over dims of fixed size are reduced across ranks.")
    users = list(node.users)
    graph = rc.gm.graph
    total = _sum_across_ranks(node, rc, "a reduction over a sharded width")
    with graph.inserting_after(total):
        out = graph.call_function(collectives.region_entry, (total, rc.axis, "reduction"))
    out.meta["val"] = node.meta.get("val")
    provenance(out, rc.pass_name, rc.axis, f"backward: sum the gradient of {node.name}'s all-reduced value, "
               "which each rank's shard contributes to", role="reduction")
    if node.target is aten.mean.dim:
        node.target = aten.sum.dim_IntList  # same arguments: (input, dims, keepdim, dtype=)
        with graph.inserting_after(out):
            out = graph.call_function(aten.div.Tensor, (out, int(count)))
        out.meta["val"] = node.meta.get("val")
    for user in users:
        user.replace_input_with(node, out)
    return P


def _sum_across_ranks(node: Node, rc: RuleContext, why: str) -> Node:
    """An all-reduce of ``node``'s partial value over ``rc.axis``, inserted after it (its users
    are rerouted by the caller)."""
    with rc.gm.graph.inserting_after(node):
        total = rc.gm.graph.call_function(collectives.all_reduce, (node, rc.axis, "reduction"))
    total.meta["val"] = node.meta.get("val")
    provenance(total, rc.pass_name, rc.axis, f"sum {node.name} over the {rc.axis}-sharded dim across ranks "
               f"({why})", role="reduction")
    return total


@register(aten.histc.default)
def histc_rule(node: Node, pls: list, rc: RuleContext):
    """A histogram of a sharded tensor (an MoE load-balancing loss counting tokens per expert):
    each rank counts its own elements, a part of the whole count.  On a data axis that part is
    the placement (``P``); on a model axis (tp with sp) the counts are summed at once (they
    carry no gradient)."""
    pl = pls[0]
    if isinstance(pl, Replicate):
        return R
    if isinstance(pl, Partial):
        raise rc.fail(node, "a histogram of a partial sum")
    if rc.local_sizes:
        return P
    users = list(node.users)
    total = _sum_across_ranks(node, rc, "a histogram of sharded values")
    for user in users:
        user.replace_input_with(node, total)
    return P


# A reduction of every element over a data-sharded axis (cp): each rank's mean of its own tokens
# is its share of the mean (equal shares), each rank's sum its part of the sum.
_SHARE_OF_LOSS = {aten.mean.dim: Partial("avg"), aten.mean.default: Partial("avg"),
                  aten.sum.dim_IntList: P, aten.sum.default: P}


@register(aten.mean.default, aten.sum.default)
def full_reduction_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, Replicate):
        return R
    if isinstance(pl, Shard) and rc.local_sizes:
        return _SHARE_OF_LOSS[node.target]
    raise rc.fail(node, f"reduces every element of a tensor placed {pl}")


@register(aten.diff.default)
def diff_rule(node: Node, pls: list, rc: RuleContext):
    """Differences of neighbours along a dim other than the sharded one (Hugging Face's packed-
    sequence check on position ids) stay on the shard; along the sharded dim they are refused."""
    x = node.args[0]
    dim = canonical_dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), ndim_of(x))
    if len(set(pls)) > 1 or isinstance(pls[0], Partial):
        raise rc.fail(node, f"differences of operands placed {pls}")
    if isinstance(pls[0], Shard) and pls[0].dim == dim:
        raise rc.fail(node, f"differences along the sharded dim {dim}")
    return pls[0]


@register(aten.cumsum.default, cp_attention.cp_cumsum)
def cumsum_rule(node: Node, pls: list, rc: RuleContext):
    """A cumulative sum along this rank's tokens of a data-sharded axis (cp: OPT's positions from
    the attention mask) becomes :func:`autopar.ops.cp_attention.cp_cumsum`, the same prefix sum
    in global token order; along any other sharded dim it is refused."""
    pl = pls[0]
    x = node.args[0]
    dim = canonical_dim(node.args[1], ndim_of(x))
    if not (isinstance(pl, Shard) and pl.dim == dim):
        if isinstance(pl, Partial):
            raise rc.fail(node, "a cumulative sum of a partial sum")
        return pl
    if node.target is cp_attention.cp_cumsum:
        return pl
    if not rc.local_sizes:
        raise rc.fail(node, f"a cumulative sum along the sharded dim {dim}")
    if size_expr(shape_of(x)[dim]) not in rc.token_symbols:
        raise rc.fail(node, f"a cumulative sum along dim {dim} of shape {shape_of(x)}, which merges the "
                            "sequence with other dims")
    dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
    node.target, node.args, node.kwargs = cp_attention.cp_cumsum, (x, dim, rc.axis), {"dtype": dtype}
    provenance(node, rc.pass_name, rc.axis,
               "cumulative sum in global token order: this rank's chunk totals all-gathered as offsets")
    return pl


@register(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(node: Node, pls: list, rc: RuleContext):
    x = pls[0]
    if isinstance(x, Replicate) and all(isinstance(p, Replicate) for p in pls):
        return R
    num_norm = len(node.args[1])
    if isinstance(x, Shard) and x.dim < ndim_of(node.args[0]) - num_norm and all(
            isinstance(p, Replicate) for p in pls[1:]):
        return x
    raise rc.fail(node, f"normalisation of an input placed {x} (weights {pls[1:]})")


# --- losses ---------------------------------------------------------------------------

def token_loss(node: Node, logits: Any, target: Any, reduction: int, weighted: bool, rc: RuleContext,
                class_dim: int | None = None):
    """Cross-entropy of this rank's tokens on a data-sharded axis (cp): per-token losses stay on
    the tokens, their mean is this rank's share of the mean, their sum its part of the sum."""
    x = node.args[0]
    if class_dim is None:
        class_dim = 1 if ndim_of(x) >= 2 else 0
    if not isinstance(logits, Shard) or logits.dim == class_dim:
        raise rc.fail(node, f"cross-entropy of logits placed {logits}")
    token = logits.dim - (1 if logits.dim > class_dim else 0)
    if target != Shard(token):
        raise rc.fail(node, f"cross-entropy of logits placed {logits} against a target placed {target}")
    if reduction == 0:
        return Shard(token)
    if weighted and reduction == 1:
        raise rc.fail(node, "a class-weighted mean cross-entropy: its denominator is a sum of weights, "
                            "which differs between ranks' tokens", "Use unweighted cross-entropy under this plan.")
    return Partial("avg") if reduction == 1 else P


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(node: Node, pls: list, rc: RuleContext):
    if all(isinstance(p, Replicate) for p in pls):
        return R
    if rc.local_sizes:
        names = ("input", "target", "weight", "reduction")
        bound = {**dict(zip(names, node.args)), **node.kwargs}
        return token_loss(node, pls[0], pls[1], bound.get("reduction", 1), bound.get("weight") is not None, rc)
    raise rc.fail(node, f"cross-entropy of {pls[0]} logits",
                  "Vocabulary-sharded logits are handled by the TP pass; sequence-sharded logits are not supported.")
