"""``autopar calibrate --quick --device cpu --world 2`` measures this machine for real (matrix
products, memory bandwidth, a decoder layer's element-wise kernels, causal attention, an AdamW step,
gloo collectives and their overlap with compute on 2 spawned ranks; about 15 s on 2 cores, killed
after 150 s), and the profile it writes loads, and plans through ``autopar plan --hardware``.
The format and the fits are tests/unit/test_profile.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autopar.cli import main
from autopar.cost import Cluster, ModelSpec, estimate
from autopar.cost.profile import FIGURES, load_profile

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150  # --quick takes ~15 s here; a hung rank must not hold the suite

# A small Llama (hidden 256, 4 layers) that fits two CPU ranks.
TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


def test_calibrate_quick_cpu(tmp_path, capsys):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-c", "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))",
           "calibrate", "--quick", "--device", "cpu", "--world", "2", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stderr[-3000:]
    for progress in ("autopar calibrate: matrix product", "autopar calibrate: memory copy",
                     "all-reduce over 2 ranks", "all-gather over 2 ranks", "reduce-scatter over 2 ranks"):
        assert progress in run.stderr
    assert f"-> {out}" in run.stdout and "peak_flops" in run.stdout

    profile = load_profile(out)
    assert profile["device"] == "cpu" and profile["gpus_per_node"] == 2
    assert profile["source"] == "measured by autopar calibrate"
    assert {"hostname", "torch", "date"} <= set(profile["machine"])
    # plausible for any CPU: FLOP/s, bytes/s, seconds
    assert 1e8 < profile["peak_flops"] < 1e14 and profile["gemm_efficiency"] == 1.0
    assert 1e8 < profile["hbm_bandwidth"] < 1e13 and profile["hbm_bytes"] > 2**28
    assert 1e6 < profile["intra_node_bandwidth"] < 1e13 and 0 <= profile["intra_node_latency"] < 1e-2
    assert profile["inter_node_bandwidth"] == profile["intra_node_bandwidth"]
    # the optional figures: eager element-wise kernels, torch's AdamW step, the overlap, the host
    assert 1e7 < profile["elementwise_bandwidth"] < 1e13 and 1e7 < profile["optimizer_bandwidth"] < 1e13
    assert 0 <= profile["comm_overlap"] <= 1 and profile["threads_per_rank"] >= 1 and profile["host_cores"] >= 1
    assert 0.1 < profile["attention_factor"] < 100
    for progress in ("element-wise kernels of a decoder layer", "optimizer step (gradients accumulated",
                     "causal attention (", "under matrix products"):
        assert progress in run.stderr
    assert any("one host" in note for note in profile["notes"])
    measured = profile["measured"]
    assert measured["quick"] and measured["collectives"]["group_sizes"] == [2]
    samples = measured["collectives"]["samples"]
    assert {s["collective"] for s in samples} == {"all_reduce", "all_gather", "reduce_scatter"} and len(samples) == 12
    for collective in ("all_reduce", "all_gather", "reduce_scatter"):
        assert profile[f"{collective}_bandwidth"] == measured["collectives"]["by_collective"][collective]["bandwidth"]
    assert max(r["flop_per_s"] for r in measured["gemm"]) == profile["peak_flops"]

    cluster = Cluster.from_profile(out)
    assert cluster.world_size == 2 and all(getattr(cluster, n) == profile[n] for n in FIGURES)
    full = 2 * profile["threads_per_rank"] >= profile["host_cores"]  # every core computing: no overlap (host_share)
    assert cluster.comm_overlap == (0.0 if full else profile["comm_overlap"])
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    spec = ModelSpec.from_hf_config(tmp_path / "config.json")
    assert estimate(spec, cluster, "dp=2", seq_len=256, global_batch=4, dtype_bytes=4).step_time > 0
    rc = main(["plan", "--hardware", str(out), "--model", str(tmp_path / "config.json"), "--gpus", "2",
               "--seq", "256", "--global-batch", "4", "--top", "3", "--json", "--no-progress"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plans"] and data["hardware"]["profile"] == str(out) and data["gpu"] == "cpu (measured)"
