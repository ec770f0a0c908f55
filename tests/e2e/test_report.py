"""``autopar report``, ``autopar plan --report`` and ``pm.report``: the page's numbers are explain's.

The page of a pipeline plan is written through the CLI, its tables read back (each number is in a
``data-value`` attribute, exactly) and compared with what ``autopar explain`` prints for the same plan,
as JSON and as text.  ``plan --report`` writes the index of the top plans, linking the winner's page;
``examples/train_llama.py --report`` (``pm.report`` on 2 gloo ranks) writes a page whose measured
collectives equal the prediction.  The page in a browser: tests/e2e/test_report_browser.py.
"""
from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import cli

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]
JOB = ["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "16"]
PLAN = "tp=2,sp,pp=2:interleaved,vpp=2,dp=2,mb=4"


class _Values(html.parser.HTMLParser):
    """Every ``data-key`` cell's ``data-value``, and the embedded explain record."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, float] = {}
        self.sections: list[str] = []
        self._record = False
        self.record = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-key" in a and "data-value" in a:
            self.values[a["data-key"]] = float(a["data-value"])
        if tag == "section":
            self.sections.append(a.get("data-section"))
        self._record = tag == "script" and a.get("id") == "autopar-record"

    def handle_data(self, data):
        if self._record:
            self.record += data


def _read(path: Path) -> _Values:
    parser = _Values()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _run(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def test_page_numbers_equal_explains(capsys, tmp_path):
    explained = json.loads(_run(capsys, "explain", *JOB, "--plan", PLAN, "--json"))
    text = _run(capsys, "explain", *JOB, "--plan", PLAN)
    _run(capsys, "report", *JOB, "--plan", PLAN, "-o", str(tmp_path / "plan.html"))
    page = _read(tmp_path / "plan.html")
    assert page.sections == ["summary", "mesh", "schedule", "memory", "comm", "time", "measured"]
    v = page.values
    for key in ("step_time_s", "mfu", "tokens_per_s", "memory_per_gpu_bytes", "usable_memory_bytes", "gpus"):
        assert v[key] == explained[key], key
    assert v["bubble_s"] == explained["bubble"]["seconds"]
    shown = {name: m for name, m in explained["memory"].items() if m["bytes"] > 0}
    assert {k[len("memory."):] for k in v if k.startswith("memory.")} == set(shown)
    for name, m in shown.items():
        assert (v[f"memory.{name}"], v[f"at_peak.{name}"]) == (m["bytes"], m["at_peak_bytes"]), name
    assert v["peak_bytes"] == explained["memory_peak"]["peak_bytes"]
    assert len(explained["comm"]) > 5
    for i, row in enumerate(explained["comm"]):
        assert (v[f"comm{i}.sent"], v[f"comm{i}.count"], v[f"comm{i}.per_step"]) == (
            row["bytes_sent"], row["count"], row["bytes_sent_per_step"]), row
    for i, t in enumerate(explained["time"]):
        if t["seconds"] > 0:
            assert v[f"time{i}"] == t["seconds"], t["name"]
    record = json.loads(page.record)
    assert {k: record[k] for k in ("plan", "comm", "memory_peak", "bubble")} == \
        {k: explained[k] for k in ("plan", "comm", "memory_peak", "bubble")}
    # The text explain prints: the same rounded figures stand on the page.
    step = re.search(r"step time (\S+ m?s)\s+MFU (\S+%)", text)
    body = (tmp_path / "plan.html").read_text()
    assert f">{step.group(1)}<" in body and f">{step.group(2)}<" in body


def test_plan_report_writes_the_index_and_the_winners_page(capsys, tmp_path):
    out = _run(capsys, "plan", *JOB, "--top", "3", "--no-progress", "--report", str(tmp_path / "r"), "--json")
    best = json.loads(out)["plans"]
    index = (tmp_path / "r" / "index.html").read_text()
    assert 'href="plan-1.html"' in index
    assert all(p["plan"] in index for p in best)
    winner = _read(tmp_path / "r" / "plan-1.html")
    assert json.loads(winner.record)["plan"] == best[0]["plan"]
    assert winner.values["step_time_s"] == best[0]["step_time_s"]


def test_pm_report_sets_the_measured_step_beside_the_prediction(tmp_path):
    """``pm.report`` on 2 gloo ranks (examples/train_llama.py --report): every collective kind of rank 0
    measured equals its prediction; the step's time is there, measured."""
    page = tmp_path / "cpu.html"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29571",
           str(REPO / "examples" / "train_llama.py"), "--plan", "pp=2,mb=4", "--steps", "2", "--report", str(page)]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    body = page.read_text()
    rows = re.findall(r"<td class=\"l\">pm\.comm_stats\(\)</td><td class=\"l\">([^<]+)</td>(.*?)</tr>", body)
    assert len(rows) >= 2
    for name, cells in rows:
        values = re.findall(r'data-value="([^"]+)"', cells)
        assert len(values) == 2 and float(values[0]) == float(values[1]), (name, cells)
    assert "pm.last_step_stats" in body and "step time" in body
