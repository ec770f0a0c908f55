"""The report's HTML: one self-contained page per plan, and the index of ``autopar plan --report``.

:func:`plan_html` writes :func:`autopar.views.report.plan_page`'s model as one HTML document: inline CSS,
the figures of autopar/views/report_plots.py as inline SVG, the tables with every number also in a
``data-value`` attribute (exact, for tests), the explain record as JSON in a ``<script
type="application/json">``, and one small inline script that marks each section rendered (the
browser test, tests/e2e/test_report_browser.py, reads the marks).  Nothing refers to the network.
:func:`index_html` is the side-by-side table of the top plans of a search, linking each plan's page.

Neighbours: autopar/views/report.py (the numbers), autopar/cli/report_cmd.py and
autopar/runtime/report.py (who writes the files).
"""
from __future__ import annotations

import html
import json

from autopar.views import report_plots as plots

__all__ = ["plan_html", "index_html", "fmt_bytes", "fmt_time"]

_GIB = 2.0**30

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1180px;padding:12px 20px;
color:#222}
h1{font-size:1.4em;margin:.3em 0} h2{font-size:1.15em;border-bottom:1px solid #ddd;padding-bottom:3px}
section{margin:18px 0} table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right} th{background:#f5f5f5}
td.l,th.l{text-align:left} tr[title]{cursor:help} .note{color:#555;font-size:13px}
svg{max-width:100%;height:auto} .fit{color:#2a7} .nofit{color:#c33;font-weight:bold}
#render-status{font-size:11px;color:#888}
"""

_SCRIPT = """
(function () {
  var sections = document.querySelectorAll("section[data-section]");
  var done = 0;
  sections.forEach(function (s) {
    var body = s.querySelector("svg, table, p.note");
    if (body && s.getBoundingClientRect().height > 0) { s.setAttribute("data-rendered", "yes"); done += 1; }
  });
  var status = document.getElementById("render-status");
  status.textContent = "rendered " + done + " of " + sections.length + " sections";
  status.setAttribute("data-ok", done === sections.length ? "yes" : "no");
})();
"""


def fmt_time(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if abs(t) < 1 else f"{t:.3f} s"


def fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", 2.0**20), ("KiB", 1024.0)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def _cell(text, value=None, key: str | None = None, left: bool = False) -> str:
    attrs = ' class="l"' if left else ""
    if value is not None:
        attrs += f' data-value="{value!r}"'
    if key:
        attrs += f' data-key="{html.escape(key)}"'
    return f"<td{attrs}>{html.escape(str(text))}</td>"


def _table(head: list[str], rows: list[str], key: str) -> str:
    cells = "".join(f'<th class="{"l" if i == 0 else ""}">{html.escape(h)}</th>' for i, h in enumerate(head))
    return f'<table data-table="{key}"><tr>{cells}</tr>{"".join(rows)}</table>'


def _section(key: str, title: str, body: str) -> str:
    return f'<section id="{key}" data-section="{key}"><h2>{html.escape(title)}</h2>{body}</section>'


def _document(title: str, sections: list[str], data: dict | None = None) -> str:
    blob = "" if data is None else ('<script type="application/json" id="autopar-record">'
                                    + json.dumps(data, default=str).replace("</", "<\\/") + "</script>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{''.join(sections)}{blob}"
            f'<p id="render-status" data-ok="no">not rendered</p><script>{_SCRIPT}</script></body></html>\n')


def _summary(page: dict) -> str:
    rec = page["record"]
    fits = f'<span class="{"fit" if rec["fits"] else "nofit"}">{"fits" if rec["fits"] else "DOES NOT FIT"}</span>'
    rows = [
        ("plan", rec["plan"], None, None), ("model", rec["model"], None, None),
        ("GPUs", f"{rec['gpus']} x {rec['gpu']}", rec["gpus"], "gpus"),
        ("sequence, global batch", f"{rec['seq_len']}, {rec['global_batch']} ({rec['microbatches']} micro-batches "
         f"of {rec['microbatch_size']} per replica)", None, None),
        ("step time", fmt_time(rec["step_time_s"]), rec["step_time_s"], "step_time_s"),
        ("MFU", f"{rec['mfu'] * 100:.1f}%", rec["mfu"], "mfu"),
        ("tokens/s", f"{rec['tokens_per_s']:,.0f}", rec["tokens_per_s"], "tokens_per_s"),
        ("memory/GPU", f"{fmt_bytes(rec['memory_per_gpu_bytes'])} (pp rank {rec['memory_pp_rank']}, the fullest)",
         rec["memory_per_gpu_bytes"], "memory_per_gpu_bytes"),
        ("usable memory", fmt_bytes(rec["usable_memory_bytes"]), rec["usable_memory_bytes"], "usable_memory_bytes"),
        ("bubble", fmt_time(rec["bubble"]["seconds"]), rec["bubble"]["seconds"], "bubble_s"),
    ]
    body = [f"<tr>{_cell(k, left=True)}{_cell(t, v, key, left=True)}</tr>" for k, t, v, key in rows]
    body.append(f'<tr>{_cell("fits", left=True)}<td class="l">{fits}</td></tr>')
    hw = rec.get("hardware", {}).get("line", "")
    note = f'<p class="note">{html.escape(hw)}</p>' if hw else ""
    src = f'<p class="note">{html.escape(page["source"])}</p>' if page.get("source") else ""
    return _section("summary", "Summary", _table(["", ""], body, "summary") + note + src)


def _schedule(page: dict) -> str:
    sched = page["schedule"]
    if sched is None:
        body = '<p class="note">No pipeline (pp=1): every rank runs its micro-batches in turn, no bubble.</p>'
    else:
        idle = ", ".join(f"rank {r}: {n}" for r, n in enumerate(sched["idle_steps"]))
        body = (plots.schedule_svg(sched) + f'<p class="note">{html.escape(sched["schedule"])}: pp={sched["pp"]}, '
                f'mb={sched["mb"]}, {sched["chunks"]} model chunks, {sched["steps"]} unit steps; idle steps per pp '
                f'rank (the bubble): {html.escape(idle)}. The order is the one the runtime executes '
                '(autopar/ops/schedules.py); each action is drawn one unit long, so this is the order, not the '
                'durations (the step time below prices them).</p>')
    return _section("schedule", "Pipeline schedule", body)


def _memory(page: dict) -> str:
    rec, mem = page["record"], page["memory"]
    rows = []
    for name, m in rec["memory"].items():
        if m["bytes"] <= 0:
            continue
        rows.append(f'<tr title="{html.escape(m.get("formula", ""))}">{_cell(name, left=True)}'
                    f'{_cell(fmt_bytes(m["bytes"]), m["bytes"], "memory." + name)}'
                    f'{_cell(fmt_bytes(m["at_peak_bytes"]), m["at_peak_bytes"], "at_peak." + name)}</tr>')
    peak = rec["memory_peak"]
    rows.append(f'<tr>{_cell("peak", left=True)}{_cell("")}'
                f'{_cell(fmt_bytes(peak["peak_bytes"]), peak["peak_bytes"], "peak_bytes")}</tr>')
    note = (f'<p class="note">The peak is {html.escape(peak["what"])} ({html.escape(peak["moment"])}). Hover a '
            'row or a band for its formula.</p>')
    return _section("memory", f"Memory of pp rank {mem['pp_rank']} over the step",
                    plots.memory_svg(mem) + note + _table(["term", "bytes", "alive at the peak"], rows, "memory"))


def _comm(page: dict) -> str:
    rec = page["record"]
    if not rec["comm"]:
        return _section("comm", "Collectives", '<p class="note">None: a single rank issues no collectives.</p>')
    rows = []
    for i, r in enumerate(rec["comm"]):
        rows.append(f'<tr title="{html.escape(r["what"])}">{_cell(r["phase"], left=True)}'
                    f'{_cell(r["dimension"], left=True)}{_cell(r["collective"], left=True)}{_cell(r["axis"], left=True)}'
                    f'{_cell(r["group_size"])}{_cell(fmt_bytes(r["bytes_sent"]), r["bytes_sent"], f"comm{i}.sent")}'
                    f'{_cell(r["count"], r["count"], f"comm{i}.count")}'
                    f'{_cell(fmt_bytes(r["bytes_sent_per_step"]), r["bytes_sent_per_step"], f"comm{i}.per_step")}</tr>')
    table = _table(["phase", "dim", "collective", "axis", "n", "sent/call", "calls", "sent/step"], rows, "comm")
    return _section("comm", f"Collectives of one rank of pp rank {rec['pp_rank']} per step",
                    plots.comm_svg(page["comm"]) + table)


def _time(page: dict) -> str:
    rec = page["record"]
    rows = []
    for i, t in sorted(enumerate(rec["time"]), key=lambda it: -it[1]["seconds"]):  # i: explain's order
        if t["seconds"] <= 0 and t.get("transfer_seconds", 0) <= 0:
            continue
        rows.append(f'<tr title="{html.escape(t.get("formula", ""))}">{_cell(t["name"], left=True)}'
                    f'{_cell(fmt_time(t["seconds"]), t["seconds"], f"time{i}")}'
                    f'{_cell(fmt_time(t["transfer_seconds"]) if "transfer_seconds" in t else "")}</tr>')
    table = _table(["term (hover: formula)", "on the critical path", "whole transfer"], rows, "time")
    return _section("time", "Step time: compute, exposed communication, bubble, optimizer",
                    plots.time_svg(page["time"], rec["step_time_s"]) + table)


def _measured(page: dict) -> str:
    rows = page["measured"]
    if not rows:
        return _section("measured", "Predicted against measured", '<p class="note">No measurement on this page: '
                        '<code>autopar report --measure MODULE:FUNCTION --world N</code> or <code>--simulate</code>, '
                        'or <code>pm.report(path)</code> after a step, add one.</p>')
    body = []
    for r in rows:
        pred, meas, unit = r["predicted"], r["measured"], r["unit"]
        show = (lambda v: fmt_bytes(v)) if unit == "bytes" else (lambda v: f"{v:.4g} {unit}")
        diff = f"{(meas - pred) / pred * 100:+.1f}%" if pred else "-"
        body.append(f"<tr>{_cell(r['source'], left=True)}{_cell(r['name'], left=True)}"
                    f"{_cell('-' if pred is None else show(pred), pred)}{_cell(show(meas), meas)}{_cell(diff)}</tr>")
    figure = plots.measured_svg(rows) if any(r["predicted"] for r in rows) else ""
    return _section("measured", "Predicted against measured",
                    figure + _table(["source", "quantity", "predicted", "measured", "difference"], body, "measured"))


def plan_html(page: dict) -> str:
    """The whole page of one plan."""
    sections = [_summary(page),
                _section("mesh", "Mesh: ranks to (pp, dp, cp, tp, ep)", plots.mesh_svg(page["mesh"])),
                _schedule(page), _memory(page), _comm(page), _time(page), _measured(page)]
    return _document(page["title"], sections, page["record"])


def index_html(title: str, records: list[dict], usable_bytes: float, links: dict[int, str], note: str) -> str:
    """The top plans of a search side by side (``autopar plan``'s records), each linked to its page."""
    rows = []
    for r in records:
        plan = html.escape(r["plan"])
        name = f'<a href="{html.escape(links[r["rank"]])}">{plan}</a>' if r["rank"] in links else plan
        dom = ", ".join(f"{d['term']} {d['share'] * 100:.0f}%" for d in r["dominant_terms"])
        mfu, tokens = f"{r['mfu'] * 100:.1f}%", f"{r['tokens_per_s']:,.0f}"
        rows.append(f"<tr>{_cell(r['rank'])}<td class=\"l\">{name}</td>"
                    f"{_cell(fmt_time(r['step_time_s']), r['step_time_s'])}{_cell(mfu, r['mfu'])}"
                    f"{_cell(fmt_bytes(r['memory_per_gpu_bytes']), r['memory_per_gpu_bytes'])}"
                    f"{_cell(tokens, r['tokens_per_s'])}{_cell(dom, left=True)}</tr>")
    table = _table(["#", "plan", "step", "MFU", "mem/GPU", "tokens/s", "dominant terms (share of step)"],
                   rows, "plans")
    body = plots.plans_svg(records, usable_bytes) + f'<p class="note">{html.escape(note)}</p>' + table
    return _document(title, [_section("plans", "Top plans", body)], {"plans": records})
