"""Gradient placements: the backward half of shard propagation, on one mesh axis.

A forward placement says what each rank holds of a value; it does not say what each rank
holds of the value's *gradient*.  For a replicated value there are two cases: the gradient is
**replicated** (every rank holds all of it) when everything between the value and the loss
runs replicated, and a **partial sum** (each rank holds its shards' contribution) when the
value feeds work done on shards.  Every collective's backward assumes one of them:

- ``region_entry`` (backward: all-reduce) and ``all_gather`` (backward: reduce-scatter) assume
  a partial gradient (a region entry after a reduction over a sharded dim whose gradient is
  replicated is removed: the reduced value fed replicated work only).  An all-gather whose result only feeds replicated computation (logits
  gathered for a loss that is not a plain cross-entropy) gets a replicated one: it becomes
  ``gather_replicated``, whose backward keeps this rank's slice.  A region entry with a
  replicated gradient is refused (its all-reduce would sum ``tp`` copies);
- a partial-sum value (a row-parallel output before its reduction) must get a replicated
  gradient: the all-reduce's backward is the identity;
- a value whose uses give it a replicated gradient along one path and a partial one along
  another has no placement (the two do not add up): refused, naming the node.

:func:`gradient_placements` walks the graph backwards from the output (the loss: every rank
of the axis computes the same value, so its gradient is replicated), using the forward
placements and, per node, the rule below; a replicated parameter whose gradient is partial is
summed over the axis after backward (``grad_partial_axes``, the DP pass's buckets).  The rule
per input of an op, from the op's output gradient ``g`` and its inputs' forward placements:
a ``Shard(d)`` input gets ``Shard(d)``; a ``Partial`` input gets ``g`` (which must be
replicated); a replicated input gets a replicated gradient when ``g`` is replicated and every
other input is replicated, and a partial one otherwise (it met sharded data).  Collectives
follow their backward.  Forward rules are the registry of ``passes/rules.py``; the caller is
``passes/shard_propagation.py``; the argument is docs/soundness.md.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import GraphModule, Node

from autopar.compat import rename_node
from autopar.frontend.op_sets import SHAPED_FILLS
from autopar.ops import collectives
from autopar.ops.whole_rows import local_blocks, local_runs
from .autograd_functions import AUTOGRAD_FUNCTION, function_gradients
from .context import META_KEY
from .rules import P, R, RuleContext, axis_of, tensor_inputs

__all__ = ["gradient_placements", "requires_grad_nodes", "GRAD_PLACEMENT_KEY"]

aten = torch.ops.aten

GRAD_PLACEMENT_KEY = "autopar_grad_placement"

# Ops whose floating-point output carries no gradient to their inputs.
_NO_GRAD = SHAPED_FILLS | {aten.detach.default, aten.sym_size.int}
# Ops on one mesh axis whose inputs' gradient placement is their backward's, not the general rule's.
_AXIS_OPS = {collectives.region_entry, collectives.all_gather, collectives.gather_replicated,
             collectives.reduce_scatter, collectives.local_shard, local_blocks, local_runs}
# Views through which ``copy_`` writes into a tensor (:func:`_written`).
_VIEWS = {aten.select.int, aten.slice.Tensor, aten.view.default, aten.unsqueeze.default, aten.squeeze.dim,
          aten.transpose.int, aten.permute.default, aten.diagonal.default, aten.narrow.default}


def _floating(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return val.is_floating_point()
    if isinstance(val, (tuple, list)):
        return any(_floating(v) for v in val)
    return False


def _written(gm: GraphModule) -> dict[Node, list[Node]]:
    """Tensors written in place: base -> the ``copy_`` nodes that write into it through views (a
    recurrence's output filled step by step: ``out = zeros_like(x); out[:, :, i] = ...``).  Later
    reads of the base carry what was written, which the graph's edges do not show."""
    writes: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.copy_.default:
            base = node.args[0]
            while isinstance(base, Node) and base.op == "call_function" and base.target in _VIEWS:
                base = base.args[0]
            writes.setdefault(base, []).append(node)
    return writes


def requires_grad_nodes(gm: GraphModule) -> set[Node]:
    """Nodes whose value depends differentiably on a trainable parameter (a tensor written in place
    with such a value too, and what reads it)."""
    trainable = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    writes = _written(gm)
    out: set[Node] = set()
    size = -1
    while size != len(out):  # a write marks its base, which nodes before the write read: once more
        size = len(out)
        for node in gm.graph.nodes:
            if node in out:
                continue
            if node.op == "get_attr":
                if node.target in trainable:
                    out.add(node)
            elif node.op == "call_function" and _floating(node.meta.get("val")) and (
                    (node.target not in _NO_GRAD and any(a in out for a in node.all_input_nodes))
                    or any(c in out for c in writes.get(node, ()))):
                out.add(node)
    return out


def _name(p: Any) -> str:
    return "replicated" if isinstance(p, Replicate) else "a partial sum" if isinstance(p, Partial) else str(p)


def _combine(node: Node, found: set, forward: Any, rc: RuleContext):
    """The gradient placement of ``node`` from the contributions of its uses."""
    if len(found) > 1:
        kinds = " and ".join(sorted(_name(p) for p in found))
        raise rc.fail(node, f"its gradient is {kinds} along different uses (forward placement {forward}), "
                            "so no placement holds its sum",
                      "A value used both by sharded work and by replicated work needs a collective between "
                      "them that autopar does not insert here; use a plan without this dimension, or report "
                      "the model.")
    (grad,) = found
    if isinstance(forward, Partial) and not isinstance(grad, Replicate):
        raise rc.fail(node, f"a partial sum whose gradient is {_name(grad)}: the all-reduce after it would "
                            "pass that gradient on unsummed",
                      "The reduction of a row-parallel output must feed replicated (or region-entered) work.")
    return grad


def _whole_parts(node: Node, forward, grads: dict, rc: RuleContext):
    """A split (or slice) of a fused projection some of whose blocks every rank keeps whole (a KV
    head under KV-head replication): each whole part must get a partial gradient, which the
    ``sum_whole_rows`` on the weight sums over the axis (a replicated one it would count ``tp``
    times).  Returns the gradient of the parts together (the sharded parts'), or None when
    ``node`` is no such split."""
    src = node.args[0] if node.op == "call_function" and node.args else None
    if not isinstance(src, Node) or not any(src.meta.get("autopar_whole") or ()):
        return None
    for i, grad in grads.items():
        if forward[i] == R and not isinstance(grad, Partial):
            raise rc.fail(node, f"part {i} of a fused projection is kept whole on every rank but its gradient "
                                f"is {_name(grad)}: summing it over {rc.axis} would count it {rc.size} times")
    return next((p for p in forward if isinstance(p, Shard)), None)


def _retarget(node: Node, target, reason: str) -> None:
    if node.target is not target:
        node.target = target
        if target is collectives.gather_replicated:  # its backward needs no input: nothing to re-gather
            node.kwargs = {}
        rename_node(node, target.__name__)
        meta = node.meta.get(META_KEY)
        if meta is not None:
            meta.reason = f"{meta.reason}; {reason}"


def _contributions(node: Node, grad: Any, pls: list, rc: RuleContext) -> list:
    """What the gradient ``grad`` of ``node``'s output gives each of its tensor inputs."""
    target = node.target
    on_axis = target in _AXIS_OPS and axis_of(node) == rc.axis
    if on_axis and target is collectives.region_entry:
        meta = node.meta.get(META_KEY)
        if not isinstance(grad, Partial) and meta is not None and meta.role == "reduction":
            # a reduction over a sharded dim whose result feeds replicated work only (an MoE
            # load-balancing loss over sequence shards): its gradient is already whole, so the
            # all-reduce's backward (the identity) passes it to every rank's part
            node.replace_all_uses_with(node.args[0])
            node.graph.erase_node(node)
            return [R]
        if not isinstance(grad, Partial):
            raise rc.fail(node, f"a tensor-parallel region entry whose result's gradient is {_name(grad)}: its "
                                "backward all-reduce would sum identical copies")
        return [R]
    if on_axis and target in (collectives.all_gather, collectives.gather_replicated):
        if isinstance(grad, Partial):
            _retarget(node, collectives.all_gather, "its result feeds sharded work: backward reduce-scatters")
        else:
            _retarget(node, collectives.gather_replicated,
                      "its result feeds replicated work: backward keeps this rank's slice of the gradient")
        return [pls[0]]
    if on_axis and target is collectives.reduce_scatter:
        return [R]
    if on_axis and target in (collectives.local_shard, local_blocks, local_runs):
        return [P]
    out = []
    for i, pl in enumerate(pls):
        if isinstance(pl, Shard):
            out.append(pl)
        elif isinstance(pl, Partial):
            out.append(grad)
        else:
            others = pls[:i] + pls[i + 1:]
            replicated = isinstance(grad, Replicate) and all(isinstance(p, Replicate) for p in others)
            out.append(R if replicated else P)
    return out


def gradient_placements(gm: GraphModule, rc: RuleContext, placements: dict[Node, Any],
                        place: Callable | None = None) -> dict[Node, Any]:
    """Gradient placement on ``rc.axis`` of every node that has a gradient (see the module doc).

    A tensor written in place (:func:`_written`) gives each ``copy_`` into it the gradient it gets
    from its later reads (their sharded placement on the written view, or the same partial or
    replicated kind), found by walking again until the writes' gradients no longer change.

    A custom autograd Function's inputs get what its own backward gives them, placed op by op
    with ``place`` (shard propagation's ``place_node``; ``passes/autograd_functions.py``).

    May retarget all-gathers (``all_gather`` <-> ``gather_replicated``) to the backward their
    gradient needs; raises for a value whose gradient has no placement."""
    needs, writes, seeds = requires_grad_nodes(gm), _written(gm), {}
    while True:
        grads = _walk(gm, rc, placements, needs, seeds, place)
        new = {c: placements.get(c, R) if isinstance(grads[base], Shard) else grads[base]
               for base, copies in writes.items() if base in grads for c in copies if c in needs}
        if new == seeds:
            return grads
        seeds = new


def _walk(gm: GraphModule, rc: RuleContext, placements: dict[Node, Any], needs: set, seeds: dict,
          place: Callable | None) -> dict:
    found: dict[Node, dict[Any, set]] = {c: {None: {pl}} for c, pl in seeds.items()}

    def give(node: Node, pl: Any, index: Any = None) -> None:
        if node in needs:
            found.setdefault(node, {}).setdefault(index, set()).add(pl)

    grads: dict[Node, Any] = {}
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "output":
            for a in tensor_inputs(node):
                give(a, R)  # every rank of the axis computes the same loss
            continue
        if node not in found:
            continue
        forward = placements.get(node, R)
        by_index = found[node]
        if isinstance(forward, (tuple, list)):
            per_output = {i: _combine(node, s, forward[i] if isinstance(i, int) else forward, rc)
                          for i, s in by_index.items()}
            if node.target is AUTOGRAD_FUNCTION:  # its outputs' gradients go to its backward one by one
                grads[node] = tuple(per_output.get(i, R) for i in range(len(forward)))
                inputs = tensor_inputs(node)
                for arg, pl in zip(inputs, function_gradients(node, per_output, [placements.get(a, R) for a in inputs],
                                                              rc, place)):
                    if pl is not None:
                        give(arg, pl)
                continue
            grad = _whole_parts(node, forward, per_output, rc) or _combine(node, set(per_output.values()), forward, rc)
        else:
            grad = _combine(node, set().union(*by_index.values()), forward, rc)
            _whole_parts(node, (forward,), {0: grad}, rc)
        grads[node] = grad
        node.meta.setdefault(GRAD_PLACEMENT_KEY, {})[rc.axis] = grad
        if node.op != "call_function" or node.target in _NO_GRAD:  # a fill written in place passes nothing on
            continue
        inputs = tensor_inputs(node)
        if node.target is operator.getitem and isinstance(placements.get(inputs[0]), (tuple, list)):
            give(inputs[0], grad, node.args[1])
            continue
        for arg, pl in zip(inputs, _contributions(node, grad, [placements.get(a, R) for a in inputs], rc)):
            give(arg, pl)
    return grads
