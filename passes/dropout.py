"""Dropout streams: every dropout draws from the generator its placement calls for.

``torch.export`` leaves dropout in the training graph as ``aten.dropout(x, p, True)``
(``nn.Dropout``, ``F.dropout``), ``aten.feature_dropout`` (``Dropout1d/2d/3d``),
``aten.alpha_dropout`` / ``aten.feature_alpha_dropout``, and as ``dropout_p`` of
``aten.scaled_dot_product_attention``.  Run as they are, every rank would draw the same
masks from the same default generator: dp ranks holding different rows, and tp ranks
holding different shards.  This pass, after shard propagation (and context parallelism,
which rewrites attention first), turns each one with ``p > 0`` in train mode into
:func:`autopar.ops.rng.dropout` or :func:`autopar.ops.rng.attention` with its stream:

* ``"tp"`` when the values the mask covers are sharded over tp (``Shard`` on a dimension
  the mask spans: heads, hidden features, sequence shards under SP; for feature dropout
  only the batch and channel dims count), so each tp rank draws its own mask;
* ``"replicated"`` otherwise, so the tp ranks draw the same mask and the replicas agree.

The placements are shard propagation's (``node.meta["autopar_placement"]``), decided for
every node, not by pattern.  Data-parallel ranks (dp, cp) always draw different masks:
that is in the seeds (:mod:`autopar.ops.rng`).  Dropout inside a MoE expert body (a
graph of its own, run on the routed tokens of this rank's sequence shard) reads the
``"tp"`` stream under tp.  A graph without such dropout is left unchanged, and
:func:`has_dropout` tells the runner whether to run the pass at all.

Neighbours: ``passes/shard_propagation.py`` (placements), ``passes/runner.py`` (order).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError, describe_node
from autopar.frontend.op_sets import SDPA, sdpa_args
from autopar.ops import rng
from .context import COPIED_META, PLACEMENT_KEY, PassContext, PassResult, provenance

aten = torch.ops.aten

__all__ = ["dropout_pass", "has_dropout", "DROPOUT_OPS"]

_PASS = "dropout_pass"
DROPOUT_OPS = {getattr(aten, kind).default: kind for kind in rng.KINDS}


def _bound(node: Node) -> dict:
    if node.target is SDPA:
        return sdpa_args(node)
    return {**dict(zip(("input", "p", "train"), node.args)), **node.kwargs}


def _drops(node: Node) -> bool:
    """Whether ``node`` is a dropout that draws a mask (p > 0, train mode)."""
    if node.op != "call_function":
        return False
    if node.target in DROPOUT_OPS:
        bound = _bound(node)
        return bool(bound.get("train", True)) and float(bound.get("p", 0.5)) > 0
    if node.target is SDPA:
        return float(_bound(node).get("dropout_p", 0.0) or 0.0) > 0
    return False


def _graphs(gm: GraphModule) -> list[tuple[GraphModule, bool]]:
    """``gm`` and the graphs nested in it (MoE expert bodies), with whether each is nested."""
    return [(gm, False)] + [(m, True) for _, m in gm.named_modules() if isinstance(m, GraphModule) and m is not gm]


def has_dropout(gm: GraphModule) -> bool:
    """Whether any graph of ``gm`` has a dropout that draws a mask."""
    return any(_drops(n) for g, _ in _graphs(gm) for n in g.graph.nodes)


def _stream(node: Node, ctx: PassContext, nested: bool) -> tuple[str, str]:
    """(stream, reason) for dropout ``node`` from its placement on each tracked axis."""
    if nested:
        if "tp" in ctx.sharded_axes:
            return rng.TP, "in a MoE expert body: this rank's routed tokens of its sequence shard differ per tp rank"
        return rng.REPLICATED, "in a MoE expert body, no tp"
    placements = node.meta.get(PLACEMENT_KEY) or {}
    mask_dims = None
    if node.target in DROPOUT_OPS and DROPOUT_OPS[node.target].startswith("feature"):
        mask_dims = (0, 1)  # one draw per (batch, channel)
    for axis, pl in placements.items():
        if isinstance(pl, (tuple, list)):
            raise AutoparError(f"autopar: dropout {describe_node(node)} has a multi-output placement {pl} on "
                               f"'{axis}'; this is an autopar bug, please report it with the model.")
        if not isinstance(pl, Shard) or (mask_dims is not None and pl.dim not in mask_dims):
            continue
        if axis != "tp":
            raise AutoparError(f"autopar: dropout {describe_node(node)} sees values sharded over '{axis}'; only "
                               "tp-sharded dropout streams exist. Please report it with the plan.")
        return rng.TP, f"values placed {pl} on tp: each tp rank draws its own mask"
    return rng.REPLICATED, "values replicated over tp: every tp rank draws the same mask"


def _rewrite(graph: torch.fx.Graph, node: Node, stream: str, reason: str) -> Node:
    bound = _bound(node)
    with graph.inserting_before(node):
        if node.target is SDPA:
            kwargs = {"scale": bound.get("scale"), "stream": stream}
            if bound.get("enable_gqa"):
                kwargs["enable_gqa"] = True
            args = tuple(bound.get(k, d) for k, d in (("query", None), ("key", None), ("value", None),
                                                      ("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False)))
            new = graph.call_function(rng.attention, args, kwargs)
            what = f"attention dropout p={bound['dropout_p']}"
        else:
            kind = DROPOUT_OPS[node.target]
            new = graph.call_function(rng.dropout, (bound["input"], float(bound.get("p", 0.5)), True, stream),
                                      {"kind": kind} if kind != "dropout" else {})
            what = f"{kind} p={bound.get('p', 0.5)}"
    for key in COPIED_META:
        if key in node.meta:
            new.meta[key] = node.meta[key]
    provenance(new, _PASS, "tp" if stream == rng.TP else None, f"{what} from the '{stream}' stream: {reason}")
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def dropout_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult(_PASS)
    counts = {rng.REPLICATED: 0, rng.TP: 0}
    for graph_module, nested in _graphs(gm):
        changed = False
        for node in list(graph_module.graph.nodes):
            if not _drops(node):
                continue
            stream, reason = _stream(node, ctx, nested)
            _rewrite(graph_module.graph, node, stream, reason)
            counts[stream] += 1
            result.num_rewritten += 1
            changed = True
        if changed and nested:
            graph_module.graph.lint()
            graph_module.recompile()
    result.notes.append(f"{result.num_rewritten} dropouts: {counts[rng.REPLICATED]} on the replicated stream, "
                        f"{counts[rng.TP]} on the tp stream")
    return result
