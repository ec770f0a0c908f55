"""Readable listing of a generated per-rank program, with every collective marked.

Used by ``ParallelModule.code()`` and ``autopar inspect``.  Each line is one graph node
written as Python; collectives carry a trailing comment with the op, mesh axis, local
shape and predicted bytes (forward and backward, the byte convention of docs/architecture.md), and the listing
ends with the gradient-sync buckets and a summary per collective kind.
"""
from __future__ import annotations

import collections
import re

import sympy
import torch
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr
from autopar.ops import collectives
from autopar.ops.recompute import Recompute
from autopar.frontend.analyze import module_path
from autopar.passes.context import META_KEY, PLACEMENT_KEY

__all__ = ["format_program", "collective_summary"]

_NAMES = {
    collectives.all_gather: "all_gather",
    collectives.reduce_scatter: "reduce_scatter",
    collectives.all_reduce: "all_reduce",
    collectives.region_entry: "region_entry",
    collectives.vocab_parallel_embedding: "vocab_parallel_embedding",
    collectives.vocab_parallel_cross_entropy: "vocab_parallel_cross_entropy",
}


def _target(node: Node) -> str:
    if node.target in _NAMES:
        return _NAMES[node.target]
    name = str(node.target)
    return name.replace("aten.", "aten.").replace(".default", "") if name.startswith("aten.") else getattr(
        node.target, "__name__", name)


def _arg(a) -> str:
    if isinstance(a, Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _local_shape(node: Node, ctx) -> str:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ""
    sizes = [sym_expr(s) if isinstance(s, torch.SymInt) else sympy.Integer(int(s)) for s in val.shape]
    for axis, pl in (node.meta.get(PLACEMENT_KEY) or {}).items():
        if hasattr(pl, "dim") and not isinstance(pl, (tuple, list)):
            sizes[pl.dim] = sizes[pl.dim] / ctx.axis_sizes[axis]
    return "[" + ", ".join(str(s) for s in sizes) + "]"


def _fmt_bytes(expr) -> str:
    expr = sympy.simplify(expr)
    return str(int(expr)) if expr.is_number else str(expr)


def _layer_of(node: Node, layers: list[str]) -> str | None:
    path = module_path(node)
    return next((layer for layer in layers if path == layer or path.startswith(layer + ".")), None)


def _recomputed(gm: GraphModule, node: Node) -> Recompute | None:
    """The :class:`Recompute` region ``node`` calls, if it calls one (``passes/recompute.py``)."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(node.target)
    return module if isinstance(module, Recompute) else None


def _program_nodes(gm: GraphModule):
    """(node, recomputed) for every node of the program, the bodies of recomputed regions included."""
    for node in gm.graph.nodes:
        region = _recomputed(gm, node)
        if region is None:
            yield node, False
        else:
            yield from ((n, True) for n in region.body.graph.nodes if n.op == "call_function")


def collective_summary(gm: GraphModule, ctx) -> list[str]:
    """One line per (collective, axis, phase): the count, per decoder layer and outside layers;
    the forward collectives of recomputed regions count again as ``recomputed`` (in backward)."""
    layers = ctx.structure.layers
    counts: dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
    for node, recomputed in _program_nodes(gm):
        meta = node.meta.get(META_KEY)
        for phase, (op, _) in ((meta.bytes if meta else None) or {}).items():
            calls = (meta.calls or {}).get(phase, 1)  # nodes that issue several (CP ring, Ulysses)
            calls = calls if op != "all_reduce" or node.target is not collectives.vocab_parallel_cross_entropy else 3
            where = "layer" if _layer_of(node, layers) else "other"
            counts[(op, meta.axis, phase)][where] += calls
            if recomputed and phase == "fwd":
                counts[(op, meta.axis, "bwd, recomputed")][where] += calls
    lines = []
    for (op, axis, phase), c in sorted(counts.items()):
        per_layer = c["layer"] / max(1, len(layers))
        lines.append(f"{op} on {axis} ({phase}): {c['layer'] + c['other']} in total, "
                     f"{per_layer:g} per decoder layer x {len(layers)} layers + {c['other']} outside the layers")
    for bucket in ctx.grad_buckets:
        lines.append(f"all_reduce on {bucket.axis} (grad): 1 bucket of {bucket.num_bytes} bytes "
                     f"({len(bucket.params)} gradients, {'average' if bucket.average else 'sum'})")
    return lines


def _node_line(node: Node, ctx, indent: str) -> str:
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    line = f"{indent}{node.name} = {_target(node)}({args})"
    meta = node.meta.get(META_KEY)
    if meta and meta.bytes:
        src = node.args[0]
        parts = [f"{phase} {op} sends {_fmt_bytes(b)} B" for phase, (op, b) in meta.bytes.items()]
        line += f"  # <<{meta.axis}>> {_local_shape(src, ctx)} {src.meta['val'].dtype}: " + "; ".join(parts)
    return line


def _region_lines(node: Node, region: Recompute, ctx) -> list[str]:
    """A recomputed region's call and its body, which backward runs again (forward collectives too)."""
    args = ", ".join(_arg(a) for a in node.args)
    meta = node.meta.get(META_KEY)
    lines = [f"    {node.name} = checkpoint(self.{node.target}, {args})  # {meta.reason if meta else 'recomputed'}"]
    for n in region.body.graph.nodes:
        if n.op == "call_function":
            lines.append(_node_line(n, ctx, "    #   | "))
        elif n.op == "output":
            lines.append(f"    #   | return {_arg(n.args[0])}")
    return lines


def format_program(gm: GraphModule, ctx, rank_coords: dict | None = None) -> str:
    plan = ctx.plan
    out = [f"# autopar program for plan '{plan}' (world {plan.world_size}; mesh pp x dp x cp x tp = "
           f"{' x '.join(str(ctx.axis_sizes[a]) for a in ('pp', 'dp', 'cp', 'tp'))})"]
    if rank_coords:
        out.append("# this rank: " + ", ".join(f"{a}={r}" for a, r in rank_coords.items()))
    out.append(f"# symbols: {ctx.batch_symbol} = this rank's micro-batch, {ctx.seq_symbol} = sequence length")
    out.append("# parameters (local shape, layout):")
    for name, p in gm.named_parameters():
        shards = ctx.param_shards.get(name, {})
        shape = list(p.shape)
        for axis, s in shards.items():
            if s.owner is None:
                shape[s.dim] //= ctx.axis_sizes[axis]
        layout = ", ".join(f"whole on {a} rank {s.owner} (empty elsewhere)" if s.owner is not None else
                           f"Shard({s.dim}{', blocks=' + str(list(s.blocks)) if s.blocks else ''}) on {a}"
                           for a, s in shards.items()) or "replicated"
        partial = ctx.grad_partial_axes.get(name)
        extra = f"; gradient summed over {sorted(partial)}" if partial else ""
        if name in ctx.expert_params:
            extra = "; expert: gradient averaged over the ranks holding it (edp)"
        out.append(f"#   {name}: {shape} {layout}{extra}")
    inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    out.append(f"def forward({', '.join(inputs)}):")
    for node in gm.graph.nodes:
        if node.op in ("placeholder",):
            continue
        if node.op == "get_attr":
            out.append(f"    {node.name} = self.{node.target}")
            continue
        if node.op == "output":
            out.append(f"    return {_arg(node.args[0])}")
            continue
        region = _recomputed(gm, node)
        if region is not None:
            out += _region_lines(node, region, ctx)
            continue
        out.append(_node_line(node, ctx, "    "))
    for name, holder in gm.named_children():
        if name.startswith("moe_experts_") and len(holder):
            out.append(f"# {name}[e]: expert e of the MoE block, cut from the traced graph "
                       f"({len(holder)} bodies; this rank runs its own experts' on their routed rows); [0]:")
            out += ["#   " + line for line in holder[0].code.strip().splitlines() if line.strip()]
        elif name.startswith("dense_experts_"):
            out.append(f"# {name}: this rank's experts of a dense MoE block, cut from the traced graph with "
                       "their count made local, summed over the ep group's tokens:")
            out += ["#   " + line for line in holder.code.strip().splitlines() if line.strip()]
    out.append("# after backward (gradient synchronisation):")
    for bucket in ctx.grad_buckets:
        out.append(f"#   all_reduce over {bucket.axis}: {bucket.num_bytes} bytes, "
                   f"{'average' if bucket.average else 'sum'} of {', '.join(bucket.params)}")
    out.append("# collectives:")
    out += ["#   " + line for line in collective_summary(gm, ctx)]
    return "\n".join(re.sub(r"\s+$", "", line) for line in out)
