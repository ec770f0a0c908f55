"""A warm ``autopar plan`` (README's main job) takes at most 2.5x ``python -c "import torch"``.

Both commands run side by side in fresh interpreters, interleaved so that a busy moment
of the shared machine slows both: each is run once to warm it (the plan run fills the
compiled-formula cache of cost/cache.py, here a fresh directory; both warm the OS page
cache), then the best of 3 timed runs of each is compared. A failing comparison gets up
to 3 more rounds (still best of all runs), so that one burst of load on the shared
cores does not fail it, but a plan run that is slower at its best fails.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "1024", "--seq", "8192",
            "--global-batch", "512"]
BOUND = 2.5


def _plan_command() -> list[str]:
    script = Path(sys.executable).with_name("autopar")  # the console script README runs
    if script.exists():
        return [str(script), *MAIN_JOB]
    return [sys.executable, "-c", "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))",
            *MAIN_JOB]


def _seconds(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-2000:]
    return elapsed


def test_warm_plan_within_bound_of_import_torch(tmp_path):
    env = dict(os.environ, AUTOPAR_CACHE_DIR=str(tmp_path / "cache"))
    plan, torch = _plan_command(), [sys.executable, "-c", "import torch"]
    cold = _seconds(plan, env)
    _seconds(torch, env)
    assert list((tmp_path / "cache").glob("*.json")), "the cold run stored no compiled formulas"
    plans, torches = [], []
    for round_ in range(6):
        plans.append(_seconds(plan, env))
        torches.append(_seconds(torch, env))
        if round_ >= 2 and min(plans) <= BOUND * min(torches):
            break
    assert min(plans) <= BOUND * min(torches), (
        f"warm autopar plan best {min(plans):.2f} s (cold {cold:.2f} s) > {BOUND} x import torch best "
        f"{min(torches):.2f} s; runs: plan {plans}, torch {torches}")
