"""Writing report pages to disk, and ``autopar plan --report DIR``'s pages.

:func:`write_search_report` is ``plan --report DIR``: ``DIR/index.html``, the top plans of the search
side by side (step time, MFU, memory, the dominant terms), and ``DIR/plan-1.html``, the winner's page
(with ``--check``, its full-width measurements beside the prediction).  It imports no command module:
autopar/cli/plan_cmd.py calls it, and autopar/cli/report_cmd.py (``autopar report``) uses
:func:`write_page`.  The pages themselves: autopar/views/report.py, report_html.py, report_plots.py.
"""
from __future__ import annotations

import os
import sys

__all__ = ["write_page", "write_search_report"]


def write_page(path: str, text: str) -> str:
    """Write ``text`` to ``path`` (its folder made), returning the path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def write_search_report(folder: str, spec, cluster, results, records: list[dict], checked, header: str,
                        hardware: dict) -> str:
    """``plan --report DIR``: the top plans side by side (``DIR/index.html``) and the winner's page
    (``DIR/plan-1.html``; with ``--check``, its full-width measurements beside the prediction)."""
    from autopar.views.report import plan_page, simulated_rows
    from autopar.views.report_html import index_html, plan_html
    from autopar.views.report_plots import pyplot

    pyplot()
    _, winner = results[0]
    measured = simulated_rows(checked[0]) if checked else []
    page = plan_page(winner, hardware=hardware, measured=measured,
                     title=f"autopar plan #1: {winner.plan}", source=header)
    write_page(os.path.join(folder, "plan-1.html"), plan_html(page))
    index = index_html(f"autopar plan: {spec.name} on {cluster.world_size} x {cluster.gpu}", records,
                       cluster.usable_memory, {1: "plan-1.html"}, header)
    path = write_page(os.path.join(folder, "index.html"), index)
    print(f"autopar: wrote {path} and plan-1.html (the winner's page)", file=sys.stderr)
    return path
