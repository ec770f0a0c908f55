"""One pipelined step on the meta device (scale simulation): this rank's actions, without torch's schedule.

A full-size model on the meta device under a fake process group (``benchmarks/scale_simulation.py``)
has no values, and ``torch.distributed.pipelining`` needs some: its P2P warm-up reads a vote
with ``.item()``, and the fake group delivers no shapes to the stages that would infer them.
So on meta :class:`autopar.runtime.pipelined.PipelineExecutor` runs :func:`simulate_step`
instead: it walks this rank's action list (:func:`autopar.ops.schedules.rank_orders`, the same
data torch's order is asserted equal to at setup), runs each forward and backward of its
chunks on meta tensors, and records every P2P buffer a stage would post -- the activations in
and out of a forward, the gradients in and out of a backward, and nothing between two chunks
of the same rank -- exactly as the recording stage does on a real group.  The boundary
activations come in as meta tensors shaped by the chunk's placeholders (their symbolic batch
and sequence sizes evaluated at this micro-batch), since the chunk that produces them lives
on another rank.  Collectives inside the chunks record themselves as they run.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from autopar.compat import sym_expr
from autopar.ops import collectives
from autopar.ops.schedules import rank_orders

__all__ = ["simulate_step"]


def _shape(node: torch.fx.Node, sizes: dict, axis_sizes: dict[str, int]) -> list[int]:
    """The local shape of ``node``'s value: its traced shape at these sizes, each dim that shard
    propagation placed ``Shard(d)`` on a mesh axis divided by the axis size (SP's sequence shards)."""
    out = []
    for d in node.meta["val"].shape:
        expr = sym_expr(d)
        out.append(int(d) if expr is None else int(sympy.sympify(expr).subs(sizes)))
    for axis, placement in (node.meta.get("autopar_placement") or {}).items():
        if placement.is_shard():
            out[placement.dim] //= axis_sizes.get(axis, 1)
    return out


def _boundary_inputs(chunk, spec, sizes: dict, axis_sizes: dict[str, int], device) -> list[torch.Tensor]:
    """Meta tensors standing for the activations chunk ``spec`` receives (its first placeholders)."""
    holders = [n for n in chunk.graph.nodes if n.op == "placeholder"][:spec.num_act_inputs]
    return [torch.empty(_shape(n, sizes, axis_sizes), dtype=n.meta["val"].dtype, device=device,
                        requires_grad=True) for n in holders]


def simulate_step(executor, pm, inputs: tuple, target: Any, coords: dict[str, int]):
    """Forward and backward of every micro-batch of this rank's chunks, in schedule order;
    returns the last stage's losses (meta tensors) or an empty list."""
    pipeline, plan = executor.pipeline, executor.plan
    me = coords.get("pp", 0)
    last = len(pipeline.chunks) - 1
    pieces = pm.microbatches(inputs, target, coords)
    saved: dict[tuple[int, int], tuple[list, Any]] = {}
    losses = []
    for slot in rank_orders(plan.schedule, plan.pp, plan.mb, plan.vpp)[me]:
        for act in slot:
            stage_index = act.stage_index
            spec, chunk = pipeline.chunks[stage_index], executor._chunks[stage_index]
            remote_prev = stage_index > 0 and pipeline.chunk_rank(stage_index - 1) != me
            remote_next = stage_index < last and pipeline.chunk_rank(stage_index + 1) != me
            if act.kind == "F":
                mb_inputs, mb_target = pieces[act.microbatch_index]
                ids = mb_inputs[0]
                batch_symbol, seq_symbol = pm.size_symbols
                sizes = {batch_symbol: ids.shape[0]} if batch_symbol is not None else {}
                if ids.dim() > 1 and seq_symbol is not None:
                    sizes[seq_symbol] = ids.shape[1]
                boundary = _boundary_inputs(chunk, spec, sizes, {a: g.size for a, g in pm.groups.items()}, pm.device)
                for t in boundary if remote_prev else ():
                    collectives.record_p2p("recv", "pp", t, "fwd", f"stage {stage_index} activation recv")
                kwargs = dict(zip(pipeline.kwarg_names, list(mb_inputs) + [mb_target]))
                out = chunk(*boundary, **kwargs)
                outs = [out] if stage_index == last else list(out if isinstance(out, (tuple, list)) else (out,))
                for t in outs if remote_next else ():
                    collectives.record_p2p("send", "pp", t, "fwd", f"stage {stage_index} activation send")
                if stage_index == last:
                    losses.append(out)
                saved[(stage_index, act.microbatch_index)] = (boundary, outs)
            elif act.kind == "B":
                boundary, outs = saved.pop((stage_index, act.microbatch_index))
                grads = [torch.ones_like(t) if stage_index == last else torch.empty_like(t) for t in outs]
                for g in grads if remote_next else ():
                    collectives.record_p2p("recv", "pp", g, "bwd", f"stage {stage_index} input grad recv")
                torch.autograd.backward([t for t in outs if t.requires_grad],
                                        [g for t, g in zip(outs, grads) if t.requires_grad])
                pm.grad_sync.after_backward(stage_index, "full")  # weights included (see "W" below)
                for t in boundary if remote_prev else ():
                    collectives.record_p2p("send", "pp", torch.empty_like(t), "bwd",
                                           f"stage {stage_index} input grad send")
            # "W" (the weight half of a split backward): computed with its "B" here; no transfer.
    return losses
