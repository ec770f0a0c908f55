"""The report's page model: every number one plan's HTML page shows, as plain dicts and lists.

:func:`plan_page` gathers them from a scored plan (:class:`autopar.cost.Cost`): the header, the
collectives, the memory terms and the time split are :func:`autopar.views.explain.explain_record`'s, the
record ``autopar explain --json`` prints, so the page and the command cannot disagree
(tests/e2e/test_report.py compares them); the pipeline grid is the schedule the runtime executes
(:func:`autopar.ops.schedules.rank_orders`, laid out in unit time by
:func:`autopar.views.schedule.schedule_grid`); the memory over the step is ``Cost.memory_moments``, each
moment of cost/memory.py's peak timeline; the mesh is :func:`autopar.plan_space.axis_digits`'s rank
numbering.  Measurements, where a run made them, come as comparison rows (:func:`measured_rows` and
its helpers for ``explain --measure``, ``--simulate``, ``pm.last_step_stats`` and ``pm.comm_stats()``).

Neighbours: autopar/views/report_plots.py draws the model's figures (matplotlib, SVG) and
autopar/views/report_html.py writes the page; autopar/cli/report_cmd.py (``autopar report``,
``autopar plan --report``) and autopar/runtime/report.py (``pm.report(path)``) call them.
"""
from __future__ import annotations

import collections

from autopar.plan_space import MULTI_CHUNK_SCHEDULES, axis_digits
from autopar.views.explain import dominant_terms, explain_record, group_of, time_terms

__all__ = ["plan_page", "mesh_coords", "schedule_cells", "memory_timeline", "time_split", "comm_totals",
           "simulated_rows", "measured_memory_rows", "step_stats_rows", "comm_stats_rows", "MESH_AXES"]

MESH_AXES = ("pp", "dp", "cp", "tp", "ep")


def plan_page(cost, *, hardware: dict | None = None, measured: list[dict] | None = None,
              title: str | None = None, source: str = "") -> dict:
    """The page model of ``cost``'s plan: ``record`` (explain's, with formulas), ``mesh``, ``schedule``,
    ``memory``, ``comm``, ``time`` and the ``measured`` comparison rows (an empty list: none)."""
    rec = explain_record(cost, formulas=True)
    if hardware is not None:
        rec["hardware"] = hardware
    return {
        "title": title or f"autopar plan {rec['plan']}",
        "source": source,
        "record": rec,
        "mesh": mesh_coords(cost.plan),
        "schedule": schedule_cells(cost.plan),
        "memory": memory_timeline(cost, rec),
        "comm": comm_totals(rec),
        "time": time_split(cost),
        "measured": list(measured or []),
    }


def mesh_coords(plan) -> dict:
    """Each rank's coordinate on every axis: ``coords[axis][rank]`` (rank = ((pp·dp + dp)·cp + cp)·tp + tp;
    ep folds over consecutive dp·cp indices, docs/architecture.md)."""
    degrees = {"pp": plan.pp, "dp": plan.dp, "cp": plan.cp, "tp": plan.tp, "ep": plan.ep}
    world = plan.world_size
    coords = {}
    for axis in MESH_AXES:
        (stride, size), *_ = axis_digits(axis, pp=plan.pp, dp=plan.dp, cp=plan.cp, tp=plan.tp, ep=plan.ep)
        coords[axis] = [(r // stride) % size for r in range(world)]
    return {"world": world, "degrees": degrees, "coords": coords, "columns": _mesh_columns(plan)}


def _mesh_columns(plan) -> int:
    """Ranks per row of the mesh picture: whole tp·cp groups, about a square."""
    inner = plan.tp * plan.cp
    cols = inner
    while cols * cols < plan.world_size and plan.world_size % (cols * 2) == 0:
        cols *= 2
    return cols


def schedule_cells(plan) -> dict | None:
    """The pipeline grid: per pp rank, per unit time step, the actions run (``kind`` F, B, W, or several
    when overlapped), their micro-batch and model chunk; None without a pipeline."""
    if plan.pp == 1:
        return None
    from autopar.views.schedule import rank_orders, schedule_grid

    orders = rank_orders(plan.schedule, plan.pp, plan.mb, plan.vpp)
    grid = schedule_grid(orders)
    multi = plan.schedule in MULTI_CHUNK_SCHEDULES
    rows = [[None] * len(grid) for _ in range(plan.pp)]
    for step, row in enumerate(grid):
        for rank, entry in enumerate(row):
            if entry:
                rows[rank][step] = {"kind": "+".join(a.kind for a in entry),
                                    "microbatch": entry[0].microbatch_index, "chunk": entry[0].stage_index,
                                    "label": "+".join(a.label(multi) for a in entry)}
    idle = [sum(cell is None for cell in r) for r in rows]
    return {"schedule": plan.schedule, "pp": plan.pp, "mb": plan.mb, "steps": len(grid),
            "chunks": 1 + max(a.stage_index for order in orders for entry in order for a in entry),
            "rows": rows, "idle_steps": idle}


def memory_timeline(cost, rec: dict) -> dict:
    """The fullest pp rank's memory at each moment of the step, term by term (explain's peak rank and
    terms; the largest moment is explain's ``peak``), with the device's usable and total bytes."""
    peak = rec["memory_peak"]
    moments = cost.memory_moments(peak["pp_rank"])
    from autopar.cost.memory import MOMENTS

    return {"pp_rank": peak["pp_rank"], "peak_moment": peak["moment"], "peak_bytes": peak["peak_bytes"],
            "moments": [{"moment": mo, "what": MOMENTS[mo], "terms": terms} for mo, terms in moments.items()],
            "formulas": {name: m.get("formula", "") for name, m in rec["memory"].items()},
            "usable_bytes": rec["usable_memory_bytes"], "device_bytes": cost.cluster.hbm_bytes}


def time_split(cost) -> list[dict]:
    """The step's time by share (compute, each dimension's exposed comm, bubble, optimizer): explain's
    ``dominant_terms`` over every group, each with the formulas of its terms for the hover."""
    terms = time_terms(cost, True)
    formulas = collections.defaultdict(list)
    for t in terms:
        group = group_of(t)
        if group is not None and t.value > 0:
            formulas[group].append(f"{t.name} = {t.formula}")
    return [{"group": name, "seconds": sec, "share": sec / cost.step_time, "formulas": formulas[name]}
            for name, sec in dominant_terms(cost, terms, top=len(terms))]


def comm_totals(rec: dict) -> dict:
    """Bytes sent per step by mesh axis and by (collective, axis), from explain's collective rows."""
    by_axis: dict[str, float] = collections.defaultdict(float)
    by_kind: dict[str, float] = collections.defaultdict(float)
    for row in rec["comm"]:
        by_axis[row["axis"]] += row["bytes_sent_per_step"]
        by_kind[f"{row['collective']} ({row['axis']})"] += row["bytes_sent_per_step"]
    return {"by_axis": dict(by_axis), "by_collective": dict(by_kind),
            "by_dimension": rec["comm_bytes_sent_per_step_by_dimension"], "pp_rank": rec["pp_rank"]}


# ---------------------------------------------------------------------- measurements
def _row(source: str, name: str, predicted, measured, unit: str) -> dict:
    return {"source": source, "name": name, "predicted": predicted, "measured": measured, "unit": unit}


def simulated_rows(sim: dict) -> list[dict]:
    """``explain --simulate``'s record (:func:`autopar.cli.simulate_cmd.simulate_rank`) as rows."""
    src = f"full width, simulated (MemTracker, FlopCounterMode), {sim['layers']} layers"
    return [_row(src, f"peak memory, pp rank {sim['pp_rank']}", sim["predicted_peak"], sim["measured_peak"], "bytes"),
            _row(src, f"FLOPs per step, pp rank {sim['pp_rank']}", sim["predicted_flops"], sim["measured_flops"],
                 "flop")]


def measured_memory_rows(rows: list[dict], target: str) -> list[dict]:
    """``explain --measure``'s memory comparison (:func:`autopar.cli.measure_cmd.memory_comparison`)."""
    src = f"one train_step of {target} on local gloo processes"
    return [_row(src, f"memory: {r['category']}", r["predicted"], r["measured"], "bytes") for r in rows]


def step_stats_rows(stats: dict) -> list[dict]:
    """``pm.last_step_stats``: the measured step against the cost model's, where it made one."""
    out = []
    if "predicted_seconds" in stats:
        out.append(_row("pm.last_step_stats", "step time", stats["predicted_seconds"], stats["seconds"], "s"))
        out.append(_row("pm.last_step_stats", "tokens/s", stats["predicted_tokens_per_s"], stats["tokens_per_s"],
                        "tokens/s"))
    elif stats:
        out.append(_row("pm.last_step_stats", "step time", None, stats["seconds"], "s"))
    return out


def comm_stats_rows(records: list[dict], rows) -> list[dict]:
    """``pm.comm_stats()`` against ``Cost.comm_table`` rows of the same rank, summed per (phase,
    collective, axis): bytes sent per step (the byte-equality tests' convention)."""
    measured: dict = collections.defaultdict(float)
    predicted: dict = collections.defaultdict(float)
    for r in records:
        measured[(r["phase"], r["op"], r["axis"])] += r["bytes_sent"]
    for row in rows:
        predicted[(row.phase, row.collective, row.axis)] += row.bytes_sent * row.count
    keys = sorted(set(measured) | set(predicted))
    return [_row("pm.comm_stats()", f"{phase} {op} ({axis}) bytes sent", predicted.get((phase, op, axis), 0.0),
                 measured.get((phase, op, axis), 0.0), "bytes") for phase, op, axis in keys]
