"""The step context: everything a running program's operators look up while one step runs.

A generated program calls operators by *mesh axis name* (``all_gather(x, 1, 'tp')``), so
one graph serves every rank of a stage and prints without a process group.  What those
names resolve to, where the bytes of each collective are recorded, which ZeRO-3 state
gathers parameters and which memory meter counts saved tensors all belong to one explicit
:class:`StepContext`, owned by the :class:`autopar.runtime.ParallelModule` that runs the
program and made current for the duration of a step with :func:`activate`:

    step = StepContext(groups=..., recorder=CommRecorder())
    with activate(step):
        loss = gm(*inputs)      # operators call current() to find groups, recorder, ...

There is no other module-level state in ``ops/``: a second ParallelModule in the same
process has its own context, and a program run outside any step fails with an
``autopar:`` error that says so.  Neighbours: :mod:`autopar.ops.collectives` (the
collectives and the byte convention), :mod:`autopar.ops.zero_gather` (ZeRO-3's gather),
:mod:`autopar.runtime.stepping.memory` (the meter that :func:`observe_saved` feeds).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator

__all__ = ["AxisGroup", "CommRecord", "CommRecorder", "StepContext", "activate", "current", "find_current",
           "observe_saved"]


@dataclasses.dataclass(frozen=True)
class AxisGroup:
    """The process group of one mesh axis as seen by this rank."""

    group: object  # ProcessGroup (None when the axis has one rank)
    size: int
    rank: int


@dataclasses.dataclass(frozen=True)
class CommRecord:
    """One collective this rank issued: what it moved, by the ring convention (docs/architecture.md)."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send | recv
    axis: str
    group_size: int
    bytes_sent: float
    bytes_recv: float
    phase: str  # fwd | bwd | grad | step | loss
    shape: tuple
    dtype: str
    tag: str
    counts: tuple | None = None  # MoE all-to-all: (tokens sent per expert, received [source][local expert])


class CommRecorder:
    """Collects the records of every collective issued while its step is active."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def clear(self) -> None:
        self.records.clear()


@dataclasses.dataclass
class StepContext:
    """What the operators of one running program need (see the module docstring).

    ``zero`` is the ZeRO-3 state whose ``gather(unit)`` the program's ``zero_gather`` calls;
    ``memory`` the meter that counts tensors saved for backward; ``counters`` counts work
    the operators report (e.g. ``cp_score_blocks``), cleared with the recorder each step.
    """

    groups: dict[str, AxisGroup]
    recorder: CommRecorder = dataclasses.field(default_factory=CommRecorder)
    zero: Any = None
    memory: Any = None
    # Sequence parallelism's backward re-gather (autopar/ops/regather.py): the saved-tensor hooks
    # of the running micro-batch that SP all-gathers register their outputs with.
    regather: Any = None
    counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    training: bool = True  # False while pm.eval_step runs: train-mode-only operators (dropout) are off
    # True while backward re-runs a recomputed region (autopar/ops/recompute.py): its forward
    # collectives are recorded as backward traffic.
    recomputing: bool = False
    # Dropout's random streams (autopar/ops/rng.py): the base seed, the same on every rank
    # (torch.initial_seed() when the context is made, or rank 0's: random.common_seed), and
    # one generator per stream and device, kept across steps so successive draws advance it.
    seed: int = dataclasses.field(default_factory=lambda: _initial_seed())
    generators: dict = dataclasses.field(default_factory=dict)

    def begin(self) -> None:
        """Start a new step: forget the previous step's records and counters."""
        self.recorder.clear()
        self.counters.clear()

    def group(self, axis: str) -> AxisGroup:
        try:
            return self.groups[axis]
        except KeyError:
            raise RuntimeError(f"autopar: collective on mesh axis '{axis}', which this program's mesh does not "
                               f"have (known axes: {sorted(self.groups)}); this is an autopar bug, please report "
                               "it with the plan.") from None


def _initial_seed() -> int:
    import torch  # lazily: the rest of this module needs only the standard library

    return torch.initial_seed()


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("autopar_step", default=None)


@contextlib.contextmanager
def activate(step: StepContext, **overrides: Any) -> Iterator[StepContext]:
    """Make ``step`` current while the block runs; ``overrides`` replace fields for the block only
    (e.g. ``zero=`` around a micro-batch), restoring them afterwards."""
    saved = {k: getattr(step, k) for k in overrides}
    for k, v in overrides.items():
        setattr(step, k, v)
    token = _CURRENT.set(step)
    try:
        yield step
    finally:
        _CURRENT.reset(token)
        for k, v in saved.items():
            setattr(step, k, v)


def find_current() -> StepContext | None:
    """The active step context, or None outside a step."""
    return _CURRENT.get()


def current() -> StepContext:
    """The active step context; an ``autopar:`` error outside a step."""
    step = _CURRENT.get()
    if step is None:
        raise RuntimeError("autopar: a parallel program's operator ran outside a ParallelModule step; its "
                           "collectives need the step's process groups. Run it through pm.train_step.")
    return step


def observe_saved(t) -> None:
    """Count ``t`` as saved for backward by the active step's memory meter, if any."""
    step = _CURRENT.get()
    if step is not None and step.memory is not None:
        step.memory.observe(t)
