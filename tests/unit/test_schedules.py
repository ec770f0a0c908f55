"""The printed step x rank grid of every pipeline schedule obeys its rules (nothing distributed runs).

``autopar.views.schedule.format_schedule`` prints, per time step, what each pipeline rank
computes (``F3s2``: forward of micro-batch 3 on model chunk 2; ``B``, ``W``; ``A+B`` when
DualPipeV overlaps two).  This test parses the printed text back and checks, independently
of how it was produced:

- each rank runs exactly the chunks the schedule places on it (looped / V-shaped, derived
  here by hand) and every chunk runs every micro-batch's F and B once (W once or never);
- on each chunk, a micro-batch's forward comes before its backward (and W after B), the
  forward after the previous chunk's forward of it and the backward after the next chunk's
  backward of it (the last chunk: after its own forward);
- the activations a rank holds (forwards not yet backward-ed, in chunk units) never exceed
  the cost model's in-flight figure (``cost/pipeline.py`` ``inflight`` x chunks per rank).
"""
from __future__ import annotations

import re

import pytest

from autopar.cost.pipeline import inflight
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.views.schedule import format_schedule

CASES = [f"pp={pp}:{s},mb={mb}" + (",vpp=2" if s == "interleaved" else "")
         for s in ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
         for pp in (2, 3, 4) for mb in (2 * pp, 3 * pp, 8)]
CASES += ["pp=2:interleaved,vpp=3,mb=4", "pp=4:1f1b,mb=4", "pp=2:zbv,mb=2", "pp=3:gpipe,mb=1",
          "pp=4:zbv,mb=2", "pp=4:interleaved,vpp=2,mb=6", "pp=3:dualpipev,mb=7"]

_CELL = re.compile(r"([FBW])(\d+)(?:s(\d+))?$")


def _chunks_per_rank(plan: Plan) -> int:
    return {"interleaved": plan.vpp, "zbv": 2, "dualpipev": 2}.get(plan.schedule, 1)


def _expected_rank(stage: int, plan: Plan) -> int:
    if plan.schedule in ("zbv", "dualpipev"):
        return stage if stage < plan.pp else 2 * plan.pp - 1 - stage
    return stage % plan.pp


def _parse(text: str, plan: Plan) -> list[list[list[tuple[str, int, int]]]]:
    """grid[step][rank] = [(kind, micro-batch, stage), ...] from the printed table."""
    lines = text.splitlines()
    header = next(i for i, l in enumerate(lines) if l.startswith("step"))
    grid = []
    for line in lines[header + 1:]:
        fields = line.split()
        if not fields or not fields[0].isdigit() or len(fields) != plan.pp + 1:
            break
        assert int(fields[0]) == len(grid)
        row = []
        for rank, cell in enumerate(fields[1:]):
            acts = []
            if cell != ".":
                for part in cell.split("+"):
                    m = _CELL.match(part)
                    assert m, (cell, line)
                    stage = int(m.group(3)) if m.group(3) is not None else rank
                    acts.append((m.group(1), int(m.group(2)), stage))
            row.append(acts)
        grid.append(row)
    return grid


@pytest.mark.parametrize("plan_text", CASES)
def test_printed_grid_obeys_schedule_rules(plan_text):
    plan = Plan.parse(plan_text)
    grid = _parse(format_schedule(plan), plan)
    k = _chunks_per_rank(plan)
    num_stages = plan.pp * k
    when: dict[tuple[str, int, int], int] = {}
    for step, row in enumerate(grid):
        for rank, acts in enumerate(row):
            for kind, mb, stage in acts:
                assert _expected_rank(stage, plan) == rank, (plan_text, step, rank, stage)
                assert (kind, mb, stage) not in when, ("ran twice", kind, mb, stage)
                when[(kind, mb, stage)] = step
    for stage in range(num_stages):
        for mb in range(plan.mb):
            f, b = when[("F", mb, stage)], when[("B", mb, stage)]
            assert f < b, (plan_text, "backward before forward", stage, mb)
            if stage > 0:
                assert when[("F", mb, stage - 1)] < f, (plan_text, "forward before its input", stage, mb)
            if stage < num_stages - 1:
                assert when[("B", mb, stage + 1)] < b, (plan_text, "backward before its grad", stage, mb)
            if ("W", mb, stage) in when:
                assert when[("W", mb, stage)] > b
    # Every (chunk, micro-batch) has one F and one B, and at most one W (DualPipeV splits
    # some backwards into B + W and runs others whole).
    assert sum(1 for kind, _, _ in when if kind != "W") == 2 * num_stages * plan.mb
    assert all(("B", mb, stage) in when for kind, mb, stage in when if kind == "W")
    for rank in range(plan.pp):
        held = peak = 0
        for row in grid:
            # Inside an overlapped pair count the forward first (the worst case).
            for kind, _, _ in sorted(row[rank], key=lambda a: a[0] != "F"):
                held += {"F": 1, "B": -1, "W": 0}[kind]
                peak = max(peak, held)
        allowed = float(inflight(plan.schedule, plan.pp, plan.vpp, rank, plan.mb)) * k
        assert peak <= allowed + 1e-9, (plan_text, rank, peak, allowed)


def test_1f1b_grid_by_hand():
    # pp=2, mb=3: rank 0 warms up with 2 forwards, rank 1 with 1; hand-written timeline.
    grid = _parse(format_schedule(Plan.parse("pp=2:1f1b,mb=3")), Plan.parse("pp=2:1f1b,mb=3"))
    cells = [[",".join(f"{k}{m}" for k, m, _ in acts) or "." for acts in row] for row in grid]
    assert cells == [["F0", "."], ["F1", "F0"], [".", "B0"], ["B0", "F1"], ["F2", "B1"], ["B1", "F2"],
                     [".", "B2"], ["B2", "."]]


def test_peak_reaches_the_cost_model_figure_for_1f1b():
    # The first rank of 1F1B holds min(pp, mb) micro-batches: the bound is tight there.
    plan = Plan.parse("pp=4:1f1b,mb=8")
    text = format_schedule(plan)
    assert "per rank: [4, 3, 2, 1]" in text


def test_unsupported_microbatch_count_is_an_autopar_error():
    with pytest.raises(AutoparError, match=r"autopar: schedule 'dualpipev' .* use mb=4"):
        Plan.parse("pp=2:dualpipev,mb=3")  # no such plan exists: nothing formats it


def test_inspect_prints_the_rank_chunks_and_the_schedule(capsys):
    from autopar.cli import main

    assert main(["inspect", "examples/model.py:build_tiny", "--plan", "pp=2:1f1b,mb=4", "--world", "2",
                 "--rank", "1", "--schedule"]) == 0
    out = capsys.readouterr().out
    # build_tiny has 2 layers: rank 1 holds chunk 1 (layer 1, the head and the loss) only.
    assert "# pipeline chunk 1 (layers [1])" in out and "# pipeline chunk 0" not in out
    assert "schedule 1f1b: pp=2, mb=4, 2 model chunks" in out
    grid = _parse(out[out.index("schedule 1f1b"):], Plan.parse("pp=2:1f1b,mb=4"))
    assert [row[0] for row in grid][:2] == [[("F", 0, 0)], [("F", 1, 0)]]
