"""Sharding rules for mixture-of-experts routing and the EP runtime ops.

Registered into the one registry of ``passes/rules.py``.  Under tp with sp a MoE block
runs on the rank's sequence shard: every op of the router is token-wise (top-k over the
experts dim, in-place renormalisation), and the dispatch / experts / combine calls that
``passes/expert_parallel.py`` inserts keep the token placement of their input, so shard
propagation marks the router and expert weights as having partial gradients over tp.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard
from torch.fx import Node

from autopar.ops import dense_moe, moe
from .rules import R, RuleContext, ndim_of, register

__all__ = ["topk_rule", "extreme_dim_rule", "gather_scatter_rule", "moe_token_rule", "dense_moe_rule"]

aten = torch.ops.aten

@register(aten.topk.default, aten.sort.default)
def topk_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if not isinstance(pl, Shard):
        if pl is not R and not isinstance(pl, type(R)):
            raise rc.fail(node, f"top-k of a {pl} tensor")
        return (R, R)
    ndim = ndim_of(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
    if node.target == aten.sort.default:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    if dim % ndim == pl.dim:
        raise rc.fail(node, f"selects along the sharded dim {pl.dim}")
    return (pl, pl)


@register(aten.max.dim, aten.min.dim)
def extreme_dim_rule(node: Node, pls: list, rc: RuleContext):
    """``x.max(dim)`` / ``x.min(dim)`` (values, indices) along a dim other than the sharded one (a
    router's best expert per token, PhiMoE's sparse mixer): each rank's rows keep their shard."""
    pl = pls[0]
    if not isinstance(pl, Shard):
        if isinstance(pl, Partial):
            raise rc.fail(node, f"takes the largest or smallest element of a {pl} tensor")
        return (R, R)
    ndim = ndim_of(node.args[0])
    dim = node.args[1] % ndim
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if dim == pl.dim:
        raise rc.fail(node, f"selects along the sharded dim {pl.dim}")
    out = Shard(pl.dim - (1 if dim < pl.dim and not keepdim else 0))
    return (out, out)


@register(aten.gather.default, aten.scatter.value, aten.scatter_.value, aten.scatter.src, aten.scatter_.src,
          aten.scatter_add.default, aten.scatter_add_.default)
def gather_scatter_rule(node: Node, pls: list, rc: RuleContext):
    """``x.gather(dim, idx)`` / ``x.scatter(dim, idx, v)`` / ``x.scatter_add(dim, idx, v)`` along a dim no
    input is sharded on (a router's per-token picks: DeepSeek's group mask and gathered routing weights;
    PhiMoE's sparse-mixer backward adds each token's gradient at its chosen expert): each rank's
    rows pick from its own rows, so the output keeps their shard.  A replicated ``x`` gathered
    at sharded indices (BERT's token types at this rank's positions) is sharded like them."""
    dim = node.args[1] % max(1, ndim_of(node.args[0]))
    if all(isinstance(p, type(R)) for p in pls):
        return R
    if node.target is aten.gather.default and isinstance(pls[0], type(R)) and isinstance(pls[1], Shard):
        return pls[1]  # each output element reads the whole replicated input at its own index
    shards = {p for p in pls if isinstance(p, Shard)}
    if len(shards) == 1 and all(isinstance(p, Shard) for p in pls) and next(iter(shards)).dim != dim \
            and len({ndim_of(a) for a in node.all_input_nodes}) == 1:
        return next(iter(shards))
    raise rc.fail(node, f"gathers or scatters along dim {dim} with inputs placed {pls}",
                  "Only picks along a dim that no input is sharded on, with every input sharded alike, "
                  "are supported; use a plan without this dimension.")


@register(moe.moe_dispatch, moe.moe_experts, moe.moe_combine, moe.checked_expert_ids)
def moe_token_rule(node: Node, pls: list, rc: RuleContext):
    """Tokens keep their placement: each rank routes, computes and combines its own tokens (and
    checks its own tokens' expert ids)."""
    pl = pls[0]
    if node.target is moe.moe_dispatch:
        return (pl, R)
    return pl


@register(dense_moe.dense_gather, dense_moe.dense_experts, dense_moe.dense_scatter)
def dense_moe_rule(node: Node, pls: list, rc: RuleContext):
    """Dense experts split over ep (``passes/dense_expert_parallel.py``) are token-wise seen from any
    other axis: the calls gather the ep group's tokens and give each rank back its own, so the tokens
    keep their placement; the scores must be placed as the tokens (the same rows)."""
    pl = pls[0]
    if node.target is dense_moe.dense_gather:
        if pls[1] != pl:
            raise rc.fail(node, f"the tokens are placed {pl} but the router scores {pls[1]}",
                          "Use a plan without ep for this model, or report it.")
        return (pl, pl)
    return pl
