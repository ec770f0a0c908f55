"""Shard propagation: placements for every node, local shapes, partial gradients, bytes.

Runs after the passes that choose parameter layouts and insert collectives (TP, SP).  For
each mesh axis whose placements vary inside the graph (``ctx.sharded_axes``) it walks the
graph in order and asks the rule registry (``passes/rules.py``, ``passes/view_rules.py``)
for each node's output placement, given its inputs'.  Rules rewrite size arguments to
local sizes on the way.  Afterwards:

- every node carries ``node.meta["autopar_placement"][axis]``;
- a replicated parameter whose consumer produces a sharded output gets a gradient that is
  a partial sum over that axis (e.g. norm weights on sequence shards under SP), recorded in
  ``grad_partial_axes`` (in its result) for the gradient-sync buckets of the DP pass;
- every inserted collective gets its predicted bytes (sympy, in the traced batch and
  sequence symbols) in ``node.meta["autopar"].bytes``.

An op that has no rule and sees a sharded input raises an error naming the node, its
module and its source line.
"""
from __future__ import annotations

import math
from typing import Any

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr
from autopar.ops import collectives as C
from .context import META_KEY, PLACEMENT_KEY, PassContext, PassResult
from .rules import R, RuleContext, is_sharded, lookup
from . import moe_rules, view_rules  # noqa: F401  (register the view-family and MoE rules)

__all__ = ["shard_propagation_pass", "tensor_inputs", "local_numel"]

_COLLECTIVES = {C.all_gather, C.reduce_scatter, C.all_reduce, C.region_entry, C.vocab_parallel_cross_entropy}


def tensor_inputs(node: Node) -> list[Node]:
    out: list[Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, Node):
            if isinstance(a.meta.get("val"), (torch.Tensor, tuple, list)) or a.op == "get_attr":
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    visit(node.args)
    visit(tuple(node.kwargs.values()))
    return out


def local_numel(node: Node, ctx: PassContext) -> sympy.Expr:
    """Number of elements of ``node``'s value on one rank (sympy, symbolic batch/sequence)."""
    val = node.meta["val"]
    sizes = [sym_expr(s) if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in val.shape]
    for axis, pl in (node.meta.get(PLACEMENT_KEY) or {}).items():
        if isinstance(pl, Shard):
            sizes[pl.dim] = sizes[pl.dim] / ctx.axis_sizes[axis]
    return sympy.simplify(math.prod(sizes, start=sympy.Integer(1)))


def _propagate_axis(gm: GraphModule, ctx: PassContext, result: PassResult, axis: str, local_syms: dict) -> None:
    rc = RuleContext(gm, axis, ctx.axis_sizes[axis], local_syms)
    placements: dict[Node, Any] = {}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            pl = R
        elif node.op == "get_attr":
            shard = ctx.param_shards.get(node.target, {}).get(axis)
            pl = Shard(shard.dim) if shard else R
        elif node.op == "call_function":
            pls = [placements.get(a, R) for a in tensor_inputs(node)]
            rule = lookup(node.target)
            if rule is not None:
                pl = rule(node, pls, rc)
            elif is_sharded(pls):
                raise rc.fail(node, f"no sharding rule for {getattr(node.target, '__name__', node.target)} "
                                    f"with inputs placed {pls}",
                              "Add a rule to passes/rules.py, or use a plan without this dimension.")
            else:
                pl = R
        elif node.op == "output":
            for a in tensor_inputs(node):
                if is_sharded(placements.get(a, R)):
                    raise rc.fail(a, f"the graph returns a value placed {placements[a]}",
                                  "Return a loss (pass loss_fn) so sharded outputs are reduced inside the graph.")
            continue
        else:
            raise rc.fail(node, f"unsupported node kind {node.op}")
        placements[node] = pl
        if pl is not None:
            node.meta.setdefault(PLACEMENT_KEY, {})[axis] = pl
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    for node, pl in placements.items():
        if node.op == "get_attr" and node.target in params and isinstance(pl, Replicate):
            if _feeds_local_work(node, placements):
                result.grad_partial_axes.setdefault(node.target, set()).add(axis)


def _feeds_local_work(param: Node, placements: dict) -> bool:
    """Does a replicated parameter reach, through replicated values, an op that works on
    shards?  Then each rank's gradient holds only its shards' contribution: a partial sum.
    A region entry stops the walk: its backward all-reduces the gradient into a full one."""
    todo, seen = [param], set()
    while todo:
        for user in todo.pop().users:
            if user in seen or user.target is C.region_entry:
                continue
            seen.add(user)
            out = placements.get(user)
            if isinstance(out, (tuple, list)):
                out = next((o for o in out if not isinstance(o, Replicate)), R)
            if isinstance(out, (Shard, Partial)):
                return True
            todo.append(user)
    return False


def _predict_bytes(node: Node, ctx: PassContext) -> dict:
    axis = node.meta[META_KEY].axis
    n = ctx.axis_sizes[axis]
    src = node.args[0]
    itemsize = src.meta["val"].element_size()
    numel = local_numel(src, ctx)
    if node.target is C.all_gather:
        return {"fwd": ("all_gather", numel * itemsize), "bwd": ("reduce_scatter", numel * itemsize * n)}
    if node.target is C.reduce_scatter:
        return {"fwd": ("reduce_scatter", numel * itemsize), "bwd": ("all_gather", numel * itemsize / n)}
    if node.target is C.all_reduce:
        return {"fwd": ("all_reduce", numel * itemsize)}
    if node.target is C.region_entry:
        return {"bwd": ("all_reduce", numel * itemsize)}
    # vocab-parallel cross-entropy: three all-reduces of one fp32 value per token
    tokens = numel / sympy.Integer(int(src.meta["val"].shape[-1]) // n)
    return {"fwd": ("all_reduce", 3 * tokens * 4)}


def shard_propagation_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("shard_propagation_pass")
    local_syms: dict = {}
    for axis in ctx.sharded_axes:
        _propagate_axis(gm, ctx, result, axis, local_syms)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _COLLECTIVES and META_KEY in node.meta:
            buffers = _predict_bytes(node, ctx)
            n = ctx.axis_sizes[node.meta[META_KEY].axis]
            node.meta[META_KEY].bytes = {
                phase: (op, C.ring_bytes(op, size, n)[0]) for phase, (op, size) in buffers.items()
            }
            result.num_rewritten += 1
    result.notes.append(f"placed {len(list(gm.graph.nodes))} nodes on axes {ctx.sharded_axes or ['none']}")
    return result
