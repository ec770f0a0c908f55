"""``autopar explain --simulate`` and ``autopar plan --check``: a plan's fullest rank at full width on
the meta device, under torch's MemTracker and FlopCounterMode, beside the cost model (issue 38).

Each command runs in a subprocess (the fake process group stays there), as a user runs it; the
bounds are the full-width ones of tests/e2e/test_full_width.py: memory within 5%, FLOPs within 2%.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import cli

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")


def _autopar(*argv: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))",
                          *argv, "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _within(r: dict) -> None:
    assert abs(r["predicted_peak"] - r["measured_peak"]) <= 0.05 * r["measured_peak"], r
    assert abs(r["predicted_flops"] - r["measured_flops"]) <= 0.02 * r["measured_flops"], r


def test_explain_simulate_a_zero3_rank_of_70b():
    rec = _autopar("explain", "--model", "llama3-70b", "--plan", "tp=8,sp,dp=16,zero=3", "--gpus", "128",
                   "--seq", "8192", "--global-batch", "16", "--simulate")
    r = rec["simulated"]
    assert (r["layers"], r["model_layers"], r["precision"], r["pp_rank"]) == (2, 80, "bf16", 0)
    _within(r)
    assert r["terms"] and r["measured_categories"] and r["flops_by_op"]
    # all 80 layers: the measured peak plus the model's difference between the depths
    assert r["full_peak"] - r["measured_peak"] == pytest.approx(r["predicted_full_peak"] - r["predicted_peak"])
    assert rec["memory_per_gpu_bytes"] == pytest.approx(r["predicted_full_peak"])


def test_plan_check_steps_the_top_plans():
    data = _autopar("plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "16",
                    "--top", "2", "--check", "2", "--no-progress")
    assert [c["plan"] for c in data["checked"]] == [p["plan"] for p in data["plans"]]
    for r in data["checked"]:
        _within(r)
        assert r["full_peak"] <= r["usable_memory"]  # the search kept plans that fit; the meter agrees


def test_simulate_refuses_what_it_cannot_do(capsys):
    common = ["explain", "--model", "llama3-70b", "--gpus", "128", "--seq", "8192"]
    for argv, message in (
            ([*common, "--global-batch", "16", "--plan", "pp=4,tp=8,dp=4,mb=4", "--simulate", "--simulate-layers", "2"],
             "--simulate-layers 2 must be between the plan's 4 pipeline chunks and the model's 80 layers"),
            (["explain", "--plan", "dp=2", "--measure", "m:f", "--world", "2", "--simulate"], "give one of them"),
            ([*common, "--global-batch", "24", "--plan", "tp=8,dp=16", "--simulate"], "global batch of 24")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("autopar:") and message in err, err
