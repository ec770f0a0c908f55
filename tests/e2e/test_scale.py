"""Scale simulation: a hidden-8192 Llama on the meta device under a fake world of 32 ranks.

The program is compiled and stepped in one process (benchmarks/scale_simulation.py); every
collective this rank records must equal the cost model's bytes, and its parameter bytes the
cost model's parameter memory.  Runs in a subprocess so the fake process group stays there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from benchmarks.scale_simulation import simulate
r = simulate(2, "tp=8,sp,dp=4", 4096, 1, log=lambda *a: None)
print(json.dumps({{"measured": [[list(k), v] for k, v in r["measured"].items()],
                  "predicted": [[list(k), v] for k, v in r["predicted"].items()],
                  "params": [r["param_bytes"], r["predicted_param_bytes"]]}}))
"""


def test_full_width_model_bytes_equal_cost_model():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(REPO))], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    measured = {tuple(k): v for k, v in r["measured"]}
    predicted = {tuple(k): v for k, v in r["predicted"]}
    assert set(measured) == set(predicted)
    for key, value in measured.items():
        assert abs(value - predicted[key]) <= 1e-9 * max(value, 1.0), key
    assert ("fwd", "all_gather", "tp") in measured and measured[("grad", "all_reduce", "dp")] > 1e9
    assert r["params"][0] == r["params"][1]
