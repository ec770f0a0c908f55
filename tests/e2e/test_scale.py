"""Scale simulation: hidden-8192 Llama ranks on the meta device under fake worlds.

The program of one rank is compiled and stepped in one process (tests/support/scale.py, the engine of
benchmarks/scale_simulation.py); every collective the rank records must equal the cost model's calls and bytes, and its
parameter bytes the cost model's parameter memory.  Each case runs in a subprocess so the
fake process group stays there: a tp/sp/dp plan, a rank in the middle of a pipelined
plan with cp and ZeRO-1 (its pipeline stage is what compiles), and a Mixtral-shaped rank
with experts over ep inside a pipeline stage (balanced routing on meta).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.support.scale import compare, simulate
r = simulate({layers}, {plan!r}, 4096, 1, rank={rank}, model={model!r}, log=lambda *a: None)
lines = []
ok = compare(r, out=lines.append)
print(json.dumps({{"ok": ok, "lines": lines, "keys": [list(k) for k in r["measured"]], "pp_rank": r["pp_rank"]}}))
"""

CASES = [("tp=8,sp,dp=4", 2, 0, "llama3-70b"),
         ("tp=4,sp,cp=2:ring,pp=2:interleaved,vpp=2,dp=2,zero=1,mb=4", 4, 21, "llama3-70b"),
         # MoE on meta routes evenly (balanced counts); experts over ep inside a pipeline stage.
         ("tp=2,sp,pp=2,dp=4,ep=4,zero=1,mb=4", 4, 9, "mixtral-8x7b")]


@pytest.mark.parametrize("plan,layers,rank,model", CASES, ids=[c[0] for c in CASES])
def test_full_width_rank_bytes_equal_cost_model(plan, layers, rank, model):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = _SCRIPT.format(repo=str(REPO), layers=layers, plan=plan, rank=rank, model=model)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"], "\n".join(r["lines"])
    keys = {tuple(k) for k in r["keys"]}
    assert ("fwd", "all_gather", "tp") in keys
    if "ep=" in plan:
        assert ("fwd", "all_to_all", "ep") in keys and ("bwd", "all_to_all", "ep") in keys
    if "pp=2" in plan and model == "llama3-70b":
        assert r["pp_rank"] == rank // 16 and any(k[2] == "pp" for k in keys) and any(k[2] == "dp_cp" for k in keys)
