"""The cost model outside the communication table: specs, clusters, link layout, Cost.

Expected numbers come from published model sizes, calibration.md's hardware table, or
are written out by hand from the inputs.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import sympy

from autopar.cost import Cluster, Cost, ModelSpec, Term, estimate
from autopar.cost.flops import model_flops
from autopar.cost.hardware import axis_link_arrays
from autopar.cost.pipeline import place_layers, stage_views
from autopar.errors import AutoparError

GIB = 2**30


# ---------------------------------------------------------------- specs
@pytest.mark.parametrize("name, billions", [("llama3-8b", 8.03), ("llama3-70b", 70.6), ("llama3-405b", 405.9),
                                             ("mixtral-8x7b", 46.7)])
def test_preset_sizes_match_published(name, billions):
    assert ModelSpec.preset(name).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_mixtral_active_params():
    assert ModelSpec.preset("mixtral-8x7b").num_active_params / 1e9 == pytest.approx(12.9, rel=0.01)


def test_reference_moe_preset():
    spec = ModelSpec.preset("reference-moe")
    assert (spec.num_layers, spec.hidden, spec.num_heads, spec.head_dim) == (80, 8192, 64, 128)
    assert (spec.num_experts, spec.top_k, spec.num_moe_layers) == (64, 2, 20)
    assert spec.moe_layers[:2] == (3, 7)


def test_unknown_preset():
    with pytest.raises(AutoparError, match="unknown model preset"):
        ModelSpec.preset("gpt-9")


LLAMA_CFG = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "tie_word_embeddings": False}


def test_from_hf_config_llama_dict_and_path(tmp_path):
    spec = ModelSpec.from_hf_config(LLAMA_CFG)
    assert spec.num_params == ModelSpec.preset("llama3-8b").num_params
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CFG))
    assert ModelSpec.from_hf_config(path).num_params == spec.num_params
    assert ModelSpec.from_hf_config(tmp_path).num_params == spec.num_params


def test_from_hf_config_mixtral_and_qwen_moe():
    mix = ModelSpec.from_hf_config({**LLAMA_CFG, "model_type": "mixtral", "vocab_size": 32000,
                                    "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mix.num_params == ModelSpec.preset("mixtral-8x7b").num_params
    qwen = ModelSpec.from_hf_config({"model_type": "qwen2_moe", "num_hidden_layers": 24, "hidden_size": 2048,
                                     "num_attention_heads": 16, "num_key_value_heads": 16,
                                     "intermediate_size": 5632, "moe_intermediate_size": 1408,
                                     "shared_expert_intermediate_size": 5632, "num_experts": 60,
                                     "num_experts_per_tok": 4, "decoder_sparse_step": 1, "vocab_size": 151936})
    assert (qwen.num_experts, qwen.top_k, qwen.moe_ffn, qwen.num_shared_experts) == (60, 4, 1408, 4)
    assert qwen.qkv_bias and qwen.num_moe_layers == 24 and qwen.shared_expert_gate
    # Qwen1.5-MoE-A2.7B: 14.3B parameters in all (published).
    assert qwen.num_params / 1e9 == pytest.approx(14.3, rel=0.02)


def test_from_hf_config_gpt2():
    gpt = ModelSpec.from_hf_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                    "vocab_size": 50257})
    assert not gpt.gated_mlp and gpt.norm == "layernorm" and gpt.tied_embeddings and gpt.ffn == 3072
    # GPT-2 small has 124M parameters with its 1024 learned positions (786k), which we do not model.
    assert (gpt.num_params + 1024 * 768) / 1e6 == pytest.approx(124.4, rel=0.005)


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(AutoparError, match="lacks"):
        ModelSpec.from_hf_config({"hidden_size": 8})
    with pytest.raises(AutoparError, match="could not read"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")


def test_spec_validation():
    with pytest.raises(AutoparError):
        ModelSpec(num_layers=2, hidden=64, num_heads=4, num_kv_heads=3, vocab=10, ffn=8)
    with pytest.raises(AutoparError):
        ModelSpec(num_layers=2, hidden=64, num_heads=4, vocab=10, ffn=8, num_experts=4, top_k=5)


# ---------------------------------------------------------------- clusters and links
def test_cluster_presets_from_calibration_md():
    a100, h100, h200 = Cluster(gpu="a100"), Cluster(gpu="h100"), Cluster(gpu="h200")
    assert (a100.peak_flops, a100.intra_node_bandwidth, a100.inter_node_bandwidth) == (312e12, 300e9, 25e9)
    assert (h100.peak_flops, h100.hbm_bandwidth, h100.inter_node_bandwidth) == (989e12, 3.35e12, 50e9)
    assert (h200.hbm_bytes, h200.hbm_bandwidth) == (141e9, 4.8e12)
    assert Cluster(gpu="h100", num_nodes=128).world_size == 1024
    assert Cluster(gpu="cpu").peak_flops > 0


def test_custom_cluster():
    with pytest.raises(AutoparError, match="unknown GPU"):
        Cluster(gpu="tpu")
    figures = dict(peak_flops=1e15, hbm_bytes=1e11, hbm_bandwidth=1e12, intra_node_bandwidth=1e11,
                   intra_node_latency=1e-6, inter_node_bandwidth=1e10, inter_node_latency=1e-5,
                   gemm_efficiency=0.5)
    assert Cluster(gpu="mychip", **figures).peak_flops == 1e15
    assert Cluster(gpu="h100", inter_node_bandwidth=100e9).inter_node_bandwidth == 100e9


def test_axis_links_by_hand():
    c = Cluster(gpu="h100", num_nodes=4)  # 32 GPUs, 8 per node
    eps = 0.5
    bn, bx = 450e9 * eps, 50e9 * eps
    # tp=8: one node, ring over NVLink: beta = (7/8)/bn * 8/7 = 1/bn
    br, ba, _, _ = axis_link_arrays(c, "tp", 8, 1, 4, 1, 1, eps)
    assert br == pytest.approx(1 / bn)
    # dp=4 with stride 8: one member per node, ring over the network: 1/bx
    br, ba, _, _ = axis_link_arrays(c, "dp", 8, 1, 4, 1, 1, eps)
    assert br == pytest.approx(1 / bx) and ba == pytest.approx(1 / bx)
    # dp=16 with stride 2 (tp=2): 4 members per node on 4 nodes, hierarchical
    br, ba, _, _ = axis_link_arrays(c, "dp", 2, 1, 16, 1, 1, eps)
    assert br == pytest.approx(((3 / 4) / bn + (3 / 4) / (4 * bx)) * 16 / 15)
    assert ba == pytest.approx((3 / bn + 12 / bx) / 15)


# ---------------------------------------------------------------- pipeline placement
def test_place_layers_uneven():
    counts = place_layers(10, 4, head_layers=0.0)
    assert sum(counts) == 10 and min(counts) >= 1 and counts[0] <= max(counts)
    heavy = place_layers(10, 4, head_layers=3.0)
    assert heavy[-1] < counts[-1] and sum(heavy) == 10
    with pytest.raises(ValueError):
        place_layers(3, 4, 0.0)


def test_v_schedules_put_both_ends_on_rank_zero():
    spec = ModelSpec.preset("llama3-8b")
    views = stage_views(spec, 4, "zbv", 2, 1.0)
    assert views[0].first == views[0].last == 1 and sum(v.dense for v in views) == 32
    inter = stage_views(spec, 4, "interleaved", 3, 1.0)
    assert inter[0].first and inter[3].last and inter[0].sends == 3 and inter[0].recvs == 2


# ---------------------------------------------------------------- estimate and Cost
@pytest.fixture(scope="module")
def cost70():
    return estimate("llama3-70b", Cluster(num_nodes=128), "tp=8,sp,pp=4,dp=32,zero=1,mb=8", 8192, 512)


def test_cost_derived_numbers(cost70):
    spec = ModelSpec.preset("llama3-70b")
    assert isinstance(cost70, Cost) and cost70.memory_per_gpu > 0
    assert cost70.tokens_per_s == pytest.approx(512 * 8192 / cost70.step_time)
    # Model FLOPs by hand: 3 x forward; forward per token = 2 x (layer and head weights) + causal attention.
    layer = spec.attention_params + spec.mlp_params(spec.ffn)
    per_token = 2 * spec.num_layers * layer + 2 * spec.hidden * spec.vocab + 2 * 8192 * 64 * 128 * 80
    assert model_flops(spec, 8192, 512) == pytest.approx(3 * per_token * 8192 * 512)
    assert cost70.mfu == pytest.approx(3 * per_token * 8192 * 512 / (cost70.step_time * 1024 * 989e12))
    assert 0.2 < cost70.mfu < 0.7


def test_breakdown_terms(cost70):
    terms = cost70.breakdown()
    assert all(isinstance(t, Term) and isinstance(t.formula, sympy.Expr) for t in terms)
    mem = [t for t in terms if t.category == "memory"]
    assert sum(t.value for t in mem) == pytest.approx(sum(cost70.memory().values()))
    # The peak is a timeline, not the sum: every term counted once at most, the always-alive ones
    # always (cost/memory.py peak_memory; tests/dist/test_memory_peak.py checks it against the allocator).
    m = cost70.memory()
    assert cost70.memory_per_gpu <= sum(m.values())
    assert cost70.memory_per_gpu >= m["params"] + m["optimizer"] + m["activations"]
    names = {t.name for t in terms}
    assert {"bubble", "compute.fwd.mlp", "compute.bwd.mlp", "comm.fwd.sp.all_gather"} <= names
    # A formula evaluates to its value: the params term with this plan's numbers.
    params = next(t for t in mem if t.name == "memory.params")
    assert {s.name for s in params.formula.free_symbols} <= {"H", "a", "g", "d", "F", "V", "E", "F_e", "n_sh",
                                                             "tp", "dp", "cp", "ep", "l_d", "l_e", "first",
                                                             "last", "tied", "w_p", "w_z", "z_3", "shared_gate",
                                                             "qk_norm", "qk_head_norm", "mla", "l_q", "r_q",
                                                             "r_kv", "d_r", "d_v", "n_ln", "p_b", "P_emb", "emb_norm",
                                                             "P_head", "head_bias"}
    text = str(cost70)
    assert "tp=8,sp,pp=4:1f1b,dp=32,zero=1,mb=8" in text and "MFU" in text and "memory" in text


def test_precision_conventions():
    spec = ModelSpec(name="t", num_layers=2, hidden=64, num_heads=4, ffn=128, vocab=128)
    fp32 = estimate(spec, Cluster(gpu="cpu"), "none", 16, 4, dtype_bytes=4).memory()
    P = spec.num_params
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * P, 4 * P, 8 * P)
    mixed = estimate(spec, Cluster(gpu="cpu"), "none", 16, 4).memory()
    assert (mixed["params"], mixed["grads"], mixed["optimizer"]) == (2 * P, 4 * P, 12 * P)
    z1 = estimate(spec, Cluster(gpu="cpu"), "dp=4,zero=1", 16, 4).memory()
    assert z1["optimizer"] == 12 * P / 4 and z1["grads"] == 4 * P
    z3 = estimate(spec, Cluster(gpu="cpu"), "dp=4,zero=3", 16, 4).memory()
    # The fp32 master shard is the parameter shard (in the 12 B optimizer term): no bf16 shard.
    assert (z3["params"], z3["grads"], z3["optimizer"]) == (0, 4 * P / 4, 12 * P / 4)


def test_directions_of_change():
    c = Cluster(num_nodes=4)
    base = estimate("llama3-8b", c, "tp=8,pp=4,mb=16", 4096, 64)
    assert estimate("llama3-8b", c, "tp=8,sp,pp=4,mb=16", 4096, 64).memory()["activations"] < base.memory()["activations"]
    assert estimate("llama3-8b", c, "tp=8,pp=4,mb=16,recompute=full", 4096, 64).step_time > base.step_time
    inter = estimate("llama3-8b", c, "tp=8,pp=4:interleaved,vpp=2,mb=16", 4096, 64)
    assert inter.bubble < base.bubble
    ep1 = estimate("mixtral-8x7b", c, "tp=4,dp=8", 4096, 64, ).memory()["params"]
    ep8 = estimate("mixtral-8x7b", c, "tp=4,dp=8,ep=8", 4096, 64).memory()["params"]
    assert ep8 < ep1 / 2


def test_estimate_errors():
    with pytest.raises(AutoparError, match="needs 16 GPUs"):
        estimate("llama3-8b", Cluster(num_nodes=1), "dp=16", 4096, 64)
    with pytest.raises(AutoparError, match="does not divide"):
        estimate("llama3-8b", Cluster(num_nodes=1), "tp=3", 4096, 64)


def test_vectorised_model_agrees_with_itself_per_rank():
    # The per-rank arrays of one estimate are the same numbers a one-rank evaluation gives.
    c = estimate("llama3-8b", Cluster(num_nodes=2), "tp=4,pp=4:1f1b,mb=8", 2048, 32)
    out = c._out
    assert np.all(np.isfinite(out["T_f"])) and out["T_f"].shape == (4,)
    assert c.bottleneck_pp_rank == int(np.argmax(out["T_f"] + out["T_b"]))


@pytest.mark.parametrize("zero, hidden_by_runtime", [(0, True), (1, False), (2, "grad"), (3, True)])
def test_gradient_reduction_is_exposed_where_the_runtime_blocks(zero, hidden_by_runtime):
    """The time model hides what autopar's runtime overlaps (plain DP's bucket all-reduces in
    backward, ZeRO 2-3's per-unit reduce-scatters) and exposes what it runs blocking (ZeRO-1's
    reduce-scatters, ZeRO 1-2's after-step all-gathers) unless ``zero_overlap`` (Megatron's)."""
    def terms(**options):
        cost = estimate("llama3-8b", Cluster.for_world("h100", 64), f"tp=8,dp=8,zero={zero}", 4096, 64, **options)
        return {t.name: t.value for t in cost.breakdown(formulas=False) if t.name.startswith(("comm.grad.dp",
                                                                                              "comm.step"))}
    for overlap in (False, True):
        got = terms(zero_overlap=overlap)
        reductions = [k for k in got if not k.endswith("(exposed)")]
        assert reductions, got
        for name in reductions:
            exposed = got[name + " (exposed)"]
            if overlap or hidden_by_runtime is True or (hidden_by_runtime == "grad" and ".grad." in name):
                assert exposed < got[name]
            else:
                assert exposed == pytest.approx(got[name])


def test_peak_takes_the_larger_phase_not_the_sum():
    """ZeRO-1 reduce-scatters in place: nothing beyond its kept gradients; gloo (the cpu preset)
    copies the buffer of each reduce-scatter in flight, alive after backward, never with the
    activations (issue 29: the sum over-counted a GPU run's allocator peak by 13%).  NCCL copies nothing."""
    spec = ModelSpec(vocab=128, hidden=64, num_layers=2, num_heads=4, num_kv_heads=4, ffn=128)
    cost = estimate(spec, Cluster(gpu="cpu", num_nodes=1, gpus_per_node=2), "dp=2,zero=1",
                    seq_len=16, global_batch=4, dtype_bytes=4)
    m = cost.memory()
    params = m["params"]
    # By hand for one ZeRO unit of P bytes (all 4-byte, n = 2): params P, Adam P (m, v over 2),
    # gradients P (whole until the step), one unit's buffer in backward's window (the gradients'
    # own: ZeRO-1 reduce-scatters in place), and at the sync gloo's copy of the one unit in flight P.
    assert "master_params" not in m
    assert m["grads"] == pytest.approx(params) and m["optimizer"] == pytest.approx(params)
    assert m["zero_unit_buffer"] == m["zero_sync_buffer"] == m["collective_copies"] == pytest.approx(params)
    sync = params + m["optimizer"] + m["grads"] + m["collective_copies"]
    assert cost.memory_per_gpu >= sync
    assert cost.memory_per_gpu < sum(m.values())
    nccl = estimate(spec, Cluster(gpu="h100", num_nodes=1, gpus_per_node=2), "dp=2,zero=1",
                    seq_len=16, global_batch=4, dtype_bytes=4).memory()
    assert nccl["collective_copies"] == 0 and nccl["zero_sync_buffer"] == pytest.approx(params)

def test_padded_experts_count_as_the_largest_rank_holds():
    """An ep that does not divide the experts pads them (7 over ep=2: 4 per rank, one a padding
    expert): the scored rank's expert parameters are ceil(E / ep) experts', as many as with 8."""
    spec = ModelSpec(name="t", num_layers=2, hidden=64, num_heads=4, ffn=128, vocab=128, num_experts=7, top_k=2,
                     moe_ffn=64)
    seven = estimate(spec, Cluster(gpu="cpu"), "dp=2,ep=2", 16, 4, dtype_bytes=4).memory()["params"]
    eight = estimate(dataclasses.replace(spec, num_experts=8), Cluster(gpu="cpu"), "dp=2,ep=2", 16, 4,
                     dtype_bytes=4).memory()["params"]
    router = 2 * 64 * 4  # the router's row for the 8th expert, in each of the 2 layers (fp32)
    assert seven == eight - router
