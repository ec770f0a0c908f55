"""Scale simulation: hidden-8192 Llama ranks on the meta device under fake worlds.

The program of one rank is compiled and stepped in one process (autopar/verification/scale.py, the engine of
benchmarks/scale_simulation.py); every collective the rank records must equal the cost model's calls and bytes, and its
parameter bytes the cost model's parameter memory.  Each case runs in a subprocess so the
fake process group stays there: a tp/sp/dp plan, a rank in the middle of a pipelined
plan with cp and ZeRO-1 (its pipeline stage is what compiles), a Mixtral-shaped rank
with experts over ep inside a pipeline stage (balanced routing on meta), and a ZeRO-2 rank of
an interleaved pipeline whose 1 GiB gradient buckets span chunks.  Calls are compared too: the
gradient collectives run once per bucket (``bucket_bytes``), which cost/buckets.py counts; two
cases also check the bucketed calls against counts worked out by hand below.
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
from autopar.verification.scale import compare, simulate
r = simulate({layers}, {plan!r}, 4096, 1, rank={rank}, model={model!r}, bucket_bytes={bucket_bytes},
             log=lambda *a: None)
lines = []
ok = compare(r, out=lines.append)
print(json.dumps({{"ok": ok, "lines": lines, "keys": [list(k) for k in r["measured"]], "pp_rank": r["pp_rank"],
                  "calls": [[*k, v[1]] for k, v in r["measured"].items()]}}))
"""

MiB = 1024 * 1024
CASES = [("tp=8,sp,dp=4", 2, 0, "llama3-70b", 25 * MiB),
         ("tp=4,sp,cp=2:ring,pp=2:interleaved,vpp=2,dp=2,zero=1,mb=4", 4, 21, "llama3-70b", 25 * MiB),
         # MoE on meta routes evenly (balanced counts); experts over ep inside a pipeline stage.
         ("tp=2,sp,pp=2,dp=4,ep=4,zero=1,mb=4", 4, 9, "mixtral-8x7b", 25 * MiB),
         ("tp=8,sp,pp=2:interleaved,vpp=2,dp=2,zero=2,mb=4", 4, 0, "llama3-70b", 1024 * MiB)]

# Bucketed calls worked out by hand (fp32, llama3-70b at tp=8: per layer q and o 32 MiB, k and v
# 4 MiB, gate, up and down 112 MiB, two norms of 32 KiB; token table and LM head 501 MiB).
#  * tp=8,sp,dp=4, 2 layers, 25 MiB buckets, in backward's order: the head; the final norm with
#    layer 1's norms; then per layer down, up, gate, o, k+v (8 MiB), q, and layer 0's norms
#    alone; the token table: 1 + 1 + 6 + 1 + 6 + 1 = 16 all-reduces.
#  * ZeRO-2 with 1 GiB buckets, 4 layers in 4 chunks (one each; rank 0 holds chunks 0 and 2):
#    B1 = head, final norm, layer 3, layer 2's norms and down (1021 MiB); B2 = layer 2's up
#    to q, layer 1, layer 0's norms, down and up; B3 = layer 0's gate to q, the token table.
#    Rank 0 has tensors in all three, of chunk 2 in B1, chunks 2 and 0 in B2, chunk 0 in B3:
#    4 units, so 4 gathers after the step and 4 reduce-scatters in each of the 4 micro-batches.
HAND_CALLS = {"tp=8,sp,dp=4": {("grad", "all_reduce", "dp"): 16},
              "tp=8,sp,pp=2:interleaved,vpp=2,dp=2,zero=2,mb=4": {("grad", "reduce_scatter", "dp"): 16,
                                                                  ("step", "all_gather", "dp"): 4}}


@pytest.mark.parametrize("plan,layers,rank,model,bucket_bytes", CASES, ids=[c[0] for c in CASES])
def test_full_width_rank_bytes_equal_cost_model(plan, layers, rank, model, bucket_bytes):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = _SCRIPT.format(repo=str(REPO), layers=layers, plan=plan, rank=rank, model=model,
                            bucket_bytes=bucket_bytes)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["ok"], "\n".join(r["lines"])
    keys = {tuple(k) for k in r["keys"]}
    calls = {tuple(c[:3]): c[3] for c in r["calls"]}
    for key, expected in HAND_CALLS.get(plan, {}).items():
        assert calls.get(key) == expected, (key, calls.get(key), expected)
    assert ("fwd", "all_gather", "tp") in keys
    if "ep=" in plan:
        assert ("fwd", "all_to_all", "ep") in keys and ("bwd", "all_to_all", "ep") in keys
    if "pp=2" in plan and model == "llama3-70b":
        assert r["pp_rank"] == rank // 16 and any(k[2] == "pp" for k in keys)
    if "cp=2" in plan:
        assert any(k[2] == "dp_cp" for k in keys)
