"""One pipelined step on the meta device (scale simulation): this rank's actions, without torch's schedule.

A full-size model on the meta device under a fake process group (``benchmarks/scale_simulation.py``)
has no values, and ``torch.distributed.pipelining`` needs some: its P2P warm-up reads a vote
with ``.item()``, and the fake group delivers no shapes to the stages that would infer them.
So on meta :class:`autopar.runtime.stepping.pipelined.PipelineExecutor` runs :func:`simulate_step`
instead: it walks this rank's action list (:func:`autopar.ops.schedules.rank_orders`, the same
data torch's order is asserted equal to at setup), runs each forward and backward of its
chunks on meta tensors, and records every P2P buffer a stage would post -- the activations in
and out of a forward, the gradients in and out of a backward, and nothing between two chunks
of the same rank -- exactly as the recording stage does on a real group.  The boundary
activations come in as meta tensors shaped by the chunk's placeholders (their symbolic batch
and sequence sizes evaluated at this micro-batch), since the chunk that produces them lives
on another rank; they and the gradients received in backward are receive buffers held from the
step's start to the next step, as torch's stages hold theirs (:func:`receive_buffers`), so that what
the step holds is what a GPU rank holds (torch's ``MemTracker`` around ``train_step`` measures
it).  Collectives inside the chunks record themselves as they run.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch

from autopar.compat import sym_expr
from autopar.ops import collectives
from autopar.ops.schedules import rank_orders
from autopar.runtime.stepping.executors import MicrobatchScope

__all__ = ["simulate_step", "receive_buffers"]


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


def _boundary_inputs(chunk, spec, sizes: dict, axis_sizes: dict[str, int], device,
                     requires_grad: bool = True) -> list[torch.Tensor]:
    """Meta tensors standing for the activations chunk ``spec`` receives (its first placeholders)."""
    holders = [n for n in chunk.graph.nodes if n.op == "placeholder"][:spec.num_act_inputs]
    return [torch.empty(_shape(n, sizes, axis_sizes), dtype=n.meta["val"].dtype, device=device,
                        requires_grad=requires_grad) for n in holders]


def receive_buffers(pipeline, env, pieces: list, me: int) -> dict[tuple[int, int, str], list[torch.Tensor]]:
    """Every receive buffer torch's stages of pp rank ``me`` hold: per micro-batch, the activations
    of each chunk whose previous chunk is on another rank (``"fwd"``) and the gradients of the
    outputs of each chunk whose next chunk is (``"bwd"``: shaped as that chunk's inputs)."""
    axis_sizes = {a: g.size for a, g in env.groups.items()}
    last = len(pipeline.chunks) - 1
    out = {}
    for c in pipeline.rank_chunks(me):
        for microbatch_index, (mb_inputs, _) in enumerate(pieces):
            sizes = _sizes(env, mb_inputs)
            if c > 0 and pipeline.chunk_rank(c - 1) != me:
                chunk = pipeline.chunks[c]
                out[(c, microbatch_index, "fwd")] = _boundary_inputs(chunk.gm, chunk, sizes, axis_sizes, env.device)
            if c < last and pipeline.chunk_rank(c + 1) != me:
                chunk = pipeline.chunks[c + 1]
                out[(c, microbatch_index, "bwd")] = _boundary_inputs(chunk.gm, chunk, sizes, axis_sizes, env.device,
                                                                     requires_grad=False)
    return out


def simulate_step(executor, env, inputs: tuple, target: Any, coords: dict[str, int]):
    """Forward and backward of every micro-batch of this rank's chunks, in schedule order;
    returns the last chunk's losses (meta tensors) or an empty list.

    What it holds is what torch's ``PipelineStage`` holds: a receive buffer per micro-batch for
    each remote input (activations in forward, the outputs' gradients in backward), which torch
    makes at the first step and keeps; here they are made at the start of each step, the previous
    step's dropped first (``executor.recv_buffers``, :func:`receive_buffers`), so that a meter
    entered around the step sees them from its start.  Each forward's inputs and outputs are
    kept until its backward (the stage's ``fwd_cache``), a chunk's input gradient until it is
    sent (its receiving buffer's ``.grad``, dropped as torch's ``stage_backward`` does).  Between
    two chunks of one rank the output itself is the next chunk's input (detached) and the input
    gradient the previous chunk's output gradient, with no buffer, as torch hands them over."""
    pipeline, plan = executor.pipeline, executor.plan
    me = coords.get("pp", 0)
    pieces = env.microbatches(inputs, target, coords)
    executor.recv_buffers = None
    step = _SimulatedStep(executor, env, pieces, me, receive_buffers(pipeline, env, pieces, me))
    executor.recv_buffers = step.buffers
    for slot in rank_orders(plan.schedule, plan.pp, plan.mb, plan.vpp)[me]:
        for act in slot:
            if act.kind == "F":
                step.forward(act.stage_index, act.microbatch_index)
            elif act.kind == "B":
                step.backward(act.stage_index, act.microbatch_index)
            # "W" (the weight half of a split backward): computed with its "B" here; no transfer.
    return step.losses


class _SimulatedStep:
    """What one simulated step holds between its actions (see :func:`simulate_step`)."""

    def __init__(self, executor, env, pieces: list, me: int, buffers: dict):
        self.executor, self.env, self.pieces, self.me, self.buffers = executor, env, pieces, me, buffers
        self.pipeline = executor.pipeline
        self.last = len(self.pipeline.chunks) - 1
        self.saved: dict[tuple[int, int], tuple] = {}   # (chunk, micro-batch) -> (inputs, outputs, scope)
        self.handed: dict[tuple[int, int], list] = {}   # output gradients from this rank's next chunk
        self.losses: list = []

    def _remote(self, stage_index: int, step: int) -> bool:
        """Whether the chunk ``step`` away (-1: previous, +1: next) exists and runs on another rank."""
        other = stage_index + step
        return 0 <= other <= self.last and self.pipeline.chunk_rank(other) != self.me

    def forward(self, stage_index: int, microbatch_index: int) -> None:
        mb_inputs, mb_target = self.pieces[microbatch_index]
        if self._remote(stage_index, -1):
            boundary = self.buffers[(stage_index, microbatch_index, "fwd")]
            for t in boundary:
                collectives.record_p2p("recv", "pp", t, "fwd", f"stage {stage_index} activation recv")
        elif stage_index > 0:  # the previous chunk is this rank's: its outputs, detached
            boundary = [t.detach().requires_grad_(t.requires_grad) for t in self.saved[(stage_index - 1, microbatch_index)][1]]
        else:
            boundary = []
        kwargs = dict(zip(self.pipeline.kwarg_names, list(mb_inputs) + [mb_target]))
        scope = MicrobatchScope(self.executor._chunks[stage_index])  # kept until its backward (executors.py)
        out = scope(*boundary, **kwargs)
        last = stage_index == self.last
        outs = [out] if last else list(out if isinstance(out, (tuple, list)) else (out,))
        for t in outs if self._remote(stage_index, 1) else ():
            collectives.record_p2p("send", "pp", t, "fwd", f"stage {stage_index} activation send")
        if last:
            self.losses.append(out.detach())
        self.saved[(stage_index, microbatch_index)] = (boundary, outs, scope)

    def backward(self, stage_index: int, microbatch_index: int) -> None:
        boundary, outs, scope = self.saved.pop((stage_index, microbatch_index))
        if stage_index == self.last:
            grads = [torch.ones_like(t) for t in outs]
        elif self._remote(stage_index, 1):
            grads = self.buffers[(stage_index, microbatch_index, "bwd")]
            for g in grads:
                collectives.record_p2p("recv", "pp", g, "bwd", f"stage {stage_index} input grad recv")
        else:
            grads = self.handed.pop((stage_index, microbatch_index))
        torch.autograd.backward([t for t in outs if t.requires_grad],
                                [g for t, g in zip(outs, grads) if t.requires_grad])
        del outs, grads
        self.env.grad_sync.after_backward(stage_index, "full")  # weights included ("W" is not separate)
        input_grads = [t.grad for t in boundary]
        for t in boundary:
            t.grad = None
        if self._remote(stage_index, -1):
            for g in input_grads:
                collectives.record_p2p("send", "pp", g, "bwd", f"stage {stage_index} input grad send")
        elif stage_index > 0:
            self.handed[(stage_index - 1, microbatch_index)] = input_grads
        del boundary, input_grads, scope


def _sizes(env, mb_inputs) -> dict:
    """The graph's symbolic batch and sequence sizes at this micro-batch (from its token ids)."""
    ids = mb_inputs[0]
    batch_symbol, seq_symbol = env.size_symbols
    sizes = {batch_symbol: ids.shape[0]} if batch_symbol is not None else {}
    if ids.dim() > 1 and seq_symbol is not None:
        sizes[seq_symbol] = ids.shape[1]
    return sizes
