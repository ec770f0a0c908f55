"""Normalise the exported graph: one name per tensor, and no export-time shape checks.

Tied weights (an LM head sharing the embedding's table) reach the graph under two
attribute names for one tensor.  Every later pass keys layouts and gradients by name, so
this pass points every ``get_attr`` at one canonical name per tensor and drops the aliases.

``torch.export`` leaves ``aten._assert_tensor_metadata`` nodes and a ``_guards_fn`` call
that check the *global* example's shapes, dtypes and guards.  After sharding, every rank
sees local shapes, so the checks would fire (or be meaningless).  This pass removes them
deliberately, first in the pipeline; the removal is logged.

A slice that keeps a whole dim (start 0, no end, step 1) is the identity.  Python indexing
skips it (``x[:, :, None]``), but ``torch.export`` records it as ``aten.slice``, and autograd
then gives it a backward that zero-fills a tensor of the input's size and copies the
gradient into it; Hugging Face models write such slices for every GQA broadcast and before
the LM head.  This pass replaces each with its input (the same values, still a tensor of the
same storage), so the program runs the ops eager PyTorch runs.  ``torch.concatenate`` and
``torch.concat`` become ``aten.cat``, the one name the rules place.

A ``torch.no_grad()`` region may hand back one of its own operands: ``x.to(x.dtype)`` inside it is
``x`` itself, and export then routes later uses of ``x`` through the region's result (a sparse
attention indexer's ``hidden_states``, read again by Dots3's per-head gate after it).  At run time
that result *is* the operand, gradient history included, though the graph says it came out of a
region without gradients; this pass points those uses back at the operand, so the graph says what
runs (and the passes see the activation they would split, not a region's result).

Neighbours: ``passes/compile.py`` runs it first; ``autopar/frontend/trace.py`` produced the graph.
"""
from __future__ import annotations

import operator
import sys

import torch
from torch.fx import GraphModule

from autopar.compat import ASSERT_METADATA_OPS, is_guards_call
from .context import PassContext, PassResult

__all__ = ["cleanup_pass"]

def _dedupe_tied(gm: GraphModule, result: PassResult) -> None:
    canonical: dict[int, str] = {}
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        canonical.setdefault(id(t), name)
    aliases: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, leaf = node.target.rpartition(".")
        value = getattr(gm.get_submodule(owner) if owner else gm, leaf)
        name = canonical.get(id(value))
        if name is not None and name != node.target:
            aliases[node.target] = name
            node.target = name
    for alias, name in aliases.items():
        owner, _, leaf = alias.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)
        result.notes.append(f"'{alias}' is tied to '{name}'")


def _is_identity_slice(node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return False
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    return start in (0, None) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1


def _drop_identity_slices(gm: GraphModule) -> int:
    dropped = 0
    for node in list(gm.graph.nodes):
        if _is_identity_slice(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


# Ops that return their input itself when nothing changes (same dtype, no copy asked for).
_SELF_RETURNING = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten.alias.default}


def _passed_through(item, body: GraphModule):
    """The placeholder of ``body`` that its output ``item`` is, through ops returning their input
    itself; None if it is anything else."""
    while item.op == "call_function" and item.target in _SELF_RETURNING and not item.kwargs.get("copy"):
        src = item.args[0]
        same = getattr(src.meta.get("val"), "dtype", None) == getattr(item.meta.get("val"), "dtype", 0)
        if not same or item.target is torch.ops.aten.to.dtype and len(item.args) > 2:
            return None
        item = src
    return item if item.op == "placeholder" else None


def _unalias_region_items(gm: GraphModule) -> int:
    rerouted = 0
    for region in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.wrap_with_set_grad_enabled):
        body = getattr(gm, region.args[1].target)
        (output,) = body.graph.find_nodes(op="output")
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        for user in list(region.users):
            if user.target is not operator.getitem:
                continue
            source = _passed_through(output.args[0][user.args[1]], body)
            operand = region.args[2 + placeholders.index(source)] if source is not None else None
            if isinstance(operand, torch.fx.Node):
                user.replace_all_uses_with(operand)
                rerouted += 1
    return rerouted


# Other names of ``aten.cat`` (``torch.concatenate``, ``torch.concat``): one op for the rules to place.
_CAT_ALIASES = (torch.ops.aten.concatenate.default, torch.ops.aten.concat.default)


def _canonical_cats(gm: GraphModule) -> int:
    renamed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _CAT_ALIASES:
            node.target = torch.ops.aten.cat.default
            renamed += 1
    return renamed


def _drop_checks(gm: GraphModule) -> int:
    dropped = 0
    for node in list(gm.graph.nodes):
        is_check = node.op == "call_function" and node.target in ASSERT_METADATA_OPS
        if (is_check or is_guards_call(node)) and not node.users:
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def cleanup_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("cleanup_pass")
    _dedupe_tied(gm, result)
    # The graph and the graphs of its regions (``torch.no_grad()`` traced as a higher-order op
    # that runs a GraphModule of its own): their checks see global shapes too.
    regions = [m for _, m in gm.named_modules() if isinstance(m, GraphModule) and m is not gm]
    rerouted = _unalias_region_items(gm)
    checks = slices = 0
    for g in [gm, *regions]:
        checks += _drop_checks(g)
        slices += _drop_identity_slices(g)
        rerouted += _canonical_cats(g)
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards_fn"):
            delattr(gm, name)
    for region in regions:
        region.graph.eliminate_dead_code()
        region.recompile()
    result.num_rewritten += checks + slices + rerouted
    gm.graph.eliminate_dead_code()
    result.notes.append(f"removed {checks} export-time shape/dtype checks and {slices} slices that keep a whole dim; "
                        f"{rerouted} uses of a no-grad region's result that is its operand read the operand")
    return result
