"""The text tables of ``autopar plan`` and ``autopar explain``: their records as readable text.

:func:`format_plan_table` (the ranked plans: step time, MFU, memory, the dominant terms of each
step) and :func:`format_explain` (one plan's collectives, memory by term with the part alive at the
peak, time budget and bubble, optionally with each term's formula).  The records themselves, the
one source of these numbers that the HTML report shares, are :mod:`autopar.views.explain`'s.
Neighbours: autopar/cli/plan_cmd.py (the commands, which print these).
"""
from __future__ import annotations

__all__ = ["format_plan_table", "format_explain"]

_GIB = 2.0**30
_MIB = 2.0**20


# ---------------------------------------------------------------------- plan
def format_plan_table(records: list[dict]) -> str:
    """Readable ranked table of :func:`autopar.views.explain.plan_record` dicts."""
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
def format_explain(rec: dict) -> str:
    """Readable report of :func:`autopar.views.explain.explain_record`."""
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
