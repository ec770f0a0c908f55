"""Pipeline schedules as data: each rank's ordered compute actions for a plan.

:func:`rank_orders` gives, per pp rank, the actions (``F`` forward, ``B`` backward --
the input-gradient half when the rank also runs ``W`` --, ``W`` weight gradient) with the
model chunk and micro-batch of each, in the order the runtime executes them.  The runtime
(:mod:`autopar.runtime.stepping.pipelined`) executes them through ``torch.distributed.pipelining``'s
schedule classes (:data:`SCHEDULE_CLASSES`), the schedule view (:mod:`autopar.views.schedule`)
lays them out in time, and ``tests/unit/test_schedules.py`` checks the bubble and in-flight
formulas of ``cost/pipeline.py`` against them.

Where the orders come from: the multi-stage classes (``interleaved``, ``zbv``,
``dualpipev``) execute the ``pipeline_order`` their constructor builds, which is read
through :func:`autopar.compat.pipeline_order` on plain stand-in stage descriptions (the
constructor reads only their ranks and counts).  ``gpipe`` and ``1f1b`` run a hand-written
single-stage loop instead, and in torch 2.13 ``Schedule1F1B``'s ``pipeline_order`` is wrong
on the last rank (it starts at micro-batch 1 and ends at ``mb``), so for those two the
order is the one their loop executes: ``min(mb, pp - rank)`` forwards, then one backward
and one forward alternating, then the remaining backwards.
"""
from __future__ import annotations

import dataclasses
import types

from autopar.errors import AutoparError
from autopar.plan import MULTI_CHUNK_SCHEDULES, chunks_per_rank

__all__ = ["Act", "SCHEDULE_CLASSES", "actions", "single_stage", "rank_orders"]


def _schedule_classes() -> dict:
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


SCHEDULE_CLASSES = _schedule_classes()


def single_stage(schedule: str) -> bool:
    """Schedules that hold one model chunk per rank (their classes take one stage)."""
    return schedule not in MULTI_CHUNK_SCHEDULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class Act:
    """One compute action: ``kind`` F, B or W of micro-batch ``microbatch_index`` on pipeline
    stage ``stage_index`` (the model chunk's index), as torch's
    ``_Action(stage_index, computation_type, microbatch_index)``."""

    kind: str
    stage_index: int
    microbatch_index: int

    def label(self, multi: bool) -> str:
        return f"{self.kind}{self.microbatch_index}" + (f"s{self.stage_index}" if multi else "")


def _single_stage_order(schedule: str, pp: int, num_microbatches: int, rank: int) -> list[tuple[Act, ...]]:
    """Pp rank ``rank``'s actions under gpipe or 1f1b (stage ``rank``, the order their loop runs)."""
    def fwd(m: int) -> tuple[Act, ...]:
        return (Act(kind="F", stage_index=rank, microbatch_index=m),)

    def bwd(m: int) -> tuple[Act, ...]:
        return (Act(kind="B", stage_index=rank, microbatch_index=m),)

    if schedule == "gpipe":
        return [fwd(m) for m in range(num_microbatches)] + [bwd(m) for m in range(num_microbatches)]
    warmup = min(num_microbatches, pp - rank)
    order = [fwd(m) for m in range(warmup)]
    f, b = warmup, 0
    while True:
        order.append(bwd(b))
        b += 1
        if f == num_microbatches:
            break
        order.append(fwd(f))
        f += 1
    order += [bwd(m) for m in range(b, num_microbatches)]
    return order


def actions(slots) -> list[tuple[Act, ...]]:
    """One rank's slots of ``(kind, stage index, micro-batch index)`` triples as :class:`Act` tuples."""
    return [tuple(Act(kind=k, stage_index=s, microbatch_index=m) for k, s, m in slot) for slot in slots]


def _multi_stage_orders(schedule: str, pp: int, num_microbatches: int, vpp: int) -> list[list[tuple[Act, ...]]]:
    from autopar.compat import pipeline_order

    per_rank = chunks_per_rank(schedule, vpp)
    # The constructor only reads these fields of its stages; no process group is needed.
    stage = types.SimpleNamespace(group_rank=0, group_size=pp, num_stages=per_rank * pp, submod=None)
    try:
        sched = SCHEDULE_CLASSES[schedule]([stage] * per_rank, num_microbatches)
    except ValueError as exc:
        raise AutoparError(f"autopar: torch's {schedule} schedule refuses pp={pp}, mb={num_microbatches}: "
                           f"{exc}") from exc
    return [actions(slots) for slots in pipeline_order(sched)]


def rank_orders(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> list[list[tuple[Act, ...]]]:
    """Each pp rank's compute actions in execution order (``num_microbatches``: the plan's
    ``mb``); an entry holds 2 acts when overlapped."""
    if single_stage(schedule):
        return [_single_stage_order(schedule, pp, num_microbatches, r) for r in range(pp)]
    return _multi_stage_orders(schedule, pp, num_microbatches, vpp)
