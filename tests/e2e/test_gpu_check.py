"""benchmarks/gpu_check.py runs on the CPU with --dry-run: the user's large-model path (a
``save_pretrained`` checkpoint, a meta model, ``pm.load_pretrained``), every pair, and the
cost model's terms next to the measurements (the GPU check is ready for the first GPU)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    out_json = tmp_path / "gpu.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--json",
                          str(out_json)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "autopar/torch" in out.stdout
    result = json.loads(out_json.read_text())
    assert result["checkpoint_files"] >= 2  # sharded, read back by load_pretrained
    pairs = {p["pair"]: p for p in result["pairs"]}
    assert set(pairs) == {"eager", "recompute", "compiled", "recompute_compiled"}
    for p in pairs.values():
        assert p["equal"] and p["ratio"] > 0 and p["autopar_s"] > 0 and p["torch_s"] > 0
        assert "load_pretrained" in p["autopar_side"]
        names = {t["name"] for t in p["predicted"]["terms"]}
        assert "compute.fwd.mlp" in names and "memory.params" in names and "optimizer" in names
        # autopar's meter next to the prediction: the static terms are exact byte counts
        terms = {t["name"]: t["value"] for t in p["predicted"]["terms"]}
        for key in ("params", "grads", "optimizer"):
            assert p["memory_autopar"][key] == terms[f"memory.{key}"], key
        assert all(0 < share < 1 for share in p["optimizer_share"])  # the optimizer's share of each side's step
    assert "checkpoint" in pairs["recompute"]["torch_side"]
    assert pairs["recompute"]["predicted"]["plan"] == "dp=1,recompute=selective"
