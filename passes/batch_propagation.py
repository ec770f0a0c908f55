"""Batch propagation: placements on the ``dp`` axis over every node, and statistics of the batch.

Data parallelism hands each rank ``batch / dp`` rows (:func:`autopar.runtime.stepping.batching.rank_rows`),
so the traced graph already runs on a rank's rows: every dim 0 as long as the batch holds this
rank's rows.  Most of the graph works row by row and needs nothing; the loss is a mean over the
rank's tokens, which the runtime averages over the ranks (or weights, for padded targets:
:mod:`autopar.frontend.loss`).  What breaks is a value that mixes rows besides the loss: a
statistic of the whole batch such as the MoE load-balancing loss (a product of per-expert token
fractions and mean router probabilities) or a batch norm.  On one rank it would be the rank's
statistic, a different number.

This pass propagates placements on ``dp`` over every node with the rules of
``passes/rules.py`` in their data-axis form (``RuleContext.local_sizes``, the batch symbols as the
token symbols), as the CP pass does for the sequence (``passes/context_parallel.py``): a sum or
mean over the rank's rows is a share of the batch's; linear work keeps the share; anything else
first all-reduces it over ``dp`` (``token_all_reduce``, backward the same all-reduce), which makes
it the batch's value.  Micro-batches (``mb``, pipeline micro-batches) also split the rows, but run
one after another on one rank: no all-reduce can join them, so a statistic over the batch under
micro-batches is refused.  Predicted bytes of the inserted all-reduces are set here and by the
CP pass (:func:`predict_token_bytes`).

An MoE block run as traced (no ``ep``) sorts, counts and scatters back the rank's tokens: the
token-order rules (``passes/token_order.py``) place each of those steps and prove that the
block's output holds the rank's rows, or refuse the node where tokens of different ranks would
mix.  Everything else row by row is placed from its shape (:func:`_by_shape`).

A random draw from the default generator over the rank's rows (a sampling router's noise) is made
for the whole batch, the rank's rows kept, so that it draws one device's numbers
(``passes/random_draws.py``, after the placements; refused under micro-batches).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Shard
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr, sym_hint
from autopar.errors import AutoparError, describe_node
from autopar.frontend.op_sets import SHAPED_FILLS
from autopar.ops import collectives
from .autograd_functions import AUTOGRAD_FUNCTION
from .context import META_KEY, PassContext, PassResult
from .gradient_placement import requires_grad_nodes
from .random_draws import rewrite_draws
from .rules import R, RuleContext, lookup_token_order, tensor_inputs
from .shard_propagation import BY_RULES, local_numel, propagate

__all__ = ["batch_propagation_pass", "needs_batch_propagation", "predict_token_bytes", "sums_loss"]

_PASS = "batch_propagation_pass"


def needs_batch_propagation(plan) -> bool:
    """Whether the plan splits the batch's rows: over dp ranks, or into micro-batches."""
    return plan.dp > 1 or plan.mb > 1 or plan.pp > 1


def _rows(gm: GraphModule) -> dict[Node, object]:
    """Placeholders whose dim 0 is as long as the batch (the runtime cuts those), with its symbol."""
    inputs = [p for p in gm.graph.nodes if p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)
              and p.meta["val"].dim() > 0 and isinstance(p.meta["val"].shape[0], torch.SymInt)]
    if not inputs:
        return {}
    batch = sym_hint(inputs[0].meta["val"].shape[0])
    return {p: sym_expr(p.meta["val"].shape[0]) for p in inputs if sym_hint(p.meta["val"].shape[0]) == batch}


def predict_token_bytes(gm: GraphModule, ctx: PassContext, axis: str) -> int:
    """Predicted bytes of the ``token_all_reduce`` nodes on ``axis`` (forward, and backward where
    the statistic has a gradient); returns how many there are."""
    needs_grad = requires_grad_nodes(gm)
    n = ctx.axis_sizes[axis]
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not collectives.token_all_reduce or node.args[1] != axis:
            continue
        src = node.args[0]
        size = local_numel(src, ctx) * src.meta["val"].element_size()
        nbytes = collectives.ring_bytes("all_reduce", size, n)[0]
        node.meta[META_KEY].bytes = {"fwd": ("all_reduce", nbytes)}
        if src in needs_grad:
            node.meta[META_KEY].bytes["bwd"] = ("all_reduce", nbytes)
        count += 1
    return count


def _refuse_under_microbatches(gm: GraphModule, plan) -> None:
    stats = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is collectives.token_all_reduce]
    if stats:
        parts = plan.mb if plan.pp == 1 else f"the pipeline's {plan.mb}"
        raise AutoparError(
            f"autopar: {describe_node(stats[0].args[0])} is a statistic over the whole batch's tokens (an "
            f"auxiliary load-balancing loss, a batch norm?) that {describe_node(next(iter(stats[0].users)))} "
            f"uses non-linearly; with {parts} micro-batches each computes it on its own rows, a different "
            "number than one device's. Use a plan with mb=1 and pp=1, or compute the statistic per sequence.")


def batch_propagation_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    result = PassResult(_PASS)
    rows = _rows(gm)
    if not rows:
        return result
    # Micro-batches without dp: propagate on a one-rank "dp" axis only to find the statistics.
    rc = RuleContext(gm, "dp", plan.dp, {}, local_sizes=True, token_symbols=frozenset(rows.values()),
                     pass_name=_PASS, sum_loss=sums_loss(ctx))
    placements = propagate(gm, rc, lambda node: Shard(0) if node in rows else R, _by_shape(rc))
    if plan.mb > 1 or plan.pp > 1:
        _refuse_under_microbatches(gm, plan)
    result.num_rewritten = rewrite_draws(gm, plan, rc.token_symbols)
    result.num_inserted = predict_token_bytes(gm, ctx, "dp") if plan.dp > 1 else 0
    shares = sum(isinstance(p, Partial) for p in placements.values())
    result.notes.append(f"placed {len(placements)} nodes on dp ({shares} shares of batch statistics), "
                        f"{result.num_inserted} all-reduced, {result.num_rewritten} random draws made for the "
                        "whole batch")
    return result


def _by_shape(rc: RuleContext):
    """A ``propagate`` shortcut: the nodes no statistic of the batch and no rank-local order of its
    tokens reaches, placed from their shapes alone.

    A node whose tensor inputs hold the batch symbol and whose output holds none reduces over the
    rows (a loss, a sum over tokens, a histogram); a node that a token-order rule places (a sort
    or selection of the rank's tokens, an ``arange`` over them: passes/token_order_rules.py); and
    a node with an input placed otherwise than its shape says (a share, regrouped rows): these
    are placed by the rules.  Every other node works row by row: its rows, if its shape holds the
    batch symbol, are this rank's (placed on that dim), and it is replicated otherwise.  A shape
    the symbol cannot be read from (it in several dims) is left to the rules too.  Once the rules
    place a value on its rows again (an MoE block's output scattered back to its tokens), what
    follows is read from shapes again."""
    shapes: dict[Node, object] = {}

    def rows_of(node: Node):
        """The row placement of each of ``node``'s values (None: not readable from the shape)."""
        val = node.meta.get("val")
        vals = tuple(val) if isinstance(val, (tuple, list)) else (val,)
        out = []
        for v in vals:
            try:
                dim = rc.token_dim(node, v) if isinstance(v, torch.Tensor) else None
            except AutoparError:
                return None
            out.append(R if dim is None else Shard(dim))
        return tuple(out) if isinstance(val, (tuple, list)) else out[0]

    def place(node: Node):
        pl = shapes[node] = rows_of(node)
        if pl is None or node.op not in ("placeholder", "get_attr", "call_function"):
            return BY_RULES
        if node.op != "call_function":
            return pl
        if node.target is AUTOGRAD_FUNCTION:  # its code is read by its own rule, never assumed row-wise
            return BY_RULES
        if _along_rows(node, rc):  # keeps the batch dim but reads across its rows: the rules decide
            return BY_RULES
        inputs = node.all_input_nodes
        # an input the rules placed otherwise than its shape says (a share, regrouped tokens): its
        # readers are the rules' too, until one places a value as its shape says again
        if any(rc.placements.get(a, R) != shapes.get(a, R) for a in inputs):
            return BY_RULES
        # a size read from a shape, or a fill shaped like an input, reads no row's values
        sizes = not _holds_tensor(node.meta.get("val")) or node.target in SHAPED_FILLS
        if not sizes and not _has_rows(pl) and any(_has_rows(shapes.get(a, R)) for a in inputs):
            return BY_RULES
        # a sort or selection of the rank's tokens keeps the batch symbol in its shape, but its rows
        # are in a rank-local order: the token-order rules place it (they are pure: asked twice)
        order_rule = lookup_token_order(node.target)
        if order_rule is not None and order_rule(node, [rc.placements.get(a, R) for a in tensor_inputs(node)],
                                                 rc) is not None:
            return BY_RULES
        return pl

    return place


aten = torch.ops.aten
# Ops that combine or reorder elements along a dim (argument ``index`` of the call, a list for
# ``flip`` and ``roll``): along the rows they mix the batch's rows though the output keeps its
# shape (a cumulative sum, a flip, a sort, a softmax over the batch), so the shape says nothing.
_ALONG_DIM = {aten.cumsum.default: 1, aten.cumprod.default: 1, aten.cummax.default: 1, aten.cummin.default: 1,
              aten.logcumsumexp.default: 1, aten.flip.default: 1, aten.roll.default: 2, aten.sort.default: 1,
              aten.sort.stable: 2, aten.argsort.default: 1, aten.argsort.stable: 2, aten.topk.default: 2,
              aten.softmax.int: 1, aten._softmax.default: 1, aten.log_softmax.int: 1,
              aten._log_softmax.default: 1, aten.diff.default: 2, aten.kthvalue.default: 2, aten.median.dim: 1}
_DEFAULT_DIM = {aten.sort.default: -1, aten.argsort.default: -1, aten.topk.default: -1, aten.diff.default: -1,
                aten.kthvalue.default: -1}


def _along_rows(node: Node, rc: RuleContext) -> bool:
    """Whether ``node`` combines or reorders its first input's elements along the batch's rows
    (:data:`_ALONG_DIM`)."""
    first = node.args[0] if node.args else None
    if node.target not in _ALONG_DIM or not isinstance(first, Node):
        return False
    try:
        rows = rc.token_dim(first)
    except AutoparError:  # the symbol in several dims: the rules say why
        return True
    if rows is None:
        return False
    ndim = first.meta["val"].dim()
    at = _ALONG_DIM[node.target]
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim", node.kwargs.get("dims",
                                                                      _DEFAULT_DIM.get(node.target)))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if node.target is aten.roll.default and not dims:
        return True  # a roll of the flattened tensor
    return any(isinstance(d, int) and d % ndim == rows for d in dims)


def _has_rows(pl) -> bool:
    return pl is None or any(isinstance(p, Shard) for p in (pl if isinstance(pl, tuple) else (pl,)))


def _holds_tensor(val) -> bool:
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) for v in vals)


def sums_loss(ctx: PassContext) -> bool:
    """The loss is a summed cross-entropy, which the runtime adds up over the pieces of the batch."""
    reduction = getattr(ctx.structure, "loss_reduction", None)
    return reduction is not None and reduction.kind == "token_sum"
