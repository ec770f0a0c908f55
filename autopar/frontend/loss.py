"""How the traced loss reduces over tokens: can the runtime split it over ranks exactly?

Splitting the batch (dp, cp, micro-batches) gives each piece its own loss.  When the loss is
a mean over *every* element of the target, equal pieces have equal denominators and the mean
of the pieces' means is the global mean.  A cross-entropy with ``ignore_index`` divides by
the number of targets that are not ignored, which differs between pieces of a padded batch:
the mean of means is then wrong.  It is exact again when each piece's loss is weighted by its
share of the global count of valid targets (a summed cross-entropy: by the number of pieces,
so that the mean over pieces is the sum), which the runtime computes from the targets
(:meth:`autopar.runtime.stepping.loss_split.LossSplit.weight`).

:func:`loss_reduction` proves from the graph which case holds: the output must be one
``aten.cross_entropy_loss`` node with ``reduction="mean"`` and no class weights (whose
denominator would be a sum of weights), whose target is the target input itself, through
reshapes only, so that "valid" means ``target != ignore_index`` element for element.
Anything else is ``opaque``: exact only without ignored targets, which the runtime checks
on every batch before the step (:func:`autopar.runtime.stepping.loss_split.LossSplit.weight`
refuses a batch it cannot normalise).  Neighbours: :mod:`autopar.frontend.analyze` calls this
and stores the result on the structure.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.fx import GraphModule, Node

from autopar.errors import describe_node
from autopar.frontend.op_sets import RESHAPE_OPS

__all__ = ["LossReduction", "loss_reduction", "logits_consumer", "logits_loss"]

aten = torch.ops.aten
_MEAN, _SUM = 1, 2  # torch's Reduction::Mean and ::Sum
# Ops that only re-arrange the target's elements (one target element per loss term).
_REARRANGE = RESHAPE_OPS | {aten.contiguous.default, aten.clone.default, aten.alias.default}
# Ops the logits may pass through on their way to a vocabulary-parallel loss (logits_consumer).
_VIEWISH = RESHAPE_OPS | {aten.slice.Tensor, aten.contiguous.default, aten.to.dtype, aten._to_copy.default,
                          aten.clone.default}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossReduction:
    """``token_mean``: a mean cross-entropy over the targets that are not ``ignore_index``;
    ``token_sum``: the same summed (the pieces' sums add up); ``opaque``: anything else
    (``reason`` says what was found)."""

    kind: str
    ignore_index: int | None = None
    reason: str = ""
    cross_entropy_ignore: int | None = None  # an ignore_index seen in a loss autopar cannot split

    @property
    def token_mean(self) -> bool:
        return self.kind == "token_mean"


def _cross_entropy_options(node: Node) -> dict:
    names = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
    defaults = {"weight": None, "reduction": _MEAN, "ignore_index": -100, "label_smoothing": 0.0}
    values = dict(defaults)
    values.update(dict(zip(names, node.args)))
    values.update(node.kwargs)
    return values


def _from_placeholder(node, target: Node) -> bool:
    while isinstance(node, Node) and node is not target:
        if node.op != "call_function" or node.target not in _REARRANGE:
            return False
        node = node.args[0]
    return node is target


def loss_reduction(gm: GraphModule) -> LossReduction:
    """Classify the traced training graph's loss (the target is the last placeholder)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    losses = [n for n in gm.graph.nodes if n.target == aten.cross_entropy_loss.default]
    seen_ignore = _cross_entropy_options(losses[-1])["ignore_index"] if losses else None
    opaque = lambda why: LossReduction(kind="opaque", reason=why, cross_entropy_ignore=seen_ignore)  # noqa: E731
    if not isinstance(result, Node) or result.target != aten.cross_entropy_loss.default:
        found = describe_node(result) if isinstance(result, Node) else type(result).__name__
        return opaque(f"the loss is {found}, not a cross-entropy node")
    options = _cross_entropy_options(result)
    if options["reduction"] not in (_MEAN, _SUM):
        return opaque(f"cross-entropy with reduction={options['reduction']} (expected the mean or the sum) at "
                      f"{describe_node(result)}")
    if options["weight"] is not None:
        return opaque(f"cross-entropy with class weights at {describe_node(result)}")
    if not placeholders or not _from_placeholder(options["target"], placeholders[-1]):
        return opaque(f"the cross-entropy's target at {describe_node(result)} is computed, not the target "
                      "input reshaped")
    kind = "token_mean" if options["reduction"] == _MEAN else "token_sum"
    return LossReduction(kind=kind, ignore_index=int(options["ignore_index"]),
                         cross_entropy_ignore=int(options["ignore_index"]))


def logits_consumer(lm_head: Node) -> tuple[Node, Node | None]:
    """``(last, user)``: ``last`` the end of the views of the LM head's output, ``user`` the node past
    them (``aten.cross_entropy_loss``, the graph's output, or an op such as a soft cap), None when the
    chain forks."""
    node = lm_head
    while True:
        users = list(node.users)
        if len(users) != 1:
            return node, None
        user = users[0]
        if user.op == "output" or user.target not in _VIEWISH or user.args[0] is not node:
            return node, user
        node = user


def logits_loss(lm_head: Node) -> Node | None:
    """The cross-entropy that takes the LM head's logits through views only (made vocabulary-parallel
    under tp, ``passes/tensor_parallel.py``); None when other ops come first (the logits are gathered)."""
    last, user = logits_consumer(lm_head)
    ok = user is not None and user.target == aten.cross_entropy_loss.default and user.args[0] is last
    return user if ok else None
