"""Placements through a custom ``torch.autograd.Function``, for ``passes/shard_propagation.py``.

The trace keeps a Function whole, as one ``autopar::autograd_function`` node that runs the
Function's own ``apply`` on the rank's tensors (``autopar/frontend/custom_functions.py``).  The
node is placed from what its Python computes, never from its name: the Function's forward and,
for the gradients, its forward with its own backward are traced into graphs of aten ops on the
node's symbolic inputs, and each graph is placed node by node by the same rules
(``place``: shard propagation's ``place_node``), the inputs taking the node's placements and the
output gradients the placements the gradient walk found for them.

The rank runs the Function's code unchanged, so a placement is accepted only where every rule
holds on the ops as they are: a rule that would rewrite anything (a size argument to a local size,
a slice of a replicated operand, a collective) means the code on local tensors is not the
one-device computation, and the node is refused naming the Function and what the rule said.  An
input laid out by blocks (a fused QKV's parts) is refused too: the Function's code would not
know the layout.

:func:`place_function` is the forward rule; :func:`function_gradients` gives the gradient
placements of the node's inputs (``passes/gradient_placement.py``'s walk).
"""
from __future__ import annotations

from typing import Any, Callable

from torch.distributed.tensor import Partial, Shard
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError
from autopar.frontend.custom_functions import AUTOGRAD_FUNCTION, call_of, trace_forward, trace_joint
from .block_layout import LAYOUT_KEYS
from .draw_rules import DRAW_KEY
from .rules import P, R, RuleContext, is_sharded, tensor_inputs

__all__ = ["AUTOGRAD_FUNCTION", "place_function", "function_gradients"]


def place_function(node: Node, pls: list, rc: RuleContext, place: Callable) -> tuple:
    """The placements of the Function's outputs (one per item of the node's list)."""
    num_outputs = len(node.meta["val"])
    if not is_sharded(pls):
        outs = (R,) * num_outputs  # every rank runs it on the same whole values
    else:
        _refuse_layouts(node, rc)
        outs = tuple(_place_graph(node, trace_forward(node), list(pls), rc, place, "forward"))
    if rc.local_sizes:  # even on whole values: their gradients are the rank's shares
        _check_data_gradients(node, pls, outs, rc, place)
    return outs


def function_gradients(node: Node, out_grads: dict, pls: list, rc: RuleContext, place: Callable) -> list:
    """The gradient placement each tensor input of the node gets from the Function's backward
    (None: no gradient), given the gradient placement of each output (``out_grads``: index ->
    placement; an output without one gets zeros, replicated)."""
    num_outputs = len(node.meta["val"])
    grads_in = [out_grads.get(i, R) for i in range(num_outputs)]
    if not is_sharded(pls) and not is_sharded(grads_in):
        return [R] * len(pls)  # replicated values and gradients: every rank runs the same backward
    _refuse_layouts(node, rc)
    joint, slots = trace_joint(node)
    outs = _place_graph(node, joint, list(pls) + grads_in, rc, place, "backward")
    return [None if slot is None else outs[slot] for slot in slots]


def _check_data_gradients(node: Node, pls: list, outs: tuple, rc: RuleContext, place: Callable) -> None:
    """On a data axis no gradient walk follows (autograd's derivative of work on the rank's
    tokens stays on them), so the Function's own backward is placed here: the gradient of an
    output on the rank's tokens is on them, any other the rank's share (summed over the axis by
    the gradient sync), and each input must get a gradient of the same kind."""
    grads = function_gradients(node, {i: pl if isinstance(pl, Shard) else P for i, pl in enumerate(outs)}, pls, rc,
                               place)
    for arg, pl, grad in zip(tensor_inputs(node), pls, grads):
        if grad is not None and grad != pl and not (isinstance(grad, Partial) and not isinstance(pl, Shard)):
            raise rc.fail(node, f"the backward of the custom torch.autograd.Function '{call_of(node).name}' gives "
                                f"'{arg.name}' (placed {pl}) a gradient placed {grad}",
                          f"Use a plan without {rc.axis} for this model.")


def _refuse_layouts(node: Node, rc: RuleContext) -> None:
    laid = [a for a in tensor_inputs(node) if any(k in a.meta for k in LAYOUT_KEYS)]
    if laid:
        raise rc.fail(node, f"its input '{laid[0].name}' is laid out by blocks on {rc.axis}, which the "
                            f"custom torch.autograd.Function '{call_of(node).name}' would not know",
                      f"Use a plan without {rc.axis} for this model.")


def _place_graph(node: Node, gm: GraphModule, pls_in: list, rc: RuleContext, place: Callable, what: str):
    """Place ``gm`` (a trace of the Function) from its placeholders' placements; the placements of
    its outputs (a flat list)."""
    before = str(gm.graph)
    outer, outer_gm = rc.placements, rc.gm
    inner: dict[Node, Any] = {}
    rc.placements, rc.gm = inner, gm
    slots = iter(pls_in)
    try:
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                inner[n] = next(slots)
            elif n.op == "call_function":
                inner[n] = place(n, [inner.get(x, R) for x in tensor_inputs(n)], rc)
            elif n.op == "output":
                result = n.args[0]
    except AutoparError as exc:
        raise rc.fail(node, f"the {what} of the custom torch.autograd.Function '{call_of(node).name}' "
                            f"does not run on this rank's part of its inputs ({exc})",
                      f"Use a plan without {rc.axis} for this model.") from None
    finally:
        rc.placements, rc.gm = outer, outer_gm
    drawn = next((n for n in gm.graph.nodes if DRAW_KEY in n.meta), None)
    if drawn is not None:
        raise rc.fail(node, f"its {what} (custom torch.autograd.Function '{call_of(node).name}') draws random numbers "
                            f"for this rank's rows ({drawn.name}), which one device draws for the whole batch, and "
                            "autopar runs a Function's code as it is",
                      f"Use a plan without {rc.axis} for this model.")
    if str(gm.graph) != before:
        raise rc.fail(node, f"its {what} (custom torch.autograd.Function '{call_of(node).name}') would need its "
                            "code changed to run on this rank's part of its inputs (a size made local, a "
                            "slice or a collective inserted), and autopar runs a Function's code as it is",
                      f"Use a plan without {rc.axis} for this model.")
    return [inner.get(v, R) if isinstance(v, Node) else R for v in result]
