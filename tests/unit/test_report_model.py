"""The report's page model (autopar/views/report.py) against the sources it reads, without drawing.

The memory over the step peaks at explain's peak; the mesh numbers ranks as the runtime's groups do;
the pipeline grid holds every action the runtime's schedule runs, once; the bytes per axis add up to
explain's bytes per dimension; the step's time split adds up to the step.  (The page against
``autopar explain``'s printed numbers: tests/e2e/test_report.py.)
"""
from __future__ import annotations

import pytest

from autopar.cost import Cluster, estimate
from autopar.ops.schedules import rank_orders
from autopar.plan_space import axis_groups
from autopar.views.report import comm_stats_rows, plan_page, step_stats_rows

PLAN = "tp=2,sp,pp=2:interleaved,vpp=2,dp=2,mb=4"


@pytest.fixture(scope="module")
def page():
    cost = estimate("llama3-8b", Cluster(gpu="h100", num_nodes=1), PLAN, 4096, 16)
    return cost, plan_page(cost)


def test_memory_over_the_step_peaks_at_explains_peak(page):
    cost, p = page
    sums = {m["moment"]: sum(m["terms"].values()) for m in p["memory"]["moments"]}
    assert max(sums.values()) == pytest.approx(cost.peak_memory(p["memory"]["pp_rank"]), rel=1e-9)
    assert max(sums, key=sums.get) == p["memory"]["peak_moment"] == p["record"]["memory_peak"]["moment"]
    assert p["memory"]["peak_bytes"] == p["record"]["memory_peak"]["peak_bytes"]
    # One memory figure: the header's memory/GPU is the chart's and the breakdown's peak (friction 3).
    assert p["record"]["memory_per_gpu_bytes"] == pytest.approx(p["memory"]["peak_bytes"], rel=1e-9)


def test_mesh_coordinates_are_the_runtimes_groups(page):
    cost, p = page
    plan, coords = cost.plan, page[1]["mesh"]["coords"]
    for axis in ("pp", "dp", "tp"):
        for group in axis_groups(axis, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp):
            assert sorted(coords[axis][r] for r in group) == list(range(len(group))), (axis, group)
    assert len(coords["pp"]) == plan.world_size == p["mesh"]["world"]


def test_schedule_grid_runs_every_action_once(page):
    cost, p = page
    sched, plan = p["schedule"], cost.plan
    orders = rank_orders(plan.schedule, plan.pp, plan.mb, plan.vpp)
    for rank, row in enumerate(sched["rows"]):
        cells = [c for c in row if c is not None]
        assert len(cells) == len(orders[rank]) and sched["idle_steps"][rank] == len(row) - len(cells)
    assert sched["chunks"] == plan.pp * plan.vpp


def test_bytes_and_time_add_up(page):
    cost, p = page
    rec = p["record"]
    assert sum(p["comm"]["by_axis"].values()) == pytest.approx(sum(rec["comm_bytes_sent_per_step_by_dimension"].values()))
    assert sum(part["seconds"] for part in p["time"]) == pytest.approx(cost.step_time, rel=1e-6)
    assert all(part["formulas"] for part in p["time"])


def test_measurement_rows(page):
    cost, _ = page
    rows = cost.comm_table(0)
    records = [{"phase": r.phase, "op": r.collective, "axis": r.axis, "bytes_sent": r.bytes_sent}
               for r in rows for _ in range(r.count)]
    compared = comm_stats_rows(records, rows)
    assert compared and all(r["predicted"] == pytest.approx(r["measured"]) for r in compared)
    stats = step_stats_rows({"seconds": 2.0, "tokens_per_s": 5.0, "predicted_seconds": 1.0,
                             "predicted_tokens_per_s": 10.0})
    assert [(r["predicted"], r["measured"]) for r in stats] == [(1.0, 2.0), (10.0, 5.0)]
