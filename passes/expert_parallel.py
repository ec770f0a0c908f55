"""Expert parallelism: replace each MoE experts region by dispatch / experts / combine.

For every MoE block that :mod:`autopar.frontend.analyze_moe` recognises (stacked 3-D expert weights
or a ModuleList of experts), the routing glue of the traced graph (sorting by expert,
gathering tokens, weighting, summing over the top-k slots) is replaced by three calls of
:mod:`autopar.ops.moe`::

    rows, routing = moe_dispatch(x, idx, E, 'ep')      # counts all-to-all, token all-to-all
    out = moe_experts(rows, routing, bodies, params, style, 'ep')   # the user's expert code
    y = moe_combine(out, w, routing, 'ep')             # reverse all-to-all, weighted sum

Dense experts (every expert on every token: Llama 4) are split over ep by
``passes/dense_expert_parallel.py``: the ep group's tokens gathered, each rank's experts summed,
the sums reduce-scattered back.

The experts' own code is cut out of the graph (``extract_body``) and kept as submodules
``moe_experts_<i>``, so what runs on a rank is exactly the user's expert, on the tokens
routed to it.  The router, shared experts and attention stay data-parallel (untouched).
A plan without ep, tp, cp or capacity (:func:`autopar.support.moe_needs_rewrite`, and cp: the
traced block sorts tokens across the sequence) keeps the traced experts: every rank runs every
expert on its own tokens; only the expert gradient bucket is recorded.  Ids such a block sorts
by that the graph does not bound (hash routing: a table lookup of the token ids) are checked at
run time first (``moe.checked_expert_ids``): the rank's counts per expert need every id in range.

Layouts: with ``ep > 1`` the experts are split over the ``ep`` axis (stacked parameters
along dim 0, ModuleList experts whole on their owner rank), ``ceil(E / ep)`` per rank: an ep
that does not divide the experts pads the stacked ones with zero experts no token is routed to.  Expert gradients are reduced
over the ranks that hold the same experts (``edp``: the other ``dp*cp/ep`` token slices,
times ``tp`` under sequence parallelism) by the DP pass (the ``expert_params`` decided here).

Under tp with sp a MoE block runs on the rank's sequence shard (no TP collective around
it, as Megatron-Core requires sequence parallelism for MoE with TP).  The block's
``[b, s, h] -> [b*s, h]`` flatten is rewritten to go through ``[s, b, h]`` so the sequence
shard stays the outermost part of the token dim and shard propagation can follow it; the
block is token-wise, so the token order does not change its result.
"""
from __future__ import annotations

import operator

import sympy
import torch
from torch import nn
from torch.fx import GraphModule, Node

from autopar.ops import moe
from autopar.frontend.analyze_moe import DenseExperts, MoEBlock, in_module
from autopar.frontend.moe_bodies import extract_body
from autopar.frontend.moe_split_experts import split_body
from autopar.frontend.op_sets import SIZED_RESHAPE_OPS
from autopar.errors import AutoparError, describe_node
from autopar.plan_space import local_experts
from autopar.support import moe_needs_rewrite
from .context import META_KEY, ParamShard, PassContext, PassResult, provenance
from .dense_expert_parallel import rewrite_dense_experts
from .rules import is_seq_size
from .token_order import key_range

__all__ = ["expert_parallel_pass", "AXIS"]

AXIS = "ep"
_PASS = "expert_parallel_pass"
aten = torch.ops.aten


def _param_nodes(gm: GraphModule, names: list[str], before: Node) -> list[Node]:
    existing = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    out = []
    for name in names:
        node = existing.get(name)
        if node is None:
            with gm.graph.inserting_before(before):
                node = gm.graph.get_attr(name)
            node.meta["val"] = gm.get_parameter(name)
        out.append(node)
    return out


def _replace(gm: GraphModule, block: MoEBlock, i: int, ctx: PassContext) -> None:
    bodies, names = [], []
    for io in block.body_io:
        body, params = split_body(block.split) if block.split is not None else extract_body(*io, ids=block.expert_ids)
        bodies.append(body)
        names += params
    holder = f"moe_experts_{i}"
    gm.add_submodule(holder, nn.ModuleList(bodies))
    graph, out_node = gm.graph, block.output
    params = _param_nodes(gm, names, block.region[0])
    why = f"MoE block '{block.module}' ({block.style}, {block.num_experts} experts, top-{block.top_k})"
    routed = "rows_out / rows_in: (token, slot) rows sent to / received from other ep ranks, recorded per call"
    with graph.inserting_before(out_node):
        dispatch = graph.call_function(moe.moe_dispatch, (block.tokens, block.index, block.num_experts, AXIS,
                                                        ctx.plan.capacity))
        rows = graph.call_function(operator.getitem, (dispatch, 0))
        routing = graph.call_function(operator.getitem, (dispatch, 1))
        bodies_node = graph.get_attr(holder)
        experts = graph.call_function(moe.moe_experts, (rows, routing, bodies_node, params, block.style, AXIS,
                                                        block.expert_ids is not None))
        combine = graph.call_function(moe.moe_combine, (experts, block.weights, routing, AXIS))
    tok = block.tokens.meta["val"]
    dispatch.meta["val"] = (tok, None)
    rows.meta["val"] = tok
    experts.meta["val"] = tok
    combine.meta["val"] = out_node.meta["val"]
    for n in (dispatch, rows, routing, experts, combine):
        n.meta["nn_module_stack"] = out_node.meta.get("nn_module_stack", {})
        n.meta["stack_trace"] = out_node.meta.get("stack_trace")
    provenance(dispatch, _PASS, AXIS, f"dispatch: token counts and tokens all-to-all to the expert owners; {why}",
               role="moe_dispatch", routed=routed)
    provenance(experts, _PASS, AXIS, f"the local experts of {why}, cut from the traced graph",
               role="moe_experts")
    provenance(combine, _PASS, AXIS, f"combine: reverse all-to-all, weighted sum over top-k; {why}",
               role="moe_combine", routed=routed)
    _routed_bytes(dispatch, combine, block, ctx)
    out_node.replace_all_uses_with(combine)
    region = set(block.region)
    for n in reversed(block.region):
        outside = [u for u in n.users if u not in region]
        if outside:
            raise AutoparError(
                f"autopar: {describe_node(n)} inside the experts of '{block.module}' is also used by "
                f"{describe_node(outside[0])}; expected the experts region to feed only its output. "
                "Use a plan with ep=1 and tp=1 for this model.")
        graph.erase_node(n)


def _check_ids(gm: GraphModule, block: MoEBlock, result: PassResult) -> None:
    """Experts run as traced count their rows per expert (a histogram of the sorted ids); on a data
    axis that count is the rank's share of one device's only when every id is proven at least 0
    (``passes/token_order.py``).  Ids the graph does not bound (a hash router's table lookup) are
    checked at run time in ``[0, E - 1]`` (``moe.checked_expert_ids``), which proves them."""
    if key_range(block.index) is not None or not any(n.target is aten.histc.default for n in block.region):
        return  # proven, or no histogram counts by them (experts picking their rows by a mask need no bound)
    index = block.index
    with gm.graph.inserting_after(index):
        check = gm.graph.call_function(moe.checked_expert_ids, (index, block.num_experts))
    check.meta["val"] = index.meta["val"]
    for key in ("nn_module_stack", "stack_trace"):
        check.meta[key] = index.meta.get(key)
    index.replace_all_uses_with(check, delete_user_cb=lambda u: u is not check)
    provenance(check, _PASS, None, f"every forward checks the expert ids of '{block.module}' in "
                                   f"[0, {block.num_experts - 1}]: the graph does not bound them (a table lookup)",
               role="moe_checked_ids")
    result.notes.append(f"{block.module}: expert ids {index.name} checked in [0, {block.num_experts - 1}] "
                        "at run time (the graph does not bound them)")


def _routed_bytes(dispatch: Node, combine: Node, block: MoEBlock, ctx: PassContext) -> None:
    """Predicted bytes, in the routed row counts (known at run time; cost/comm.py has the formula)."""
    ep = ctx.plan.ep
    if ep == 1:
        return
    row = block.hidden * block.tokens.meta["val"].element_size()
    rows_out, rows_in = sympy.Symbol("rows_out"), sympy.Symbol("rows_in")
    counts = (ep - 1) * local_experts(block.num_experts, ep) * 8  # int64 tokens per expert
    dispatch.meta[META_KEY].bytes = {"fwd": ("all_to_all", counts + rows_out * row),
                                     "bwd": ("all_to_all", rows_in * row)}
    dispatch.meta[META_KEY].calls = {"fwd": 2, "bwd": 1}
    combine.meta[META_KEY].bytes = {"fwd": ("all_to_all", rows_in * row), "bwd": ("all_to_all", rows_out * row)}
    combine.meta[META_KEY].calls = {"fwd": 1, "bwd": 1}


def _layouts(block: MoEBlock, ctx: PassContext, result: PassResult) -> None:
    ep = ctx.plan.ep
    result.expert_params += [p for p in block.param_names if p not in result.expert_params]
    if ep == 1:
        return
    num_local = local_experts(block.num_experts, ep)
    if block.style == "stacked":  # an ep that does not divide the experts pads them with zero experts
        padded = block.num_experts if block.num_experts % ep else None
        for name in block.param_names:
            result.shard_param(name, AXIS, ParamShard(0, size=padded), propagate=False)
        return
    for e, names in enumerate(block.expert_params):
        for name in names:
            result.shard_param(name, AXIS, ParamShard(0, owner=e // num_local), propagate=False)


def _seq_major_tokens(gm: GraphModule, block: MoEBlock | DenseExperts, ctx: PassContext) -> None:
    """Every ``[b, s, h] -> [b*s, h]`` flatten of the block goes through ``[s, b, h]``, and every
    ``[b*s, h] -> [b, s, h]`` back (in the block, or of the block's output: Llama 4 views it back
    in the decoder layer) through ``[s, b, h]`` and a transpose."""
    flats, unflats = [], []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in SIZED_RESHAPE_OPS:
            continue
        if not (in_module(n, block.module) or isinstance(n.args[0], Node) and in_module(n.args[0], block.module)):
            continue
        src, out = _dims(n.args[0]), _dims(n)
        if len(src) == 3 and len(out) == 2 and _is_seq(src[1], ctx):
            flats.append(n)
        elif len(src) == 2 and len(out) == 3 and _is_seq(out[1], ctx):
            unflats.append(n)
    if not flats or not unflats:
        raise AutoparError(f"autopar: sequence parallelism needs the MoE block '{block.module}' to flatten a "
                           "[batch, seq, hidden] activation into tokens and back; found "
                           f"{len(flats)} flatten(s) and {len(unflats)} unflatten(s). Use a plan without sp.")
    for flat in flats:
        src = flat.args[0]
        with gm.graph.inserting_before(flat):
            t = gm.graph.call_function(aten.transpose.int, (src, 0, 1))
        t.meta["val"] = src.meta["val"].transpose(0, 1)
        flat.replace_input_with(src, t)
        flat.target = aten.reshape.default  # a view cannot merge the transposed dims
    for back in unflats:
        b, s, h = back.args[1]
        back.args = (back.args[0], [s, b, h])
        old_val = back.meta["val"]
        back.meta["val"] = old_val.transpose(0, 1)
        with gm.graph.inserting_after(back):
            restore = gm.graph.call_function(aten.transpose.int, (back, 0, 1))
        restore.meta["val"] = old_val
        back.replace_all_uses_with(restore, delete_user_cb=lambda u: u is not restore)


def _dims(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def _is_seq(size, ctx: PassContext) -> bool:
    return is_seq_size(size, ctx.seq_symbol)


def expert_parallel_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    plan = ctx.plan
    result = PassResult(_PASS)
    if ctx.structure.moe_error is not None:
        # Experts the analysis could not cut out run unchanged: each rank computes its own tokens
        # (compile refuses the plans that would need them rewritten: tp, a capacity, ep with no other block).
        result.notes.append(f"MoE block left as traced: {ctx.structure.moe_error}")
    # Under cp the traced experts' token sort is an op across the sequence that shard propagation
    # cannot follow; the rewritten block's dispatch / experts / combine keep each rank's tokens.
    rewrite = moe_needs_rewrite(plan) or plan.cp > 1
    # The structure was analysed after cleanup; the passes before this one leave MoE blocks alone.
    for i, block in enumerate(ctx.structure.moe):
        _layouts(block, ctx, result)
        if not rewrite:  # ep=1, tp=1, cp=1, dropless: every rank runs every expert on its own tokens
            result.notes.append(f"{block.module}: {block.style} experts left as traced")
            _check_ids(gm, block, result)
            continue
        _replace(gm, block, i, ctx)
        if plan.tp > 1 and plan.sp:
            _seq_major_tokens(gm, block, ctx)
        result.num_rewritten += 1
        result.notes.append(f"{block.module}: {block.style} experts, E={block.num_experts}, top-{block.top_k}, "
                            f"{local_experts(block.num_experts, plan.ep)} per ep rank")
    for i, dense in enumerate(ctx.structure.dense_moe):  # under sp its tokens stay sequence-major
        if plan.ep > 1:  # each rank's E/ep experts on the ep group's tokens (passes/dense_expert_parallel.py)
            rewrite_dense_experts(gm, dense, i, AXIS, ctx, result)
            result.num_rewritten += 1
            result.notes.append(f"{dense.module}: dense experts, E={dense.num_experts}, "
                                f"{dense.num_experts // plan.ep} per ep rank on the ep group's tokens")
        if plan.tp > 1 and plan.sp:
            _seq_major_tokens(gm, dense, ctx)
            result.notes.append(f"{dense.module}: dense experts (every expert on every token) run "
                                "on the rank's sequence shard")
    gm.graph.eliminate_dead_code()
    return result
