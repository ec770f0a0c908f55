"""Context parallelism: the sequence is sharded over ``cp`` for the whole graph.

Like data parallelism shards the batch, ``train_step`` hands each rank its load-balanced
sequence chunks (:mod:`autopar.runtime.stepping.batching`), so the graph's symbolic sequence size is
already local.  What this pass rewrites is what depends on *where* a token sits:

1. every ``scaled_dot_product_attention`` becomes the plan's CP variant from
   :mod:`autopar.ops.cp_attention` (ring, allgather or ulysses).  K/V are taken from before a
   GQA ``unsqueeze/expand/reshape`` so only the K/V heads travel.  An explicit mask is
   accepted when it is provably the causal mask or a causal sliding window: its subgraph
   depends only on the batch and sequence sizes, and evaluating it at sizes past every
   threshold of its subgraph gives the lower triangle, or the band of the last ``W`` keys
   (:func:`passes.causal_mask.mask_window`); the CP op then applies causality and the
   window from global positions, skipping the blocks out of every query's window;
2. the mask subgraphs that became dead are removed;
2b. attention computed eagerly (scores, a mask or bias over positions x positions) and an SDPA
   whose mask is neither causal nor a window (Llama 4's chunks, a padding mask) run whole: their
   inputs gathered in global order, their outputs cut to this rank's rows
   (:mod:`passes.cp_cores`);
3. every ``arange`` over the sequence length (position ids for RoPE or learned
   positions) becomes :func:`autopar.ops.cp_attention.cp_positions`, this rank's global
   positions, and every slice ``table[..., :seq]`` of a table of static size (BERT's
   ``position_ids`` buffer, a learned position table) :func:`~autopar.ops.cp_attention.cp_table_rows`,
   the table's rows at those positions;
4. placements on ``cp`` are propagated over every node (:func:`passes.shard_propagation.propagate`
   with the rule registry, sizes already local): the inputs' sequence dim is this rank's
   tokens, and every value whose shape holds the sequence length must hold this rank's
   tokens there.  A value computed from the local length without the global positions (an
   ``arange`` in another form, a slice of a position table), an op across the sequence other
   than the attention (softmax, a reduction, a slice, a concatenation outside an attention core)
   and a loss that is not a mean over the tokens are refused, naming the node; a
   cumulative sum along the sequence (OPT's positions from its attention mask) becomes
   :func:`autopar.ops.cp_attention.cp_cumsum`, the same sum in global order.

Runs after shard propagation (the attention op is local in every other axis), before
the data-parallel pass, which then averages dense gradients over ``dp_cp``.
"""
from __future__ import annotations

import sympy
import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr, sym_hint
from autopar.frontend.attention_dims import strip_gqa
from autopar.frontend.op_sets import SDPA, sdpa_args
from autopar.ops import cp_attention
from autopar.errors import AutoparError
from autopar.plan import ulysses_heads_ok
from .causal_mask import is_causal_mask, mask_window
from .cp_cores import core_placement, whole_cores
from .context import COPIED_META, META_KEY, SOURCE_META, PassContext, PassResult, provenance
from .op_sets import CP_ATTENTION_VARIANTS
from .gradient_placement import requires_grad_nodes
from .rules import R, RuleContext
from .shard_propagation import local_numel, propagate
from .batch_propagation import predict_token_bytes, sums_loss

__all__ = ["context_parallel_pass"]

_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start)


def _where(node: Node) -> str:
    stack = (node.meta.get("stack_trace") or "").strip().splitlines()
    return f"node '{node.name}'" + (f" ({stack[-2].strip()})" if len(stack) >= 2 else "")


def _check_ulysses(plan, ctx: PassContext) -> None:
    tp_cp = plan.tp * plan.cp
    for what, count in (("attention heads", ctx.structure.num_heads), ("key/value heads", ctx.structure.num_kv_heads)):
        if count and not ulysses_heads_ok(count, plan.tp, plan.cp):
            raise AutoparError(
                f"autopar: cp={plan.cp}:ulysses with tp={plan.tp} splits the {what} over tp*cp={tp_cp} ranks, "
                f"but the model has {count} {what}; use a tp*cp that divides {count}, or the ring or "
                f"allgather variant (cp={plan.cp}:ring).")


def _predicted_bytes(variant: str, q: Node, k: Node, v: Node, out: Node, n: int, ctx: PassContext) -> dict:
    itemsize = q.meta["val"].element_size()
    kv = (local_numel(k, ctx) + local_numel(v, ctx)) * itemsize  # packed K and V on this rank
    qo = (local_numel(q, ctx) + local_numel(out, ctx)) * itemsize  # q, and the output (V's head dim)
    if variant == "ring":
        return {"fwd": ("send", (n - 1) * kv), "bwd": ("send", 2 * (n - 1) * kv)}
    if variant == "allgather":
        return {"fwd": ("all_gather", (n - 1) * kv), "bwd": ("reduce_scatter", sympy.Rational(n - 1, n) * kv * n)}
    a2a = sympy.Rational(n - 1, n)
    return {"fwd": ("all_to_all", a2a * (qo + kv)), "bwd": ("all_to_all", a2a * (qo + kv))}


# Collectives one node issues per phase (its predicted bytes are their sum).
_CALLS = {"ring": lambda n: {"fwd": n - 1, "bwd": 2 * (n - 1)},
          "allgather": lambda n: {"fwd": 1, "bwd": 1},
          "ulysses": lambda n: {"fwd": 2, "bwd": 2}}


def _seq_length(end, ctx: PassContext) -> Node | None:
    """``end`` if it is the node of the traced sequence length, else None."""
    if isinstance(end, Node) and isinstance(end.meta.get("val"), torch.SymInt) \
            and str(sym_expr(end.meta["val"])) == str(ctx.seq_symbol):
        return end
    return None


def _positions_call(node: Node, ctx: PassContext) -> tuple | None:
    """``(fn, args, kwargs, reason)`` of the op giving ``node``'s value at this rank's global
    positions, when ``node`` is ``arange(seq)`` or ``table[..., :seq]``; else None."""
    length = _seq_arange(node, ctx)
    if length is not None:
        return (cp_attention.cp_positions, (length, "cp"),
                {"dtype": node.kwargs.get("dtype"), "device": node.kwargs.get("device")},
                "global position ids of this rank's sequence chunks")
    length = _table_slice(node, ctx)
    if length is not None:
        dim = node.args[1] % node.meta["val"].dim()
        return (cp_attention.cp_table_rows, (node.args[0], dim, length, "cp"), {},
                "a position table's rows at this rank's global positions")
    return None


def _seq_arange(node: Node, ctx: PassContext) -> Node | None:
    """The length node if ``node`` is ``arange(seq)`` / ``arange(0, seq)``, else None."""
    if node.op != "call_function" or node.target not in _ARANGES:
        return None
    if node.target is torch.ops.aten.arange.start:
        if node.args[0] != 0 or len(node.args) > 2:
            return None
        end = node.args[1]
    else:
        end = node.args[0]
    return _seq_length(end, ctx)


def _table_slice(node: Node, ctx: PassContext) -> Node | None:
    """The length node if ``node`` is ``table[..., :seq]``: a slice from 0 to the sequence
    length along a dim of static size (a position table), else None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor or len(node.args) < 4:
        return None
    table, dim, start, end = node.args[:4]
    step = node.args[4] if len(node.args) > 4 else 1
    val = table.meta.get("val") if isinstance(table, Node) else None
    if start not in (0, None) or step != 1 or not isinstance(val, torch.Tensor):
        return None
    if any(isinstance(size, torch.SymInt) for size in val.shape):  # not a table: holds batch or tokens
        return None
    return _seq_length(end, ctx)


def _propagate_tokens(gm: GraphModule, ctx: PassContext, result: PassResult, whole: set[Node]) -> None:
    """Placements on ``cp`` over every node (step 4 of the module doc); rewrites cumulative sums
    along the sequence and predicts their bytes."""
    n = ctx.axis_sizes["cp"]
    # train_step cuts dim 1 of every input as long as the sequence (the target too, which is
    # traced with its own symbols): those dims hold this rank's tokens.
    inputs = [p for p in gm.graph.nodes if p.op == "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)
              and p.meta["val"].dim() > 1 and isinstance(p.meta["val"].shape[1], torch.SymInt)]
    if ctx.seq_symbol is None or not inputs:
        raise AutoparError("autopar: context parallelism needs inputs traced with a symbolic sequence length "
                           "(dim 1 of the first input); use a plan without cp for this model.")
    length = sym_hint(inputs[0].meta["val"].shape[1])
    cut = {p: sym_expr(p.meta["val"].shape[1]) for p in inputs if sym_hint(p.meta["val"].shape[1]) == length}
    rc = RuleContext(gm, "cp", n, {}, local_sizes=True, token_symbols=frozenset(cut.values()),
                     pass_name="context_parallel_pass", sum_loss=sums_loss(ctx))
    propagate(gm, rc, lambda node: Shard(1) if node in cut else R, shortcut=core_placement(whole, rc))
    result.num_inserted += predict_token_bytes(gm, ctx, "cp")
    needs_grad = requires_grad_nodes(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is cp_attention.cp_cumsum:
            x = node.args[0]
            itemsize = torch.empty((), dtype=node.meta["val"].dtype).element_size()
            length = sym_expr(x.meta["val"].shape[node.args[1]])
            totals = 2 * local_numel(x, ctx) / length * itemsize  # one slice per chunk, sequence summed away
            node.meta[META_KEY].bytes = {"fwd": ("all_gather", (n - 1) * totals)}
            if x in needs_grad:
                node.meta[META_KEY].bytes["bwd"] = ("reduce_scatter", (n - 1) * totals)
            result.num_rewritten += 1


def _causal_window(node, bound: dict, windows: dict, ctx: PassContext) -> tuple[bool, int | None] | None:
    """``(causal, window)`` of SDPA ``node`` (its arguments ``bound``): causal by flag or by an in-graph
    mask (``windows`` caches each mask's answer: one mask usually feeds every layer, and evaluating
    it costs s x s); None for a mask that is neither causal nor a causal sliding window (a chunked
    mask, one that reads a padding mask), with which the attention runs whole; refuses dropout."""
    if bound.get("dropout_p", 0.0):
        raise AutoparError(f"autopar: context parallelism needs attention without dropout; {_where(node)} "
                           f"has dropout_p={bound['dropout_p']}. Set the model's attention dropout to 0 or drop cp.")
    mask = bound.get("attn_mask")
    if mask is None:
        return bool(bound.get("is_causal", False)), None
    if mask not in windows:
        windows[mask] = None if is_causal_mask(mask, ctx) else mask_window(mask, ctx) or 0
    if windows[mask] == 0:
        return None  # another mask (chunked, padded): the attention runs whole (passes/cp_cores.py)
    return True, windows[mask]


def context_parallel_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    result = PassResult("context_parallel_pass")
    if ctx.seq_symbol is not None and not isinstance(ctx.seq_symbol, sympy.Symbol):
        raise AutoparError(f"autopar: context parallelism needs the sequence traced with a symbolic length, but "
                           f"torch.export fixed it to {ctx.seq_symbol} (the model branches on it, e.g. building a "
                           "mask from a padding attention_mask, or loops over the positions); train without the "
                           "padding mask (pack full sequences), or use a plan without cp.")
    n, variant = plan.cp, plan.cp_variant
    if variant == "ulysses":
        _check_ulysses(plan, ctx)
    fn = CP_ATTENTION_VARIANTS[variant]
    graph = gm.graph
    windows: dict = {}  # mask node -> None (causal), its window W, or 0 (neither)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        bound = sdpa_args(node)
        found = _causal_window(node, bound, windows, ctx)
        if found is None:
            continue
        causal, window = found
        q = bound["query"]
        k, groups = strip_gqa(bound["key"])
        v, groups_v = strip_gqa(bound["value"])
        assert groups == groups_v, "K and V must repeat their heads alike"
        with graph.inserting_before(node):
            new = graph.call_function(fn, (q, k, v, "cp"), {
                "scale": bound.get("scale"), "causal": causal, "num_kv_groups": groups,
                "tag": f"cp {variant} {node.name}", "window": window})
        new.meta.update({k: node.meta[k] for k in COPIED_META if k in node.meta})
        provenance(new, "context_parallel_pass", "cp",
                   f"{variant} attention over the cp-sharded sequence (causal={causal}, window={window}, "
                   f"kv groups={groups})")
        new.meta[META_KEY].bytes = _predicted_bytes(variant, q, k, v, node, n, ctx)
        new.meta[META_KEY].calls = _CALLS[variant](n)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        result.num_inserted += 1
    graph.eliminate_dead_code()
    whole = whole_cores(gm, ctx)  # before the positions: a mask's own are built again at the global length
    for node in list(graph.nodes):
        call = None if node in whole else _positions_call(node, ctx)
        if call is None:
            continue
        fn, args, kwargs, reason = call
        with graph.inserting_before(node):
            new = graph.call_function(fn, args, kwargs)
        new.meta.update({k: node.meta[k] for k in ("val", *SOURCE_META) if k in node.meta})
        provenance(new, "context_parallel_pass", "cp", reason)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        result.num_rewritten += 1
    if result.num_inserted == 0 and not whole:
        raise AutoparError("autopar: cp>1 found nothing that mixes positions to parallelize: no "
                           "scaled_dot_product_attention op, no values relating positions to positions (eager "
                           "attention's scores) and no convolution or chunked scan along the sequence; use a plan "
                           "without cp for this model.")
    _propagate_tokens(gm, ctx, result, whole)
    result.notes.append(f"{result.num_inserted} attention ops -> {variant}, {result.num_rewritten} position aranges"
                        + (f"; {len(whole)} nodes of eager attention and sequence mixers run whole over the "
                           "gathered sequence"
                           if whole else ""))
    return result
