"""Run a pipelined program: the chunks of ``passes/pipeline.py`` under ``torch.distributed.pipelining``.

:class:`PipelineExecutor` is the executor of :class:`autopar.runtime.module.ParallelModule`
for a plan with ``pp > 1``.  Each rank keeps the parameters of its own chunks only (chunk
``c`` lives on pipeline rank ``program.pipeline.chunk_rank(c)``: looped for gpipe / 1f1b /
interleaved, V-shaped for zbv / dualpipev), wraps each chunk in a recording stage (a
``PipelineStage`` that records the bytes of every P2P send and receive it posts,
:func:`autopar.compat.recording_stage_class`) and drives them with the plan's schedule
(:data:`autopar.ops.schedules.SCHEDULE_CLASSES`).

The loss: the last chunk computes it in-graph from the ``target`` keyword micro-batch
(every stage receives the model inputs and the target as keyword micro-batches, see the
pass), so the schedule's ``loss_fn`` is the identity and ``scale_grads`` divides the
gradients by the micro-batch count (the mean over micro-batches).  The module reduces the
last stage's mean over the data axes and then over ``pp`` (other stages contribute 0).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.compat import pipeline_order, recording_stage_class
from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops.schedules import SCHEDULE_CLASSES, Act, rank_orders, single_stage
from autopar.runtime.executors import StepOutput

__all__ = ["PipelineExecutor"]


def _identity_loss(output, target):
    return output


def _record_p2p(ops, phase: str, stage_index: int) -> None:
    """Record every P2P buffer a stage posts (the byte convention: P2P moves the buffer)."""
    what = "activation" if phase == "fwd" else "input grad"
    for op in ops:
        kind = "send" if op.op in (dist.isend, dist.send) else "recv"
        C.record_p2p(kind, "pp", op.tensor, phase, f"stage {stage_index} {what} {kind}")


_RecordingStage = recording_stage_class(_record_p2p)


class PipelineExecutor:
    """This rank's chunks of a pipelined program and the schedule that runs them."""

    def __init__(self, gm: torch.fx.GraphModule, program, plan):
        self.gm, self.plan = gm, plan
        self.pipeline = program.pipeline
        owner = self.pipeline.param_chunk()
        self._owner = {p: self.pipeline.chunk_rank(c) for p, c in owner.items()}
        self._chunks: dict[int, torch.fx.GraphModule] = {}
        self._schedule = None

    def owner(self, name: str) -> int | None:
        return self._owner.get(name)

    def setup(self, pm) -> None:
        """Rebuild this rank's chunks on the local parameters and the schedule over them."""
        pp_rank = pm.coords().get("pp", (0, 1))[0]
        chunk_ids = self.pipeline.rank_chunks(pp_rank)
        self._chunks = {c: torch.fx.GraphModule(self.gm, self.pipeline.chunks[c].gm.graph) for c in chunk_ids}
        self._last = self.pipeline.chunk_rank(len(self.pipeline.chunks) - 1) == pp_rank
        if not dist.is_initialized():
            return
        pp_group = pm.groups["pp"].group
        stages = [_RecordingStage(self._chunks[c], c, len(self.pipeline.chunks), pm.device, group=pp_group)
                  for c in chunk_ids]
        cls = SCHEDULE_CLASSES[self.plan.schedule]
        if single_stage(self.plan.schedule):
            self._schedule = cls(stages[0], n_microbatches=self.plan.mb, loss_fn=_identity_loss, scale_grads=True)
            return
        self._schedule = cls(stages, n_microbatches=self.plan.mb, loss_fn=_identity_loss, scale_grads=True)
        # What torch will execute is the schedule as data that the view and the cost model read.
        expected = rank_orders(self.plan.schedule, self.plan.pp, self.plan.mb, self.plan.vpp)[pp_rank]
        got = [tuple(Act(kind=k, stage=s, mb=m) for k, s, m in slot) for slot in pipeline_order(self._schedule)[pp_rank]]
        assert got == expected, f"torch's {self.plan.schedule} order differs from autopar.ops.schedules on rank {pp_rank}"

    def run(self, pm, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        return self._drive(self._schedule.step, pm, inputs, target, coords, return_outputs=False)

    def evaluate(self, pm, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Forward only through the schedule (``schedule.eval``): the last stage's mean loss."""
        return self._drive(self._schedule.eval, pm, inputs, target, coords, return_outputs=False)

    def _drive(self, call, pm, inputs: tuple, target: Any, coords: dict[str, int], **options) -> StepOutput:
        pieces = pm.micro_batches(inputs, target, coords)
        local_inputs = [torch.cat([p[0][i] for p in pieces]) for i in range(len(inputs))]
        local_target = torch.cat([p[1] for p in pieces])
        kwargs = dict(zip(self.pipeline.kwarg_names, local_inputs + [local_target]))
        losses: list = []
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
