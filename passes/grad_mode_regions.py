"""Placements through ``torch.no_grad()`` regions, for ``passes/shard_propagation.py``.

torch.export traces ``torch.no_grad()`` inside a model as one higher-order node,
``wrap_with_set_grad_enabled(False, body, *operands)``, whose ``body`` is a GraphModule of its
own (a router's top-k, a sparse-attention indexer).  It is not an aten op, so the rule
registry has no rule for it; :func:`place_region` places its graph node by node with the same
rules instead, its placeholders taking the operands' placements and block layouts, its outputs
giving theirs to the region's items.

A rule may add local work inside (a slice of a replicated operand), never a collective: the
cost model and the byte checks read the top graph only.  Where the body would need one on a
model axis (a sparse-attention indexer scoring every key from sequence shards under SP), its
sharded operands are gathered before the region instead (``gather_replicated``: no gradient
leaves a no-grad region, so the gather needs no backward) and every rank runs the region on
the whole sequence, as it runs attention: every value inside is then replicated, placed so
without asking the rules (which would read whole operands as sharded ones' local sizes).  On a data axis (dp, cp) no gather can restore the
one device's batch, so the region is refused naming the node inside it that needs one.
"""
from __future__ import annotations

import copy
import operator
from typing import Any, Callable

import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError
from autopar.ops import collectives
from .block_layout import LAYOUT_KEYS, carry_blocks
from .context import provenance
from .rules import R, RuleContext, tensor_inputs

__all__ = ["GRAD_MODE_REGION", "place_region"]

GRAD_MODE_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def place_region(node: Node, rc: RuleContext, place: Callable) -> Any:
    """The placements of the region's outputs (a tuple); ``place`` is shard propagation's
    ``place_node``.  The body is placed on a copy first, so a refusal leaves it untouched."""
    owner, name = node.graph.owning_module, node.args[1].target
    operands = [a if isinstance(a, Node) else None for a in node.args[2:]]
    trial = copy.deepcopy(getattr(owner, name))
    try:
        outs = _place_body(node, trial, [rc.placements.get(a, R) if a is not None else R for a in operands],
                           operands, rc, place)
    except AutoparError:
        sharded = [a for a in operands if a is not None and isinstance(rc.placements.get(a, R), Shard)]
        if rc.local_sizes or not sharded or any(k in a.meta for a in sharded for k in LAYOUT_KEYS):
            raise
        for a in sharded:
            _gather_before(node, a, rc)
        trial = copy.deepcopy(getattr(owner, name))
        outs = _place_body(node, trial, [R] * len(operands), operands, rc, lambda *_: R)
    setattr(owner, name, trial)
    return outs


def _gather_before(node: Node, a: Node, rc: RuleContext) -> None:
    graph = node.graph
    with graph.inserting_before(node):
        whole = graph.call_function(collectives.gather_replicated,
                                    (a, rc.placements[a].dim, rc.axis, f"no-grad region {node.name}"))
    whole.meta["val"] = a.meta.get("val")
    provenance(whole, "shard_propagation", rc.axis, f"the no-grad region '{node.name}' needs its input whole")
    node.replace_input_with(a, whole)
    rc.placements[whole] = R


def _place_body(node: Node, body: GraphModule, pls_in: list, operands: list, rc: RuleContext,
                place: Callable) -> tuple:
    outer, outer_gm = rc.placements, rc.gm
    inner: dict[Node, Any] = {}
    before = set(body.graph.nodes)
    rc.placements, rc.gm = inner, body
    results = []
    try:
        slots = iter(zip(operands, pls_in))
        for n in body.graph.nodes:
            if n.op == "placeholder":
                a, inner[n] = next(slots)
                if a is not None:
                    n.meta.update({k: a.meta[k] for k in LAYOUT_KEYS if k in a.meta})
            elif n.op == "call_function":
                pls = [inner.get(x, R) for x in tensor_inputs(n)]
                inner[n] = place(n, pls, rc)
                carry_blocks(n, pls, inner[n], rc)
            elif n.op == "output":
                results = list(n.args[0])
            else:
                inner[n] = R  # constants of the region
        added = [n for n in body.graph.nodes if n not in before and n.op == "call_function"
                 and getattr(n.target, "__module__", "") == collectives.__name__]
        if added:
            needs = added[0].args[0] if isinstance(added[0].args[0], Node) else node  # the value it reduces
            raise rc.fail(needs, f"it needs a collective on {rc.axis} ({added[0].target.__name__}) inside "
                                 "torch.no_grad(), a region traced as a graph of its own where none can run",
                          f"Use a plan without {rc.axis} for this model, or compute it outside torch.no_grad().")
    finally:
        rc.placements, rc.gm = outer, outer_gm
    body.recompile()  # the rules rewrote size arguments to local sizes
    for user in node.users:  # getitem(region, i): the layout of the region's i-th result
        result = results[user.args[1]] if user.target is operator.getitem else None
        if isinstance(result, Node):
            user.meta.update({k: result.meta[k] for k in LAYOUT_KEYS if k in result.meta})
    return tuple(inner.get(a, R) if isinstance(a, Node) else R for a in results)
