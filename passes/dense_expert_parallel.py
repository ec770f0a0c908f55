"""Expert parallelism for dense experts (``analyze_moe.DenseExperts``: Llama 4), called by the EP pass.

A dense block runs every expert on every token: ``y = sum_e experts_e(x * scores[:, e])``, the
tokens repeated once per expert and one batched matmul over the ``E`` stacked experts.  Under ep the
computation from the tokens ``x`` and the router's ``scores`` to ``y`` is cut out of the graph
(``extract_body``) and replaced by three calls of :mod:`autopar.ops.dense_moe`::

    x_all, scores_mine = dense_gather(x, scores, 'ep')      # all-gather the ep group's tokens
    partial = dense_experts(x_all, scores_mine, body, params)  # this rank's E/ep experts, summed
    y = dense_scatter(partial, 'ep')                        # reduce-scatter to the rank's tokens

Exact by construction: ``y`` is the sum over every expert, split into the ranks' sums.  The body is
the user's traced code with its expert count made local by placement propagation on the ``ep`` axis
(:func:`localize`), not by editing numbers that happen to equal ``E``: the scores' expert columns and
the stacked parameters' dim 0 are sharded, the op rules rewrite every size their shard passes through
(``view(E, -1, h)`` becomes ``view(E/ep, -1, h)``) and the sum over the experts comes out a partial
sum, which is what the reduce-scatter adds up.  Anything else (the body reading another expert's
score, a softmax over the experts) fails there with the rule's error, before any step.

The stacked parameters are laid out and their gradients reduced as routed stacked experts are:
sharded on dim 0 over ``ep`` and listed in ``expert_params`` (the DP pass reduces them over the
ranks holding the same experts, ``edp``).
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Partial, Shard
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError, describe_node
from autopar.frontend.analyze_moe import DenseExperts
from autopar.frontend.moe_bodies import body_members, extract_body
from autopar.ops import collectives, dense_moe
from .context import META_KEY, ParamShard, PassContext, PassResult, provenance
from .rules import R, RuleContext, size_expr, tensor_inputs
from .block_layout import carry_blocks
from .shard_propagation import place_node

__all__ = ["rewrite_dense_experts", "localize"]

_PASS = "expert_parallel_pass"
aten = torch.ops.aten


def rewrite_dense_experts(gm: GraphModule, block: DenseExperts, i: int, axis: str, ctx: PassContext,
                          result: PassResult) -> None:
    """Replace ``block``'s experts by the gather / local experts / scatter calls (module docstring)."""
    ep = ctx.axis_sizes[axis]
    if block.num_experts % ep:  # routed experts pad (plan_space.local_experts); these are split by the rules
        good = [d for d in range(1, block.num_experts + 1) if block.num_experts % d == 0]
        raise AutoparError(
            f"autopar: ep={ep} does not divide the {block.num_experts} dense experts at {describe_node(block.node)}; "
            f"every expert runs on every token, and their split over ep must be even: use an ep among "
            f"{', '.join(map(str, good))} that divides dp*cp, or a plan without ep.")
    if block.output is None:
        raise AutoparError(
            f"autopar: ep={ep} needs the dense experts at {describe_node(block.node)} to read the tokens "
            "[tokens, hidden] and the router's scores [tokens, experts] and return their sum [tokens, hidden]; "
            "that form was not found. Use a plan without ep (dp, tp with sp, cp and pp run these experts as traced).")
    members, _ = body_members([block.tokens, block.scores], block.output)
    body, names = extract_body(block.tokens, block.scores, block.output, offsets_name="scores")
    if set(names) != set(block.params):
        raise AutoparError(f"autopar: the dense experts ending at {describe_node(block.output)} read the parameters "
                           f"{sorted(names)}, expected the stacked experts {sorted(block.params)} only. Use a plan "
                           "without ep for this model.")
    sources = [block.tokens.meta["val"], block.scores.meta["val"], *(gm.get_parameter(n) for n in names)]
    for ph, val in zip((n for n in body.graph.nodes if n.op == "placeholder"), sources):
        ph.meta["val"] = val  # the rules read the inputs' shapes
    localize(body, axis, ep, block)
    holder = f"dense_experts_{i}"
    gm.add_submodule(holder, body)
    sp = ctx.plan.tp if ctx.plan.tp > 1 and ctx.plan.sp else 1
    _insert_calls(gm, block, holder, names, axis, ep, sp)
    _erase(gm, block, members)
    result.expert_params += [p for p in block.params if p not in result.expert_params]
    for name in block.params:
        result.shard_param(name, axis, ParamShard(0), propagate=False)


def localize(body: GraphModule, axis: str, ep: int, block: DenseExperts) -> None:
    """Make ``body`` compute this rank's ``E/ep`` experts: placements on ``axis`` from the scores'
    expert columns and the parameters' dim 0 (the tokens are the whole group's, replicated), each
    op's rule rewriting the sizes its shard passes through; the output must be a partial sum."""
    rc = RuleContext(body, axis, ep, {}, pass_name=_PASS)
    placements: dict[Node, object] = {}
    rc.placements = placements
    inputs = [n for n in body.graph.nodes if n.op == "placeholder"]
    start = {inputs[0]: R, inputs[1]: Shard(1), **{p: Shard(0) for p in inputs[2:]}}
    for node in list(body.graph.nodes):
        if node.op == "placeholder":
            placements[node] = start[node]
        elif node.op == "call_function":
            pls = [placements.get(a, R) for a in tensor_inputs(node)]
            try:
                placements[node] = place_node(node, pls, rc)
            except AutoparError as exc:
                raise AutoparError(f"{exc} (ep={ep} runs each rank's experts of the dense experts at "
                                   f"{describe_node(block.node)} on their score columns and parameter rows; "
                                   "use a plan without ep for this model.)") from exc
            carry_blocks(node, pls, placements[node], rc)
        elif node.op == "output":
            out = _partial_sum(node, axis, placements)
            if out is None:
                raise AutoparError(
                    f"autopar: ep={ep} splits the {block.num_experts} dense experts at {describe_node(block.node)}, "
                    f"but their output {describe_node(block.output)} computed from this rank's experts is placed "
                    f"{placements.get(node.args[0])}, expected a partial sum over the experts. Use a plan without ep.")
            node.args = (out,)
    body.graph.eliminate_dead_code()
    _repeat_local_copies(body, axis, ep)
    body.recompile()


def _partial_sum(output: Node, axis: str, placements: dict) -> Node | None:
    """The body's partial sum over the experts.  The sum rule over the sharded experts dim makes the
    sum whole where it is computed (``region_entry(all_reduce(partial))``, the identity forward): the
    reduce-scatter after the body sums it instead, so the body returns the partial value itself."""
    out = output.args[0]
    if isinstance(placements.get(out), Partial):
        return out
    if out.target is collectives.region_entry and out.args[1] == axis:
        total = out.args[0]
        if total.target is collectives.all_reduce and total.args[1] == axis \
                and isinstance(placements.get(total.args[0]), Partial):
            return total.args[0]
    return None


def _repeat_local_copies(body: GraphModule, axis: str, ep: int) -> None:
    """``local_shard(x.repeat(.., E, ..), d)``, the rank's copies of a replicated ``x`` repeated per
    expert along ``d``, is ``x.repeat(.., E/ep, ..)``: every copy is the same, so the rank's slice
    holds ``E/ep`` of them.  Repeating only those saves the other ranks' ``(ep-1)/ep`` of the copies."""
    for node in list(body.graph.nodes):
        if node.target is not collectives.local_shard or node.args[2] != axis:
            continue
        rep, dim = node.args[0], node.args[1]
        if not (isinstance(rep, Node) and rep.target is aten.repeat.default and len(rep.users) == 1):
            continue
        reps = list(rep.args[1])
        lead = len(reps) - rep.args[0].meta["val"].dim()  # repeat's new leading dims
        if dim < lead or not isinstance(reps[dim], int) or reps[dim] % ep or reps[dim] == 1:
            continue
        reps[dim] //= ep
        rep.args = (rep.args[0], reps)
        node.replace_all_uses_with(rep)
        body.graph.erase_node(node)


def _insert_calls(gm: GraphModule, block: DenseExperts, holder: str, names: list[str], axis: str, ep: int,
                  sp: int) -> None:
    graph, out = gm.graph, block.output
    existing = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    params = [existing[name] for name in names]
    why = f"dense MoE block '{block.module}' ({block.num_experts} experts, every expert on every token)"
    with graph.inserting_before(out):
        gather = graph.call_function(dense_moe.dense_gather, (block.tokens, block.scores, axis))
        x_all = graph.call_function(operator.getitem, (gather, 0))
        scores = graph.call_function(operator.getitem, (gather, 1))
        partial = graph.call_function(dense_moe.dense_experts, (x_all, scores, graph.get_attr(holder), params))
        y = graph.call_function(dense_moe.dense_scatter, (partial, axis))
    # Seen from outside the calls are token-wise: their values are given the rank's tokens' shapes.
    tok, sc = block.tokens.meta["val"], block.scores.meta["val"]
    for node, val in ((gather, (tok, sc)), (x_all, tok), (scores, sc), (partial, out.meta["val"]), (y, out.meta["val"])):
        node.meta["val"] = val
        node.meta["nn_module_stack"] = out.meta.get("nn_module_stack", {})
        node.meta["stack_trace"] = out.meta.get("stack_trace")
    provenance(gather, _PASS, axis, f"all-gather the ep group's tokens and router scores; {why}",
               role="dense_gather")
    provenance(partial, _PASS, axis, f"this rank's {block.num_experts // ep} experts of {why}, cut from the "
                                     "traced graph, on every gathered token", role="dense_experts")
    provenance(y, _PASS, axis, f"reduce-scatter the experts' partial sums to the tokens' ranks; {why}",
               role="dense_scatter")
    _predicted_bytes(gather, y, block, ep, sp)
    out.replace_all_uses_with(y)


def _predicted_bytes(gather: Node, scatter: Node, block: DenseExperts, ep: int, sp: int) -> None:
    """Ring bytes one rank sends (docs/architecture.md): each all-gather and reduce-scatter moves
    ``(ep-1)/ep`` of the gathered tensor, i.e. ``(ep-1)`` times the rank's piece."""
    def piece(node: Node):
        val = node.meta["val"]
        numel = 1
        for s in val.shape:
            numel = numel * size_expr(s)
        return numel * val.element_size()

    # under tp with sp the block runs on the rank's sequence shard (the traced sizes are the whole sequence's)
    tokens, scores, out = (piece(n) / sp for n in (block.tokens, block.scores, block.output))
    gather.meta[META_KEY].bytes = {"fwd": ("all_gather", (ep - 1) * (tokens + scores)),
                                   "bwd": ("reduce_scatter", (ep - 1) * (tokens + scores))}
    gather.meta[META_KEY].calls = {"fwd": 2, "bwd": 2}
    scatter.meta[META_KEY].bytes = {"fwd": ("reduce_scatter", (ep - 1) * out), "bwd": ("all_gather", (ep - 1) * out)}


def _erase(gm: GraphModule, block: DenseExperts, members: set[Node]) -> None:
    for n in sorted(members, key=lambda n: n.meta["_autopar_order"], reverse=True):
        outside = [u for u in n.users if u not in members]
        if outside:
            raise AutoparError(
                f"autopar: {describe_node(n)} inside the dense experts of '{block.module}' is also used by "
                f"{describe_node(outside[0])}; expected the experts to feed only their sum. Use a plan without ep.")
        gm.graph.erase_node(n)
