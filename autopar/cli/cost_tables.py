"""The tables of ``autopar plan`` and ``autopar explain``: a cost's terms as records and as text.

:func:`plan_record` / :func:`format_plan_table` (a ranked plan: step time, MFU, memory, the
dominant terms of its step) and :func:`explain_record` / :func:`format_explain` (one plan's
collectives, memory by term, time budget and bubble, optionally with each term's formula), from a
:class:`autopar.cost.Cost` alone: the JSON a command prints and the text are the same record.
Neighbours: autopar/cli/plan_cmd.py (the commands, which call these), ``autopar.cost`` (the terms).
"""
from __future__ import annotations

from autopar.errors import AutoparError

__all__ = ["dominant_terms", "plan_record", "format_plan_table", "explain_record", "format_explain"]

_GIB = 2.0**30
_MIB = 2.0**20


# ---------------------------------------------------------------------- cost terms
def _time_terms(cost, formulas: bool):
    """The terms of ``cost.breakdown()``, with their sympy formulas only when asked for."""
    return cost.breakdown(formulas=formulas)


def _group_of(term) -> str | None:
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
    terms = _time_terms(cost, False) if terms is None else terms
    totals: dict[str, float] = {}
    for t in terms:
        group = _group_of(t)
        if group is not None and t.value > 0:
            totals[group] = totals.get(group, 0.0) + float(t.value)
    return sorted(totals.items(), key=lambda kv: -kv[1])[:top]



# ---------------------------------------------------------------------- plan
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


def format_plan_table(records: list[dict]) -> str:
    """Readable ranked table of :func:`plan_record` dicts."""
    width = max([len("plan")] + [len(r["plan"]) for r in records])
    head = (f"{'#':>3}  {'plan':<{width}}  {'step':>9}  {'MFU':>6}  {'mem/GPU':>9}  "
            f"{'tokens/s':>11}  dominant terms (share of step)")
    lines = ["mem/GPU: the step's peak on the fullest pp rank (`autopar explain --plan P` shows it term by term)",
             head, "-" * len(head)]
    for r in records:
        dom = ", ".join(f"{d['term']} {d['share'] * 100:.0f}%" for d in r["dominant_terms"])
        lines.append(
            f"{r['rank']:>3}  {r['plan']:<{width}}  {_fmt_time(r['step_time_s']):>9}  "
            f"{r['mfu'] * 100:>5.1f}%  {r['memory_per_gpu_bytes'] / _GIB:>5.1f} GiB  "
            f"{r['tokens_per_s']:>11,.0f}  {dom}"
        )
    return "\n".join(lines)



# ---------------------------------------------------------------------- explain
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
    terms = _time_terms(cost, formulas)
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


def format_explain(rec: dict) -> str:
    """Readable report of :func:`explain_record`."""
    out = [
        f"plan {rec['plan']}   model {rec['model']}   {rec['gpus']} x {rec['gpu']}   seq "
        f"{rec['seq_len']}   global batch {rec['global_batch']} "
        f"({rec['microbatches']} micro-batches of {rec['microbatch_size']} per replica)",
        f"  step time {_fmt_time(rec['step_time_s'])}   MFU {rec['mfu'] * 100:.1f}%   "
        f"{rec['tokens_per_s']:,.0f} tokens/s",
        f"  memory/GPU {_fmt_bytes(rec['memory_per_gpu_bytes'])}: the peak of pp rank {rec['memory_pp_rank']}, "
        f"the fullest, of {_fmt_bytes(rec['usable_memory_bytes'])} usable "
        f"({'fits' if rec['fits'] else 'DOES NOT FIT'})",
        "",
        f"Collectives of one rank of pp rank {rec['pp_rank']} per optimizer step "
        f"(bytes sent/received per call, ring convention)",
    ]
    head = (f"  {'phase':<5} {'dim':<13} {'collective':<14} {'axis':<5} {'n':>4} "
            f"{'sent/call':>11} {'recv/call':>11} {'calls':>6} {'sent/step':>11}  what")
    out += [head, "  " + "-" * (len(head) - 2)]
    for r in rec["comm"]:
        out.append(
            f"  {r['phase']:<5} {r['dimension']:<13} {r['collective']:<14} {r['axis']:<5} "
            f"{r['group_size']:>4} {_fmt_bytes(r['bytes_sent']):>11} "
            f"{_fmt_bytes(r['bytes_recv']):>11} {r['count']:>6} "
            f"{_fmt_bytes(r['bytes_sent_per_step']):>11}  {r['what']}"
        )
    if not rec["comm"]:
        out.append("  (none: a single rank issues no collectives)")
    total = sum(rec["comm_bytes_sent_per_step_by_dimension"].values())
    if total:
        out.append("  sent per step by dimension: " + ", ".join(
            f"{d} {_fmt_bytes(v)}" for d, v in sorted(
                rec["comm_bytes_sent_per_step_by_dimension"].items(), key=lambda kv: -kv[1])))
    out += ["", *_format_memory(rec)]
    out += ["", "Time per step on the slowest pp rank (exposed = on the critical path; "
            "the rest of a transfer hides behind compute)"]
    for t in sorted(rec["time"], key=lambda t: (-t["seconds"], -t.get("transfer_seconds", 0))):
        if t["seconds"] <= 0 and t.get("transfer_seconds", 0) <= 0:
            continue
        line = f"  {t['name']:<36} {_fmt_time(t['seconds']):>10}"
        if "transfer_seconds" in t:
            line += f"  (transfer {_fmt_time(t['transfer_seconds'])})"
        out.append(line + (f"   = {t['formula']}" if "formula" in t else ""))
    out.append(f"  {'step':<36} {_fmt_time(rec['step_time_s']):>10}")
    out.append("  largest shares of the step: " + ", ".join(
        f"{d['term']} {d['share'] * 100:.1f}%" for d in rec["dominant_terms"]))
    b = rec["bubble"]
    out += ["", "Pipeline bubble"]
    if b["pp"] > 1:
        out.append(f"  {b['schedule']} over {b['pp']} stages: {_fmt_time(b['seconds'])} "
                   f"({b['fraction_of_step'] * 100:.1f}% of the step)")
    else:
        out.append("  none (no pipeline parallelism)")
    return "\n".join(out)


def _format_memory(rec: dict) -> list[str]:
    """The memory breakdown of :func:`explain_record`: each term and its part alive at the rank's
    peak (marked ``*``), the ``peak`` line (their sum: the header's figure for the fullest rank)
    and the sum of every term, labelled as one."""
    peak = rec["memory_peak"]
    fullest = peak["pp_rank"] == rec["memory_pp_rank"]
    out = [f"Memory per GPU, pp rank {peak['pp_rank']}"
           + (" (the fullest: its peak is the header's memory/GPU)" if fullest else "")
           + f"; * = alive at the peak, {peak['what']}",
           f"  {'term':<22} {'bytes':>11} {'at the peak':>12}"]
    for name, m in rec["memory"].items():
        if m["bytes"] <= 0:
            continue
        mark = "*" if m["at_peak_bytes"] > 0 else " "
        line = f"  {name:<22} {_fmt_bytes(m['bytes']):>11} {_fmt_bytes(m['at_peak_bytes']):>12} {mark}"
        out.append(line + (f"   = {m['formula']}" if "formula" in m else ""))
    out.append(f"  {'peak':<22} {_fmt_bytes(peak['peak_bytes']):>11}   (the terms' parts alive at the peak)")
    out.append(f"  {'sum of all terms':<22} {_fmt_bytes(peak['sum_of_terms_bytes']):>11}   "
               "(a sum, not a peak: the terms are never all alive at once)")
    return out


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", _MIB), ("KiB", 1024.0)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"
