"""The step x rank grid of a pipeline schedule, derived without running anything.

Each rank's ordered compute actions are the schedule as data of :mod:`autopar.ops.schedules`
(what the runtime executes).  Here they are laid out in time by a unit-time simulation: at
each step a rank runs its next action if what it depends on finished at an earlier step (a
forward needs the previous stage's forward of the micro-batch, a backward the next stage's
backward, or the stage's own forward on the last chunk; a weight-gradient step ``W`` its
input-gradient step).  Cells read ``F3`` (forward of micro-batch 3), ``B3`` (backward; the
input-gradient half when the rank also runs ``W``), ``W3``, with ``s<stage>`` appended when a
rank holds several chunks, ``A+B`` for DualPipeV's overlapped forward-and-backward, and ``.``
when the rank waits.

Neighbours: ``autopar inspect --schedule`` (:mod:`autopar.cli.inspect_cmd`) prints
:func:`format_schedule`; ``cost/pipeline.py`` has the in-flight figures that
``tests/unit/test_schedules.py`` checks the grids against.
"""
from __future__ import annotations

from autopar.ops.schedules import Act, rank_orders
from autopar.plan import MULTI_CHUNK_SCHEDULES

__all__ = ["Act", "rank_orders", "schedule_grid", "inflight_peaks", "format_schedule"]


def _deps(a: Act, num_stages: int) -> list[Act]:
    def act(kind: str, stage_index: int) -> Act:
        return Act(kind=kind, stage_index=stage_index, microbatch_index=a.microbatch_index)

    if a.kind == "F":
        return [act("F", a.stage_index - 1)] if a.stage_index > 0 else []
    if a.kind == "W":
        return [act("B", a.stage_index)]
    if a.stage_index == num_stages - 1:
        return [act("F", a.stage_index)]
    return [act("B", a.stage_index + 1), act("F", a.stage_index)]


def schedule_grid(orders: list[list[tuple[Act, ...]]]) -> list[list[tuple[Act, ...] | None]]:
    """Lay the per-rank orders out in unit time steps: ``grid[step][rank]`` (None: idle)."""
    num_stages = 1 + max(a.stage_index for order in orders for entry in order for a in entry)
    done: dict[Act, int] = {}
    pos = [0] * len(orders)
    grid = []
    while any(p < len(o) for p, o in zip(pos, orders)):
        step = len(grid)
        row: list = [None] * len(orders)
        for r, order in enumerate(orders):
            if pos[r] == len(order):
                continue
            entry = order[pos[r]]
            inside = set(entry)
            if all(d in inside or done.get(d, step) < step for a in entry for d in _deps(a, num_stages)):
                row[r] = entry
        if not any(row):
            raise AssertionError(f"schedule deadlocks at step {step}: {[o[p] for p, o in zip(pos, orders) if p < len(o)]}")
        for r, entry in enumerate(row):
            if entry:
                for a in entry:
                    done[a] = step
                pos[r] += 1
        grid.append(row)
    return grid


def inflight_peaks(orders: list[list[tuple[Act, ...]]]) -> list[int]:
    """Per rank, the most micro-batch chunk activations held at once (a forward adds one,
    the backward that produces the input gradient frees it; inside an overlapped pair the
    forward counts first, the worst case)."""
    peaks = []
    for order in orders:
        held = peak = 0
        for entry in order:
            for a in sorted(entry, key=lambda a: a.kind != "F"):
                held += {"F": 1, "B": -1, "W": 0}[a.kind]
                peak = max(peak, held)
        peaks.append(peak)
    return peaks


def format_schedule(plan) -> str:
    """The step x rank grid of ``plan``'s pipeline schedule, with a legend and in-flight peaks."""
    if plan.pp == 1:
        return f"plan '{plan}' has no pipeline (pp=1): every rank runs its {plan.mb} micro-batch(es) in turn."
    orders = rank_orders(plan.schedule, plan.pp, plan.mb, plan.vpp)
    grid = schedule_grid(orders)
    multi = plan.schedule in MULTI_CHUNK_SCHEDULES
    cells = [["+".join(a.label(multi) for a in e) if e else "." for e in row] for row in grid]
    width = max(6, max(len(c) for row in cells for c in row))
    num_stages = 1 + max(a.stage_index for order in orders for entry in order for a in entry)
    lines = [f"schedule {plan.schedule}: pp={plan.pp}, mb={plan.mb}, {num_stages} model chunks",
             "step  " + " ".join(f"rank{r}".ljust(width) for r in range(plan.pp))]
    for step, row in enumerate(cells):
        lines.append(f"{step:<5} " + " ".join(c.ljust(width) for c in row))
    peaks = inflight_peaks(orders)
    lines.append(f"{len(grid)} steps; peak activations held (micro-batch chunks) per rank: {peaks}")
    lines.append("F<m> forward, B<m> backward (input gradient when W is separate), W<m> weight gradient, "
                 "s<k> model chunk k, A+B overlapped, '.' idle")
    return "\n".join(lines)
