"""Run a pipelined program: the chunks of ``passes/pipeline.py`` under ``torch.distributed.pipelining``.

:class:`PipelineExecutor` is the executor of :class:`autopar.runtime.module.ParallelModule`
for a plan with ``pp > 1``.  Each rank keeps the parameters of its own chunks only (chunk
``c`` lives on pp rank ``program.pipeline.chunk_rank(c)``: looped for gpipe / 1f1b /
interleaved, V-shaped for zbv / dualpipev), wraps each chunk in a recording stage (a
``PipelineStage`` that records the bytes of every P2P send and receive it posts,
:func:`autopar.compat.recording_stage_class`) and drives them with the plan's schedule
(:data:`autopar.ops.schedules.SCHEDULE_CLASSES`).

The loss: the last chunk computes it in-graph from the ``target`` keyword micro-batch
(every stage receives the model inputs and the target as keyword micro-batches, see the
pass), so the schedule's ``loss_fn`` only weights it by the micro-batch's share of the valid
targets (``LossSplit.weight``, 1.0 for an unpadded batch) and ``scale_grads``
divides the gradients by the micro-batch count (the mean over micro-batches).  The module reduces the
last chunk's mean over the data axes and then over ``pp`` (other stages contribute 0).

Mixed precision and ZeRO-2/3: each stage tells the gradient-sync strategy after every
backward action (``after_backward``), which folds bf16 gradients into fp32 main gradients,
reduce-scatters the chunk's ZeRO-2 units or drops ZeRO-3's re-gathered units, so the
schedule's own ``scale_grads`` (on ``param.grad``) is off and :meth:`run` divides the held
gradients by the micro-batch count instead.  ZeRO-3's gathers run inside
``grad_sync.pipeline_step()``, around the whole schedule step.

``compile=``: each stage runs its chunk's Inductor program (:mod:`autopar.runtime.stepping.inductor`
says what is compiled and how the split backward of zbv / dualpipev goes through it); the chunk
itself stays what ``describe_stage`` and the meta-device simulation use.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist

from autopar.compat import pipeline_order, recording_stage_class, retained_compiled_backward
from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.ops.regather import keeping_shards, regathers
from autopar.ops.schedules import SCHEDULE_CLASSES, actions, rank_orders, single_stage
from autopar.plan_space import V_SCHEDULES
from autopar.runtime.stepping.executors import StepOutput, weighted_loss
from autopar.runtime.stepping.inductor import torch_compiled_program
from autopar.runtime.stepping.simulated import simulate_step

__all__ = ["PipelineExecutor"]


def _stage_loss(env, output, target):
    """The last chunk's in-graph loss of one micro-batch, weighted by its share of the valid targets."""
    return weighted_loss(output, env.loss_weight(target))


def _record_p2p(ops, phase: str, stage_index: int) -> None:
    """Record every P2P buffer a stage posts (the byte convention: P2P moves the buffer)."""
    what = "activation" if phase == "fwd" else "input grad"
    for op in ops:
        kind = "send" if op.op in (dist.isend, dist.send) else "recv"
        collectives.record_p2p(kind, "pp", op.tensor, phase, f"stage {stage_index} {what} {kind}")


_RecordingStage = recording_stage_class(_record_p2p)


class PipelineExecutor:
    """This rank's chunks of a pipelined program and the schedule that runs them."""

    def __init__(self, gm: torch.fx.GraphModule, program, plan, torch_compile_options: dict | None = None):
        self.gm, self.plan = gm, plan
        self._torch_compile_options = torch_compile_options  # compile=: each chunk's program compiled
        self.pipeline = program.pipeline
        owner = self.pipeline.param_chunk()
        self._owner = {p: self.pipeline.chunk_rank(c) for p, c in owner.items()}
        self._chunks: dict[int, torch.fx.GraphModule] = {}
        # The scale simulation's receive buffers, held from a step's start to the next step as torch's
        # stages hold theirs ((chunk, micro-batch, "fwd" | "bwd") -> tensors; runtime/stepping/simulated.py).
        self.recv_buffers: dict[tuple[int, int, str], list[torch.Tensor]] | None = None
        self._schedule = None
        self._fold = False
        self._tied_copy: tuple[torch.nn.Parameter, torch.nn.Parameter] | None = None  # (embedding, head's)

    def owner(self, name: str) -> int | None:
        """The pp rank owning parameter ``name`` (its chunk's); None for a buffer every rank keeps."""
        return self._owner.get(name)

    def holders(self, name: str) -> tuple[int, ...] | None:
        """The pp ranks holding ``name`` (the tied weight: two); None for a buffer every rank keeps."""
        return self.pipeline.param_pp_ranks(name) if name in self._owner else None

    def setup(self, env) -> None:
        """Rebuild this rank's chunks on the local parameters and the schedule over them."""
        pp_rank = env.coords().get("pp", (0, 1))[0]
        chunk_ids = self.pipeline.rank_chunks(pp_rank)
        self._chunks = {c: torch.fx.GraphModule(self.gm, self.pipeline.chunks[c].gm.graph) for c in chunk_ids}
        self._regathers = any(regathers(chunk) for chunk in self._chunks.values())
        last = len(self.pipeline.chunks) - 1
        self._last = self.pipeline.chunk_rank(last) == pp_rank
        tied = self.pipeline.tied
        if tied and self._last and 0 in chunk_ids and env.holds(tied):
            # A V-shaped schedule places the embedding and the tied head on this rank. torch's split
            # weight backward cannot share one parameter between two stages, so the head's chunk gets
            # its own Parameter on the same storage (updates and loads reach it in place) whose
            # gradient is folded into the embedding's after every backward action.
            self._tied_copy = (self.gm.get_parameter(tied), _alias_parameter(self._chunks, last, tied, self.gm))
        for c in chunk_ids:
            # ZeRO-3: the chunk reads its units' flat shards through the gather; as the chunk's own
            # parameters they are what torch's split weight backward (zbv, dualpipev) differentiates.
            for i, shard in enumerate(env.grad_sync.chunk_shards(c)):
                self._chunks[c].register_parameter(f"zero_shard_{i}", shard)
        if not dist.is_initialized():
            return
        pp_group = env.groups["pp"].group
        stages = [_RecordingStage(self._stage_module(c), c, len(self.pipeline.chunks), env.device, group=pp_group)
                  for c in chunk_ids]
        # Mixed precision (fp32 main gradients), a tied copy, ZeRO-1 (reduce-scatters started
        # after a chunk's last backward) and ZeRO-2/3 (gradients in the flat shards) move
        # gradients after each backward action; torch's scale_grads (on the stage parameters'
        # .grad) then comes too early or misses them, so run() scales them itself.
        self._fold = env.mixed_precision or self._tied_copy is not None or self.plan.zero >= 1
        for c, stage in zip(chunk_ids, stages):
            stage.after_backward = functools.partial(self._after_backward, env, c) if self._fold else None
        cls = SCHEDULE_CLASSES[self.plan.schedule]
        options = dict(n_microbatches=self.plan.mb, loss_fn=functools.partial(_stage_loss, env),
                       scale_grads=not self._fold)
        if single_stage(self.plan.schedule):
            self._schedule = cls(stages[0], **options)
            return
        self._schedule = cls(stages, **options)
        # What torch will execute is the schedule as data that the view and the cost model read.
        expected = rank_orders(self.plan.schedule, self.plan.pp, self.plan.mb, self.plan.vpp)[pp_rank]
        got = actions(pipeline_order(self._schedule)[pp_rank])
        assert got == expected, f"torch's {self.plan.schedule} order differs from autopar.ops.schedules on rank {pp_rank}"

    def _stage_module(self, c: int) -> torch.nn.Module:
        """What chunk ``c``'s stage runs: the chunk, or under ``compile=`` the chunk's parameters
        around its Inductor program (the stage differentiates ``parameters()``: ZeRO-3's shards too)."""
        if self._torch_compile_options is None:
            return self._chunks[c]
        return _CompiledChunk(self._chunks[c], torch_compiled_program(self._chunks[c], self._torch_compile_options))

    def _after_backward(self, env, chunk: int, kind: str) -> None:
        """After backward action ``kind`` of ``chunk`` (see compat.recording_stage_class)."""
        if self._tied_copy is not None:
            weight, copy = self._tied_copy
            if copy.grad is not None:
                weight.grad = copy.grad if weight.grad is None else weight.grad.add_(copy.grad)
                copy.grad = None
        env.grad_sync.after_backward(chunk, kind)

    def run(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        if env.device.type == "meta":  # scale simulation: no values for torch's schedule to run on
            with env.grad_sync.pipeline_step(), keeping_shards(self._regathers):
                losses = simulate_step(self, env, inputs, target, coords)
            return StepOutput(torch.stack(losses).mean() if losses else None)
        # ZeRO-3: the units' gathers and saved-tensor hooks; inside them SP's re-gather hooks.
        with env.grad_sync.pipeline_step(), keeping_shards(self._regathers):
            out = self._drive(self._schedule.step, env, inputs, target, coords, return_outputs=False)
        if self._fold and self.plan.mb > 1:  # the mean over micro-batches, on the fp32 main gradients
            env.grad_sync.scale_grads(1.0 / self.plan.mb)
        return out

    def evaluate(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Forward only through the schedule (``schedule.eval``): the last chunk's mean loss.

        torch 2.13's ``eval`` of a V-shaped schedule (zbv, dualpipev) still runs the local
        backward hand-offs between the two chunks of a rank and fails; there the step runs
        whole (dropout off, as in eval) and its gradients are dropped: nothing is updated."""
        if self.plan.schedule not in V_SCHEDULES:
            return self._drive(self._schedule.eval, env, inputs, target, coords, return_outputs=False)
        with torch.enable_grad(), env.grad_sync.pipeline_step():
            out = self._drive(self._schedule.step, env, inputs, target, coords, return_outputs=False)
        for p in env.gm.parameters():
            p.grad = None
        env.grad_sync.optimizer.zero_grad(set_to_none=True)  # mixed precision's fp32 main gradients too
        return out

    def _drive(self, call, env, inputs: tuple, target: Any, coords: dict[str, int], **options) -> StepOutput:
        pieces = env.microbatches(inputs, target, coords)
        local_inputs = [torch.cat([p[0][i] for p in pieces]) for i in range(len(inputs))]
        local_target = torch.cat([p[1] for p in pieces])
        kwargs = dict(zip(self.pipeline.kwarg_names, local_inputs + [local_target]))
        losses: list = []
        # Compiled chunks: torch's split backward differentiates each graph twice, retaining it
        # the first time, which a compiled backward that donates its saved buffers refuses.
        with retained_compiled_backward() if self._torch_compile_options is not None else contextlib.nullcontext():
            call(target=local_target if self._last else None, losses=losses, **options, **kwargs)
        if not self._last:
            return StepOutput(None)
        return StepOutput(torch.stack([l.detach().float() for l in losses]).mean())

    def describe_stage(self, stage: int) -> torch.fx.GraphModule:
        n = len(self.pipeline.chunks)
        if not 0 <= stage < n:
            raise AutoparError(f"autopar: stage {stage} does not exist; plan '{self.plan}' has {n} pipeline "
                               f"chunks (0..{n - 1}).")
        return self.pipeline.chunks[stage].gm


class _CompiledChunk(torch.nn.Module):
    """A chunk's stage module under ``compile=``: the chunk's parameters (its submodule), its
    Inductor program (not a submodule: the same parameters again) as the forward."""

    def __init__(self, chunk: torch.fx.GraphModule, program: torch.nn.Module):
        super().__init__()
        self.chunk = chunk
        self.__dict__["program"] = program  # not registered: parameters() lists the chunk's once

    def forward(self, *args, **kwargs):
        return self.program(*args, **kwargs)


def _alias_parameter(chunks: dict, c: int, name: str, gm: torch.nn.Module) -> torch.nn.Parameter:
    """Rebuild chunk ``c`` so that its reads of parameter ``name`` see a new Parameter on the
    same storage (a separate autograd leaf); returns that Parameter."""
    weight = gm.get_parameter(name)
    alias = torch.nn.Parameter(weight.detach(), requires_grad=weight.requires_grad)
    graph = chunks[c].graph
    attrs = {n.target: alias if n.target == name else _resolve(gm, n.target)
             for n in graph.nodes if n.op == "get_attr"}
    chunks[c] = torch.fx.GraphModule(attrs, graph)
    return alias


def _resolve(root: torch.nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
