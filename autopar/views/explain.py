"""One scored plan as plain numbers: the records ``autopar explain`` and ``autopar plan`` print.

:func:`explain_record` is the full breakdown of one :class:`autopar.cost.Cost` (collectives of one rank,
memory term by term with the part alive at the peak, the time budget, the bubble) as a JSON-ready dict;
:func:`plan_record` one ranked row of ``autopar plan``'s table; :func:`dominant_terms` the largest shares
of the step (compute, each dimension's exposed communication, bubble, optimizer).  They read the cost
model only (no torch), so the offline commands and the HTML report (autopar/views/report.py) share one
source of numbers.  Neighbours: autopar/cli/plan_cmd.py formats these records as text; cost/estimate.py
computes what they hold.
"""
from __future__ import annotations

from autopar.errors import AutoparError

__all__ = ["time_terms", "group_of", "dominant_terms", "plan_record", "explain_record"]


def time_terms(cost, formulas: bool):
    """The terms of ``cost.breakdown()``, with their sympy formulas only when asked for."""
    return cost.breakdown(formulas=formulas)


def group_of(term) -> str | None:
    """Bucket a time term: compute, comm per dimension (exposed part only), bubble, optimizer."""
    if term.category == "compute":
        return "compute"
    if term.category == "comm":
        if not term.name.endswith("(exposed)"):
            return None  # the full transfer time; only what is not hidden counts
        parts = term.name.split(".")
        return f"{parts[2]} comm" if len(parts) > 2 else "comm"
    if term.category == "bubble":
        return "bubble"
    if term.category == "step":
        return "optimizer"
    return None


def dominant_terms(cost, terms=None, top: int = 3) -> list[tuple[str, float]]:
    """The ``top`` largest shares of the step time as (label, seconds), largest first."""
    terms = time_terms(cost, False) if terms is None else terms
    totals: dict[str, float] = {}
    for t in terms:
        group = group_of(t)
        if group is not None and t.value > 0:
            totals[group] = totals.get(group, 0.0) + float(t.value)
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def plan_record(rank: int, plan, cost, terms=None) -> dict:
    """One ranked plan as a JSON-ready dict."""
    dom = dominant_terms(cost, terms)
    return {
        "rank": rank,
        "plan": str(plan),
        "step_time_s": cost.step_time,
        "mfu": cost.mfu,
        "memory_per_gpu_bytes": cost.memory_per_gpu,
        "memory_pp_rank": cost.memory_pp_rank,
        "tokens_per_s": cost.tokens_per_s,
        "bubble_s": cost.bubble,
        "dominant_terms": [
            {"term": name, "seconds": sec, "share": sec / cost.step_time} for name, sec in dom
        ],
    }


def _row_dict(row) -> dict:
    return {
        "phase": row.phase, "dimension": row.dimension, "collective": row.collective,
        "axis": row.axis, "group_size": row.group_size, "bytes_sent": row.bytes_sent,
        "bytes_recv": row.bytes_recv, "count": row.count,
        "bytes_sent_per_step": row.bytes_sent * row.count, "what": row.what,
    }


def _time_entries(terms, formulas: bool) -> list[dict]:
    """Time terms as their share of the step ("seconds" = time on the critical path).

    A collective appears once: ``seconds`` is its exposed time, ``transfer_seconds`` the
    whole transfer (the rest hides behind compute).
    """
    out = []
    for i, t in enumerate(terms):
        if t.category == "memory" or t.name.endswith("(exposed)"):
            continue
        entry = {"name": t.name, "category": t.category, "seconds": float(t.value)}
        if formulas:
            entry["formula"] = str(t.formula)
        if t.category == "comm":
            partner = terms[i + 1] if i + 1 < len(terms) else None
            if partner is not None and partner.name == t.name + " (exposed)":
                entry["transfer_seconds"] = entry["seconds"]
                entry["seconds"] = float(partner.value)
                if formulas:
                    entry["transfer_formula"] = entry["formula"]
                    entry["formula"] = str(partner.formula)
        out.append(entry)
    return out


def explain_record(cost, *, pp_rank: int | None = None, formulas: bool = False) -> dict:
    """The full breakdown of one scored plan as a JSON-ready dict."""
    plan = cost.plan
    requested = pp_rank
    pp_rank = cost.bottleneck_pp_rank if pp_rank is None else pp_rank
    if not 0 <= pp_rank < plan.pp:
        raise AutoparError(
            f"autopar: --pp-rank {pp_rank} is outside the pipeline; plan '{plan}' has pp ranks "
            f"0..{plan.pp - 1}"
        )
    terms = time_terms(cost, formulas)
    # The memory breakdown is the fullest pp rank's (whose peak is the header's figure) unless one is asked for.
    peak = cost.peak_breakdown(cost.memory_pp_rank if requested is None else pp_rank)
    mem_formulas = {t.name.split(".", 1)[1]: str(t.formula) for t in terms
                    if t.category == "memory"} if formulas else {}
    rows = cost.comm_table(pp_rank)
    by_dim: dict[str, float] = {}
    for r in rows:
        by_dim[r.dimension] = by_dim.get(r.dimension, 0.0) + r.bytes_sent * r.count
    return {
        "plan": str(plan), "model": cost.spec.name, "gpu": cost.cluster.gpu,
        "gpus": cost.cluster.world_size, "seq_len": cost.seq_len,
        "global_batch": cost.global_batch,
        "microbatch_size": cost.global_batch // (plan.dp * plan.mb),
        "microbatches": plan.mb, "step_time_s": cost.step_time, "mfu": cost.mfu,
        "tokens_per_s": cost.tokens_per_s, "memory_per_gpu_bytes": cost.memory_per_gpu,
        "usable_memory_bytes": cost.cluster.usable_memory, "fits": cost.memory_per_gpu <= cost.cluster.usable_memory,
        "bottleneck_pp_rank": cost.bottleneck_pp_rank, "memory_pp_rank": cost.memory_pp_rank,
        "pp_rank": pp_rank,
        "comm": [_row_dict(r) for r in rows],
        "comm_bytes_sent_per_step_by_dimension": by_dim,
        "memory": {name: {"bytes": total, "at_peak_bytes": alive,
                          **({"formula": mem_formulas[name]} if name in mem_formulas else {})}
                   for name, (total, alive) in peak.terms.items()},
        "memory_peak": {"pp_rank": peak.pp_rank, "moment": peak.moment, "what": peak.what,
                        "peak_bytes": peak.peak, "sum_of_terms_bytes": peak.sum_of_terms},
        "time": _time_entries(terms, formulas),
        "dominant_terms": [{"term": n, "seconds": s, "share": s / cost.step_time}
                           for n, s in dominant_terms(cost, terms, top=5)],
        "bubble": {"schedule": plan.schedule if plan.pp > 1 else None, "pp": plan.pp,
                   "seconds": cost.bubble, "fraction_of_step": cost.bubble / cost.step_time},
    }
