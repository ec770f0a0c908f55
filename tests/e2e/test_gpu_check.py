"""benchmarks/gpu_check.py runs on the CPU with --dry-run (the GPU check is ready for the first GPU)."""
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
    eager = next(p for p in result["pairs"] if p["pair"] == "eager")
    assert eager["equal"] and eager["ratio"] > 0 and eager["autopar_s"] > 0
    assert any(p["pair"] == "compiled" for p in result["pairs"])
