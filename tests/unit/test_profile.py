"""Hardware profiles (cost/profile.py): the file format and its errors, ``Cluster.from_profile``,
the fits of ``autopar calibrate`` on synthetic timings, and ``autopar plan|explain --hardware``
against the same figures given to ``Cluster`` and ``search`` directly.  The real measurement is
tests/e2e/test_calibrate.py."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.cost import Cluster, ModelSpec, estimate
from autopar.cost.hardware import GPU_PRESETS
from autopar.cost.profile import (FIGURES, FORMAT, SOURCE, fit_alpha_beta, fit_gemm, fit_memory, load_profile,
                                  save_profile, sent_bytes)
from autopar.errors import AutoparError
from autopar.planning.search import search

# A hand-written profile: an H100-like node with figures no preset has.
FIGS = dict(gemm_efficiency=0.8, peak_flops=600e12, hbm_bytes=64 * 2**30, hbm_bandwidth=2.5e12,
            intra_node_bandwidth=200e9, intra_node_latency=8e-6, inter_node_bandwidth=30e9, inter_node_latency=20e-6)
PLAN_ARGS = ["--model", "llama3-8b", "--gpus", "16", "--seq", "4096", "--global-batch", "32"]


def _profile(**changes) -> dict:
    return {"format": FORMAT, "device": "Test GPU", "gpus_per_node": 4, **FIGS, "notes": ["hand-written"],
            "measured": {}, "machine": {"hostname": "test"}, "source": SOURCE, **changes}


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(_profile(), path)
    return path


def test_figures_are_the_presets():
    assert set(FIGURES) == set(GPU_PRESETS["h100"])


def test_round_trip(profile_path):
    assert load_profile(profile_path) == _profile()
    assert json.loads(profile_path.read_text())["format"] == "autopar-hardware-profile/1"


@pytest.mark.parametrize("content, match", [
    (None, r"does not exist; run `autopar calibrate --out"),
    ("{not json", r"is not readable JSON"),
    ("[1, 2]", r"holds a JSON list; expected an object"),
    (json.dumps(_profile(format="other/2")), r"has \"format\": 'other/2'; expected \"format\": "
                                             r"'autopar-hardware-profile/1'"),
    (json.dumps({k: v for k, v in _profile().items() if k != "format"}), r"has no \"format\" field"),
    (json.dumps({k: v for k, v in _profile().items() if k != "peak_flops"}),
     r"has no 'peak_flops'; expected a number \(FLOP/s\)"),
    (json.dumps(_profile(hbm_bandwidth="2 TB/s")), r"has 'hbm_bandwidth': '2 TB/s'; expected a positive finite"),
    (json.dumps(_profile(intra_node_latency=-1)), r"has 'intra_node_latency': -1; expected a positive"),
    (json.dumps(_profile(gemm_efficiency=1.5)), r"has 'gemm_efficiency': 1.5"),
    (json.dumps(_profile(gpus_per_node=0)), r"has \"gpus_per_node\": 0; expected an integer >= 1"),
    (json.dumps(_profile(device="")), r"has \"device\": ''; expected the name"),
])
def test_bad_files_are_refused(tmp_path, content, match):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(AutoparError, match=r"^autopar: hardware profile '.*p\.json' " + match):
        load_profile(path)
    with pytest.raises(AutoparError, match=match):
        Cluster.from_profile(path)


def test_save_refuses_an_invalid_profile(tmp_path):
    with pytest.raises(AutoparError, match="the profile to save has no 'hbm_bytes'"):
        save_profile({k: v for k, v in _profile().items() if k != "hbm_bytes"}, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_cluster_from_profile(profile_path):
    cluster = Cluster.from_profile(profile_path, num_nodes=2)
    same = Cluster(gpu="Test GPU (measured)", num_nodes=2, gpus_per_node=4, **FIGS)
    assert cluster == same and cluster.profile == str(profile_path) and same.profile is None
    assert cluster.gpu == "Test GPU (measured)" and cluster.world_size == 8
    assert Cluster.from_profile(profile_path, gpus_per_node=2).world_size == 2
    assert Cluster.from_profile(profile_path, peak_flops=1e12).peak_flops == 1e12
    spec = ModelSpec.preset("llama3-8b")
    a, b = (estimate(spec, c, "tp=4,dp=2", seq_len=4096, global_batch=16) for c in (cluster, same))
    assert a.step_time == b.step_time and a.memory_per_gpu == b.memory_per_gpu


def test_a_cpu_profile_is_not_the_cpu_preset(tmp_path):
    path = tmp_path / "cpu.json"
    save_profile(_profile(device="cpu"), path)
    cluster = Cluster.from_profile(path)
    assert cluster.gpu == "cpu (measured)" and cluster.peak_flops == FIGS["peak_flops"]
    assert cluster.peak_flops != GPU_PRESETS["cpu"]["peak_flops"]


# ---------------------------------------------------------------------- fits
def test_alpha_beta_fit_recovers_the_time_model():
    bandwidth, latency, eps = 20e9, 15e-6, 0.9
    samples = []
    for collective in ("all_reduce", "all_gather"):
        for n in (2, 4, 8):
            for nbytes in (2**12, 2**16, 2**20, 2**24):
                sent, passes = sent_bytes(collective, n, nbytes)
                seconds = sent / (bandwidth * eps) + passes * (n - 1) * latency
                samples.append(dict(collective=collective, group=n, bytes=nbytes, seconds=seconds))
    fit = fit_alpha_beta(samples, eps)
    assert fit["bandwidth"] == pytest.approx(bandwidth, rel=1e-9)
    assert fit["latency"] == pytest.approx(latency, rel=1e-9)
    assert all(s["model_seconds"] == pytest.approx(s["seconds"]) for s in fit["samples"])
    # the time model itself prices a collective inside a node the same way
    from autopar.cost.hardware import axis_link_arrays
    cluster = Cluster(gpu="fit", gpus_per_node=8, **{**FIGS, "intra_node_bandwidth": fit["bandwidth"],
                                                     "intra_node_latency": fit["latency"]})
    beta, _, alpha, _ = axis_link_arrays(cluster, "dp", 1, 1, 8, 1, 1, eps)
    sent, passes = sent_bytes("all_reduce", 8, 2**24)
    assert float(sent * beta + passes * alpha) == pytest.approx(sent / (bandwidth * eps) + 2 * 7 * latency)


def test_alpha_beta_fit_clamps_a_negative_latency():
    samples = [dict(collective="all_reduce", group=2, bytes=b, seconds=b / 1e9 - 1e-7) for b in (2**20, 2**24)]
    fit = fit_alpha_beta(samples, 1.0)
    assert fit["latency"] == 0.0 and fit["bandwidth"] == pytest.approx(1e9, rel=0.01)
    with pytest.raises(AutoparError, match="no collective over 2 or more ranks"):
        fit_alpha_beta([], 0.9)


def test_gemm_and_memory_fits():
    gemm = fit_gemm([dict(m=1024, k=1024, n=1024, dtype_bytes=4, seconds=2 * 1024**3 / 100e9),
                     dict(m=4096, k=256, n=1024, dtype_bytes=4, seconds=2 * 4096 * 256 * 1024 / 80e9)],
                    hbm_bandwidth=10e9, kappa=1.0)
    assert gemm["peak_flops"] == pytest.approx(100e9) and gemm["gemm_efficiency"] == 1.0
    big = gemm["samples"][0]
    knee = 1.5 * 4 * 100e9 / 10e9
    assert big["model_flop_per_s"] == pytest.approx(100e9 * 1024 / (1024 + knee))
    mem = fit_memory([dict(kernel="copy", bytes=2**28, bytes_moved=2**29, seconds=0.05),
                      dict(kernel="add", bytes=2**28, bytes_moved=3 * 2**28, seconds=0.07)])
    assert mem["hbm_bandwidth"] == pytest.approx(3 * 2**28 / 0.07)


# ---------------------------------------------------------------------- the CLI
def test_plan_with_a_profile_equals_search_with_its_figures(profile_path, capsys):
    rc = main(["plan", *PLAN_ARGS, "--hardware", str(profile_path), "--top", "5", "--json", "--no-progress"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    cluster = Cluster(gpu="anything", num_nodes=4, gpus_per_node=4, **FIGS)
    expected = search(ModelSpec.preset("llama3-8b"), cluster, 4096, 32, top=5)
    assert [p["plan"] for p in data["plans"]] == [str(plan) for plan, _ in expected]
    assert [p["step_time_s"] for p in data["plans"]] == pytest.approx([c.step_time for _, c in expected], rel=1e-12)
    assert data["gpus_per_node"] == 4 and data["gpu"] == "Test GPU (measured)"
    hw = data["hardware"]
    assert hw["source"] == "measured profile" and hw["profile"] == str(profile_path) and hw["figures"] == FIGS


def test_plan_says_where_the_figures_come_from(profile_path, capsys):
    assert main(["plan", *PLAN_ARGS, "--top", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert ("hardware: h100 preset (published figures; run `autopar calibrate` on your machine for "
            "measured ones)") in out.splitlines()
    assert main(["plan", *PLAN_ARGS, "--gpu", "a100", "--top", "1", "--json", "--no-progress"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["source"] == "published figures" and hw["name"] == "a100" and hw["profile"] is None
    assert hw["figures"] == GPU_PRESETS["a100"]
    assert main(["plan", *PLAN_ARGS, "--hardware", str(profile_path), "--top", "1", "--no-progress"]) == 0
    assert f"hardware: measured profile {profile_path} (Test GPU (measured))" in capsys.readouterr().out


def test_explain_with_a_profile(profile_path, capsys):
    argv = ["explain", *PLAN_ARGS, "--plan", "tp=4,dp=4", "--hardware", str(profile_path)]
    assert main([*argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    expected = estimate(ModelSpec.preset("llama3-8b"), Cluster(gpu="x", num_nodes=4, gpus_per_node=4, **FIGS),
                        "tp=4,dp=4", seq_len=4096, global_batch=32)
    assert rec["step_time_s"] == pytest.approx(expected.step_time, rel=1e-12)
    assert rec["hardware"]["source"] == "measured profile"
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"hardware: measured profile {profile_path} "
                                                     f"(Test GPU (measured))")


def test_gpu_and_hardware_together_are_refused(profile_path, capsys):
    assert main(["plan", *PLAN_ARGS, "--gpu", "h100", "--hardware", str(profile_path)]) == 2
    err = capsys.readouterr().err
    assert "autopar: --gpu h100 and --hardware" in err and "not both" in err
    assert main(["plan", *PLAN_ARGS, "--hardware", str(profile_path.parent / "missing.json")]) == 2
    assert "does not exist; run `autopar calibrate" in capsys.readouterr().err


def test_plan_auto_reads_a_profile_from_the_environment(profile_path, monkeypatch):
    from types import SimpleNamespace

    import autopar.frontend.analyze as analyze
    from autopar.planning import autoplan

    dims = dict(num_layers=2, hidden=256, num_heads=4, vocab=1000, ffn=512)
    monkeypatch.setattr(analyze, "structure_dims", lambda structure: dims)
    monkeypatch.setenv(autoplan.PROFILE_ENV, str(profile_path))
    structure = SimpleNamespace(num_layers=2)
    for world, nodes, per_node in ((2, 1, 2), (8, 2, 4), (6, 1, 6)):
        _, cluster = autoplan._spec_and_cluster(structure, world)
        assert (cluster.num_nodes, cluster.gpus_per_node) == (nodes, per_node)
        assert cluster.profile == str(profile_path) and cluster.peak_flops == FIGS["peak_flops"]
    monkeypatch.delenv(autoplan.PROFILE_ENV)
    assert autoplan._spec_and_cluster(structure, 2)[1].profile is None
