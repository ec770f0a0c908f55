"""Shard propagation: placements for every node, local shapes, partial gradients, bytes.

Runs after the passes that choose parameter layouts and insert collectives (TP, SP).  For
each mesh axis whose placements vary inside the graph (``ctx.sharded_axes``) it walks the
graph in order and asks the rule registry (``passes/rules.py``, whose families this module
imports) for each node's output placement, given its inputs'.  Rules rewrite size arguments to
local sizes on the way.  Afterwards:

- every node carries ``node.meta["autopar_placement"][axis]``;
- the graph is walked back from the loss for every node's *gradient* placement
  (``passes/gradient_placement.py``): a replicated parameter whose gradient is a partial sum
  over the axis (e.g. norm weights on sequence shards under SP) is recorded in
  ``grad_partial_axes`` (in its result) for the gradient-sync buckets of the DP pass; each
  all-gather gets the backward its gradient needs; a value whose gradient has no placement
  is refused;
- every inserted collective gets its predicted bytes (sympy, in the traced batch and
  sequence symbols) in ``node.meta["autopar"].bytes``.

An op that has no rule and sees a sharded input raises an error naming the node, its
module and its source line.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import sympy
from torch.distributed.tensor import Partial, Shard
from torch.fx import GraphModule, Node

from autopar.ops import collectives
from autopar.ops.whole_rows import sum_whole_rows, whole_numel
from .block_layout import carry_blocks
from .context import META_KEY, PLACEMENT_KEY, PassContext, PassResult
from .autograd_functions import AUTOGRAD_FUNCTION, place_function
from .grad_mode_regions import GRAD_MODE_REGION, place_region
from .gradient_placement import gradient_placements
from .rules import P, R, RuleContext, is_loss_share, is_sharded, lookup, lookup_token_order, size_expr, tensor_inputs
from .token_order import as_share, is_token_order
# Every rule family registers into the one table when imported (passes/rules.py lists them).
from . import matmul_rules, moe_rules, op_rules, pointwise_rules, reduction_rules, token_order_rules  # noqa: F401
from . import draw_rules, join_rules, view_rules  # noqa: F401

__all__ = ["shard_propagation_pass", "propagate", "tensor_inputs", "local_numel", "BY_RULES"]

# What a ``propagate`` shortcut returns for a node it leaves to the rules.
BY_RULES = object()

# The collectives of the TP and SP passes, whose bytes this pass predicts (CP and EP predict their own).
_TP_COLLECTIVES = {collectives.all_gather, collectives.gather_replicated, collectives.reduce_scatter,
                   collectives.all_reduce, collectives.region_entry, collectives.vocab_parallel_cross_entropy,
                   sum_whole_rows}


def local_numel(node: Node, ctx: PassContext) -> sympy.Expr:
    """Number of elements of ``node``'s value on one rank (sympy, symbolic batch/sequence)."""
    val = node.meta["val"]
    sizes = [size_expr(s) for s in val.shape]
    for axis, pl in (node.meta.get(PLACEMENT_KEY) or {}).items():
        if isinstance(pl, Shard):
            n = ctx.axis_sizes[axis]
            d = sizes[pl.dim]  # an uneven (padded vocabulary) shard keeps ceil(d / n) rows
            sizes[pl.dim] = sympy.Integer(-(-int(d) // n)) if d.is_Integer and int(d) % n else d / n
    return _simplified_product(tuple(sizes))


@functools.lru_cache(maxsize=4096)
def _simplified_product(sizes: tuple) -> sympy.Expr:
    # Cached: every layer asks for the same few shapes, and sympy.simplify costs milliseconds.
    return sympy.simplify(math.prod(sizes, start=sympy.Integer(1)))


def propagate(gm: GraphModule, rc: RuleContext, start: Callable[[Node], Any],
              shortcut: Callable[[Node], Any] | None = None) -> dict[Node, Any]:
    """Forward placements on ``rc.axis`` of every node, by the rule registry, in graph order.

    ``start(node)`` places the placeholders and parameters; ``shortcut(node)``, where given, places
    a node without a rule (the batch propagation's rows read from shapes) or returns ``BY_RULES``.
    Raises where an op without a rule sees a sharded input, and where the graph returns anything
    but a replicated value (a data-sharded axis, ``rc.local_sizes``: anything but the rank's share
    of the loss)."""
    placements: dict[Node, Any] = {}
    rc.placements = placements
    for node in list(gm.graph.nodes):
        if shortcut is not None and node.op != "output" and (pl := shortcut(node)) is not BY_RULES:
            pass
        elif node.op in ("placeholder", "get_attr"):
            pl = start(node)
            if rc.local_sizes:
                rc.check_tokens(node, pl)
        elif node.op == "call_function":
            pls = [placements.get(a, R) for a in tensor_inputs(node)]
            pl = place_node(node, pls, rc)
            carry_blocks(node, pls, pl, rc)
            if rc.local_sizes:
                rc.check_tokens(node, pl)
        elif node.op == "output":
            for a in tensor_inputs(node):
                pl = placements.get(a, R)
                if rc.local_sizes and (is_loss_share(pl) or (rc.sum_loss and pl == P)):
                    continue
                if is_sharded(pl):
                    raise rc.fail(a, f"the graph returns a value placed {pl}",
                                  "Return a loss (pass loss_fn) so sharded outputs are reduced inside the graph."
                                  if not rc.local_sizes else
                                  "The graph must return the loss: a mean over this rank's tokens.")
            continue
        else:
            raise rc.fail(node, f"unsupported node kind {node.op}")
        placements[node] = pl
    return placements


def place_node(node: Node, pls: list, rc: RuleContext) -> Any:
    """``node``'s placement by its rule.  On a data axis a token-order rule (passes/token_order.py)
    is asked first; an input in a rank-local token order that it does not place is refused, and
    the op's own rule reads counts of the rank's rows as their share of the batch's."""
    if node.target is GRAD_MODE_REGION:
        return place_region(node, rc, place_node)
    if node.target is AUTOGRAD_FUNCTION:
        return place_function(node, pls, rc, place_node)
    if rc.local_sizes:
        order_rule = lookup_token_order(node.target)
        pl = order_rule(node, pls, rc) if order_rule is not None else None
        if pl is not None:
            return pl
        pls = [as_share(p) for p in pls]
        regrouped = [(a, p) for a, p in zip(tensor_inputs(node), pls) if is_token_order(p)]
        if regrouped:
            arg, where = regrouped[0]
            raise rc.fail(node, f"it reads '{arg.name}', placed {where}: this rank's tokens in a rank-local order "
                                "(a sort or selection of its tokens), which this op would let mix with other "
                                "tokens or leave the region in that order",
                          "A region of the rank's tokens (an MoE block's routing) may only permute, count and "
                          "scatter them back to their positions; use a plan that rewrites the experts (ep), a "
                          f"plan without {rc.axis}, or report the model.")
    rule = lookup(node.target)
    if rule is not None:
        return rule(node, pls, rc)
    if is_sharded(pls):
        raise rc.fail(node, f"no sharding rule for {getattr(node.target, '__name__', node.target)} "
                            f"with inputs placed {pls}",
                      "Add a rule to passes/rules.py, or use a plan without this dimension.")
    return R


def _propagate_axis(gm: GraphModule, ctx: PassContext, result: PassResult, axis: str, local_syms: dict) -> None:
    rc = RuleContext(gm, axis, ctx.axis_sizes[axis], local_syms,
                     uneven=frozenset(sh[axis].size for sh in ctx.param_shards.values()
                                      if axis in sh and sh[axis].size is not None),
                     param_blocks={name: (tuple(sh[axis].blocks), tuple(sh[axis].whole or ()))
                                   for name, sh in ctx.param_shards.items() if axis in sh and sh[axis].blocks})

    def start(node: Node):
        shard = ctx.param_shards.get(node.target, {}).get(axis) if node.op == "get_attr" else None
        return Shard(shard.dim) if shard else R

    placements = propagate(gm, rc, start)
    for node, pl in placements.items():
        if pl is not None:
            node.meta.setdefault(PLACEMENT_KEY, {})[axis] = pl
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for node, grad in gradient_placements(gm, rc, placements, place_node).items():
        if node.op == "get_attr" and node.target in params and isinstance(grad, Partial):
            result.grad_partial_axes.setdefault(node.target, set()).add(axis)


def _predict_bytes(node: Node, ctx: PassContext) -> dict:
    axis = node.meta[META_KEY].axis
    n = ctx.axis_sizes[axis]
    src = node.args[0]
    itemsize = src.meta["val"].element_size()
    numel = local_numel(src, ctx)
    if node.target is collectives.all_gather:
        return {"fwd": ("all_gather", numel * itemsize), "bwd": ("reduce_scatter", numel * itemsize * n)}
    if node.target is collectives.gather_replicated:
        return {"fwd": ("all_gather", numel * itemsize)}
    if node.target is collectives.reduce_scatter:
        return {"fwd": ("reduce_scatter", numel * itemsize), "bwd": ("all_gather", numel * itemsize / n)}
    if node.target is collectives.all_reduce:
        return {"fwd": ("all_reduce", numel * itemsize)}
    if node.target is collectives.region_entry:
        return {"bwd": ("all_reduce", numel * itemsize)}
    if node.target is sum_whole_rows:  # the whole blocks' rows of the weight's gradient
        return {"bwd": ("all_reduce", whole_numel(src.meta["val"].shape, *node.args[1:4]) * itemsize)}
    # vocab-parallel cross-entropy: three all-reduces of one fp32 value per token
    tokens = numel / sympy.Integer(-(-int(src.meta["val"].shape[-1]) // n))
    return {"fwd": ("all_reduce", 3 * tokens * 4)}


def shard_propagation_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("shard_propagation_pass")
    local_syms: dict = {}
    for axis in ctx.sharded_axes:
        _propagate_axis(gm, ctx, result, axis, local_syms)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _TP_COLLECTIVES and META_KEY in node.meta:
            buffers = _predict_bytes(node, ctx)
            n = ctx.axis_sizes[node.meta[META_KEY].axis]
            node.meta[META_KEY].bytes = {
                phase: (op, collectives.ring_bytes(op, size, n)[0]) for phase, (op, size) in buffers.items()
            }
            result.num_rewritten += 1
    result.notes.append(f"placed {len(list(gm.graph.nodes))} nodes on axes {ctx.sharded_axes or ['none']}")
    return result
