"""Hardware profiles (cost/profile.py): the file format and its errors, ``Cluster.from_profile``,
the fits of ``autopar calibrate`` on synthetic timings, a CPU profile's optional figures and its
host's time-sharing, and ``autopar plan|explain --hardware``
against the same figures given to ``Cluster`` and ``search`` directly.  The real measurement is
tests/e2e/test_calibrate.py."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.cost import Cluster, ModelSpec, estimate
from autopar.cost.hardware import GPU_PRESETS
from autopar.cost.profile import (FIGURES, FORMAT, SOURCE, adamw_bytes, attention_model_seconds, fit_alpha_beta,
                                  fit_attention, fit_elementwise, fit_gemm, fit_memory, fit_optimizer, fit_overlap,
                                  layer_elementwise_bytes, load_profile, save_profile, sent_bytes)
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

    import autopar.frontend.model_dims as analyze
    from autopar.planning import autoplan

    dims = dict(num_layers=2, hidden=256, num_heads=4, vocab=1000, ffn=512)
    monkeypatch.setattr(analyze, "structure_dims", lambda structure: dims)
    monkeypatch.setenv(autoplan.PROFILE_ENV, str(profile_path))
    structure = SimpleNamespace(num_layers=2)
    for world, nodes, per_node in ((2, 1, 2), (8, 2, 4)):
        _, cluster = autoplan._spec_and_cluster(structure, world)
        assert (cluster.num_nodes, cluster.gpus_per_node) == (nodes, per_node)
        assert cluster.profile == str(profile_path) and cluster.peak_flops == FIGS["peak_flops"]
    # 6 ranks on nodes of 4 fill no whole nodes: refused by the one rule, never modelled as one node of 6
    with pytest.raises(AutoparError, match="6 GPUs do not fill whole nodes of 4"):
        autoplan._spec_and_cluster(structure, 6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # torchrun's ranks per host: two hosts of 3
    assert (autoplan._spec_and_cluster(structure, 6)[1].num_nodes, 3) == (2, 3)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv(autoplan.PROFILE_ENV)
    assert autoplan._spec_and_cluster(structure, 2)[1].profile is None


# ---------------------------------------------------------------------- optional figures, CPU hosts
CPU_EXTRA = dict(elementwise_bandwidth=4e9, optimizer_bandwidth=5e9, comm_overlap=0.0, host_cores=2, threads_per_rank=1)


def _cpu_profile(tmp_path, **changes):
    path = tmp_path / "cpu.json"
    save_profile(_profile(device="cpu", gpus_per_node=2, **{**CPU_EXTRA, **changes}), path)
    return path


@pytest.mark.parametrize("field, value", [("comm_overlap", 1.5), ("elementwise_bandwidth", 0), ("host_cores", "2"),
                                          ("optimizer_bandwidth", float("nan"))])
def test_bad_optional_figures_are_refused(tmp_path, field, value):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_profile(**{field: value})))
    with pytest.raises(AutoparError, match=f"autopar: hardware profile .* has {field!r}"):
        load_profile(path)


def test_optional_figures_reach_the_cluster(tmp_path):
    cluster = Cluster.from_profile(_cpu_profile(tmp_path))
    assert (cluster.elementwise_bandwidth, cluster.optimizer_bandwidth, cluster.comm_overlap) == (4e9, 5e9, 0.0)
    assert cluster.peak_flops == FIGS["peak_flops"] and cluster.hbm_bytes == FIGS["hbm_bytes"]  # 2 ranks, 2 cores


def test_more_ranks_than_cores_time_share_them(tmp_path):
    """4 one-thread ranks on 2 cores: each gets half a core, so every rate halves and every latency
    doubles; the host's memory is split over 4 ranks instead of 2."""
    path = _cpu_profile(tmp_path)
    two, four = Cluster.from_profile(path), Cluster.from_profile(path, gpus_per_node=4)
    for name in ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                 "elementwise_bandwidth", "optimizer_bandwidth"):
        assert getattr(four, name) == pytest.approx(getattr(two, name) / 2), name
    for name in ("intra_node_latency", "inter_node_latency"):
        assert getattr(four, name) == pytest.approx(getattr(two, name) * 2), name
    assert four.hbm_bytes == pytest.approx(two.hbm_bytes / 2) and four.comm_overlap == 0.0
    assert (two.core_share, four.core_share) == (1.0, 0.5)
    # every core computing leaves none for gloo's threads: no overlap, whatever was measured
    noisy = _cpu_profile(tmp_path, comm_overlap=0.6)
    assert Cluster.from_profile(noisy).comm_overlap == 0.0
    assert Cluster.from_profile(noisy, gpus_per_node=1).comm_overlap == 0.6
    assert Cluster.from_profile(path, gpus_per_node=1).peak_flops == two.peak_flops  # a rank never gets more
    # a GPU profile (no host_cores) is not scaled
    gpu = tmp_path / "gpu.json"
    save_profile(_profile(), gpu)
    assert Cluster.from_profile(gpu, gpus_per_node=8).peak_flops == FIGS["peak_flops"]


def test_measured_figures_price_their_terms(tmp_path):
    """The element-wise and optimizer terms scale with 1 / their bandwidths, and a measured overlap of
    0 leaves plain DP's gradient all-reduce whole on the step (phi 0.8 hides most of it)."""
    spec = ModelSpec(name="t", num_layers=2, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn=512,
                     vocab=1000, gated_mlp=True, tied_embeddings=False, norm="rmsnorm")
    base = Cluster(gpu="cpu-test", gpus_per_node=2, **FIGS)

    def terms(cluster):
        cost = estimate(spec, cluster, "dp=2", seq_len=128, global_batch=8, dtype_bytes=4)
        return {t.name: t.value for t in cost.breakdown(formulas=False)}

    ref = terms(base)
    hbm = FIGS["hbm_bandwidth"]
    slow = terms(base.replace(elementwise_bandwidth=hbm / 3, optimizer_bandwidth=hbm / 2))
    assert slow["compute.fwd.elementwise"] == pytest.approx(3 * ref["compute.fwd.elementwise"])
    assert slow["optimizer"] == pytest.approx(2 * ref["optimizer"])
    assert slow["compute.fwd.mlp"] == ref["compute.fwd.mlp"]
    grad = "comm.grad.dp.all_reduce"
    assert ref[grad + " (exposed)"] < ref[grad]
    assert terms(base.replace(comm_overlap=0.0))[grad + " (exposed)"] == pytest.approx(ref[grad])


def test_layer_fits():
    # the time model's element-wise bytes of a dense gated layer, forward + twice that backward (time.py)
    T, H, a, g, d, F, w = 1024, 512, 8, 4, 64, 1536, 4
    fwd = 10 * T * H * w + 2 * T * (a + g) * d * w + 3 * T * F * w
    assert layer_elementwise_bytes(T, H, a, g, d, F, w) == 3 * fwd
    assert adamw_bytes(1000) == 1000 * (4 + 2 * 8 + 4)  # fp32 gradient, Adam's m and v read and written, parameter
    assert fit_elementwise(6e9, 2.0) == 3e9 and fit_optimizer(4e9, 2.0) == 2e9
    assert fit_overlap(1.0, 0.5, 1.5) == 0.0 and fit_overlap(1.0, 0.5, 1.0) == 1.0
    assert fit_overlap(1.0, 0.5, 1.25) == pytest.approx(0.5) and fit_overlap(1.0, 0.5, 1.7) == 0.0
    with pytest.raises(AutoparError, match="cannot fit elementwise_bandwidth"):
        fit_elementwise(1.0, 0.0)
    # causal attention priced as a GEMM: b S^2 a (d + d) FLOPs forward, 2.5x that backward, at P eta(n)
    b, a, s, d, peak, hbm = 4, 8, 256, 64, 100e9, 10e9
    n = 3 / (1 / s + 1 / d + 1 / s)
    rate = peak * n / (n + 1.5 * 4 * peak / hbm)
    assert attention_model_seconds(b, a, s, d, 4, peak, hbm, 1.0) == pytest.approx(3.5 * b * s * s * a * 2 * d / rate)
    assert fit_attention(0.3, 0.1) == pytest.approx(3.0)


def test_attention_factor_scales_the_attention_term():
    spec = ModelSpec(name="t", num_layers=2, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn=512,
                     vocab=1000, gated_mlp=True, tied_embeddings=False, norm="rmsnorm")
    base = Cluster(gpu="cpu-test", gpus_per_node=2, **FIGS)
    a, b = (estimate(spec, c, "tp=2", seq_len=256, global_batch=4, dtype_bytes=4) for c in
            (base, base.replace(attention_factor=2.5)))
    ta, tb = ({t.name: t.value for t in c.breakdown(formulas=False)} for c in (a, b))
    for name in ("compute.fwd.attention", "compute.bwd.attention"):
        assert tb[name] == pytest.approx(2.5 * ta[name])
    assert tb["compute.fwd.mlp"] == ta["compute.fwd.mlp"]


def test_each_ring_collective_at_its_own_rate():
    """A profile's per-collective bandwidths price each ring collective (tp=2,sp: all-gathers and
    reduce-scatters; the dp gradient all-reduce) at the collective's own rate: the bandwidth part of
    a row, count x sent / (B x epsilon) on a 2-rank axis inside a node, scales by B / B_own."""
    spec = ModelSpec(name="t", num_layers=2, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn=512,
                     vocab=1000, gated_mlp=True, tied_embeddings=False, norm="rmsnorm")
    base = Cluster(gpu="cpu-test", gpus_per_node=4, **FIGS)
    ring = FIGS["intra_node_bandwidth"]
    own = base.replace(all_gather_bandwidth=ring / 3, reduce_scatter_bandwidth=ring / 2, all_reduce_bandwidth=ring * 2)

    def rows(cluster):
        cost = estimate(spec, cluster, "tp=2,sp,dp=2", seq_len=128, global_batch=8, dtype_bytes=4)
        out: dict[str, float] = {}
        for t in cost.breakdown(formulas=False):
            if t.category == "comm":  # (two rows may share a name: dense and expert gradients)
                out[t.name] = out.get(t.name, 0.0) + t.value
        return out, cost

    (ref, cost), (got, _) = rows(base), rows(own)
    table = {(r.phase, r.dimension, r.collective): r for r in cost.comm_table()}
    for key, factor in ((("fwd", "sp", "all_gather"), 3), (("fwd", "sp", "reduce_scatter"), 2),
                        (("grad", "dp", "all_reduce"), 0.5)):
        row, name = table[key], "comm." + ".".join(key)
        bandwidth_part = row.count * row.bytes_sent / (ring * 0.9)
        assert got[name] - ref[name] == pytest.approx(bandwidth_part * (factor - 1), rel=1e-9), name
    assert sent_bytes("reduce_scatter", 4, 1000) == (750.0, 1)


def test_a_time_shared_host_runs_other_ranks_in_the_bubble(tmp_path):
    """4 one-thread ranks on 2 cores under pp=2 (two stages, 1F1B): a rank idle in the bubble leaves its
    half core to the others, so the step is the longer of the critical path at full speed and the
    host's work at half speed: max(share * step, busy) with busy the step less the bubble and the
    pp ranks' mean compute (model.shared_host_step).  Without pp nothing is idle: the step is the
    scaled one; the breakdown still sums to the step."""
    from autopar.cost.model import shared_host_step

    assert shared_host_step(10.0, 6.0, 0.5) == 6.0 and shared_host_step(10.0, 4.0, 0.5) == 5.0
    assert shared_host_step(10.0, 10.0, 1.0) == 10.0 and shared_host_step(10.0, 7.0, 1.0) == 10.0
    spec = ModelSpec(name="t", num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn=512,
                     vocab=1000, gated_mlp=True, tied_embeddings=False, norm="rmsnorm")
    four = Cluster.from_profile(_cpu_profile(tmp_path), gpus_per_node=4)
    pp = estimate(spec, four, "pp=2:1f1b,dp=2,mb=2", seq_len=128, global_batch=8, dtype_bytes=4)
    unshared = pp.step_time - pp.shared_cores
    tf, tb = pp._out["T_f"], pp._out["T_b"]
    per_step = unshared - float((2 * (tf + tb)).max()) - pp.bubble  # the per-step comm and optimizer
    busy = 2 * float((tf + tb).mean()) + per_step
    assert pp.shared_cores < 0 and pp.step_time == pytest.approx(max(0.5 * unshared, busy))
    terms = [t for t in pp.breakdown(formulas=False) if t.category != "memory" and "(exposed)" not in t.name
             and not (t.category == "comm")]
    assert any(t.name == "bubble (shared cores)" and t.value == pp.shared_cores for t in terms)
    dp = estimate(spec, four, "dp=4", seq_len=128, global_batch=8, dtype_bytes=4)
    assert dp.shared_cores == 0.0
