"""Peak memory of ``pm.load_pretrained`` and ``pm.export_weights`` on 4 gloo ranks, measured by the OS.

``benchmarks/load_memory.py``, run as a script, writes a Llama-shaped checkpoint (hidden 512,
8 layers, vocab 8192: 128.5 MiB fp32, at least 8x the overhead allowance below), builds it on
the meta device on each of 4 ranks under ``tp=2,pp=2,mb=2``, and meters each rank's peak resident set
during the load and during the export (``VmHWM`` reset through ``/proc/self/clear_refs``).
Every rank must stay within 1.5x its share of the parameters plus a fixed allowance: no rank
holds the full model.  A rank that built the full state dict (the export before streaming,
``pm.state_dict()`` on every rank; or a load through ``load_file`` and ``load_state_dict``)
peaks above the model's size and fails here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
MB = 2**20
OVERHEAD = 16 * MB  # one read block (safetensors_io.BLOCK_BYTES) and the process's own noise
FACTOR = 1.5


def test_no_rank_holds_the_full_model_while_loading_or_exporting(tmp_path):
    # The benchmark as a script, its checkpoint and export under tmp_path (TMPDIR).
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "load_memory.py"), "--world", "4",
                          "--plan", "tp=2,pp=2,mb=2", "--hidden", "512", "--layers", "8", "--vocab", "8192",
                          "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout[out.stdout.rfind("\n[\n") + 1:])  # the reports end the output
    model = reports[0]["model_bytes"]
    assert model >= 8 * OVERHEAD
    for r in reports:
        bound = FACTOR * r["share"] + OVERHEAD
        assert r["share"] < model / 2  # each rank holds a part of the model
        assert r["load_peak"] <= bound, (r["rank"], r["load_peak"] / MB, r["share"] / MB)
        assert r["export_peak"] <= bound, (r["rank"], r["export_peak"] / MB, r["share"] / MB)
    assert sum(r["load_peak"] for r in reports) > model / 2  # the meter sees the shares being filled
