"""The README's example runs under torchrun and prints the same losses as one process."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _losses(cmd: list[str]) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)$", out.stdout, re.M)]


def test_train_llama_under_torchrun_matches_one_process():
    script = str(REPO / "examples" / "train_llama.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533"]
    parallel = _losses(torchrun + [script, "--plan", "tp=2,sp", "--steps", "3"])
    single = _losses([sys.executable, script, "--plan", "none", "--steps", "3"])
    assert len(parallel) == len(single) == 3
    assert all(abs(a - b) <= 1e-5 for a, b in zip(parallel, single)), (parallel, single)


def test_train_llama_bf16_matches_the_plain_recipe():
    """``--bf16``: mixed_precision="bf16" under torchrun against the same recipe written by hand."""
    script = str(REPO / "examples" / "train_llama.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29534"]
    parallel = _losses(torchrun + [script, "--plan", "dp=2", "--steps", "3", "--bf16"])
    single = _losses([sys.executable, script, "--plan", "none", "--steps", "3", "--bf16"])
    assert len(parallel) == len(single) == 3
    assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(parallel, single)), (parallel, single)
