"""`autopar verify`: a plan proved on a shrunk architecture, on CPU gloo processes.

Each test that runs the plan starts one set of 2 ranks (autopar/verification/launch.py); the
refusal is caught before any process starts, and the shrinking rules and the report without
gradients are checked without processes.  The configs are tiny transformers configs written
to tmp_path, a little larger than verify's shrunk size so that shrinking shows.
"""
from __future__ import annotations

import json
import re

import pytest

import autopar
from autopar.cli import main

transformers = pytest.importorskip("transformers")


def _config(tmp_path, config_cls, **fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(config_cls(**fields).to_json_string())
    return str(path)


def _llama(tmp_path) -> str:
    return _config(tmp_path, transformers.LlamaConfig, vocab_size=256, hidden_size=128, intermediate_size=256,
                   num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)


def _line(out: str, prefix: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith(prefix)]
    return line


def test_qwen2_config_under_tp_sp_is_equal(tmp_path, capsys):
    config = _config(tmp_path, transformers.Qwen2Config, vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    assert main(["verify", "--model", config, "--plan", "tp=2,sp"]) == 0
    out = capsys.readouterr().out
    assert "shrunk: num_hidden_layers 4 -> 2" in out and "shrunk: vocab_size 256 -> 128" in out
    steps = [line for line in out.splitlines() if re.match(r"\s+\d+\s", line)]
    assert len(steps) == 3  # one line per step: reference loss, parallel loss, |diff|
    for line in steps:
        _, ref, got, diff = line.split()
        assert abs(float(ref) - float(got)) <= 1e-5 and float(diff) <= 1e-5
    assert re.search(r"worst gradient \|diff\| \(step 1\): \S+ at model\.\S+ \(bound 0\.001\)", out)
    assert re.search(r"worst parameter \|diff\|: \S+ at (model|lm_head)\.\S+ \(", out)  # which tensor: rounding noise
    assert _line(out, "verdict:").startswith("verdict: EQUAL - plan 'tp=2,sp' on 2 ranks")


def test_a_corrupted_gradient_is_reported_with_its_name(tmp_path, capsys):
    corrupted = "model.layers.1.mlp.down_proj.weight"
    rc = main(["verify", "--model", _llama(tmp_path), "--plan", "dp=2", "--corrupt", corrupted])
    out = capsys.readouterr().out
    assert rc == 1, out
    grad = _line(out, "worst gradient |diff| (step 1):")
    assert f" at {corrupted} " in grad
    assert float(grad.split(":")[1].split()[0]) > 1e-3  # beyond the bound, so it is what fails
    assert f" at {corrupted} " in _line(out, "worst parameter |diff|:")
    assert "gradient of model.layers.1.mlp.down_proj.weight doubled on rank 0" in out
    verdict = _line(out, "verdict:")
    assert verdict.startswith("verdict: DIFFERENT") and f"the gradient of {corrupted}" in verdict


def test_a_refused_plan_exits_2_with_an_autopar_error(tmp_path, capsys):
    config = _llama(tmp_path)  # 2 KV heads: tp=4 replicates them, which cp does not run, shrunk or not
    assert main(["verify", "--model", config, "--plan", "tp=4,cp=2", "--world", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: tp=4 does not divide the 2 KV heads") and "use cp=1 with tp=4" in err
    with pytest.raises(autopar.AutoparError, match="needs pp\\*dp\\*cp\\*tp = 1\\*2\\*1\\*1 = 2 ranks"):
        autopar.verify(config, "dp=2", world_size=3)
    assert json.loads(open(config).read())["num_key_value_heads"] == 2  # the user's file is not touched


@pytest.mark.parametrize("model_type, plan", [
    ("llama", "tp=4,sp"), ("mixtral", "tp=2,ep=2,dp=2"), ("qwen2_moe", "ep=4,dp=4"), ("gemma2", "cp=2:ulysses,tp=2"),
    ("gpt2", "tp=2,pp=2:interleaved,vpp=2,mb=2"),
])
def test_shrinking_keeps_what_the_plan_splits(model_type, plan):
    """No process: the shrunk config still splits by the plan, and every change is noted."""
    from autopar.plan import Plan
    from autopar.verification.shrink import KEYS, shrink_config

    p = Plan.parse(plan)
    full = transformers.AutoConfig.for_model(model_type).to_dict()
    cfg, notes = shrink_config(full, p, seq_len=16)
    get = {f: next((cfg[k] for k in keys if cfg.get(k) is not None), None) for f, keys in KEYS.items()}
    heads, kv = get["heads"], get["kv_heads"] or get["heads"]
    split = p.tp * (p.cp if p.cp_variant == "ulysses" else 1)
    assert heads % split == 0 and kv % split == 0 and heads % kv == 0 and get["vocab"] % p.tp == 0
    assert get["layers"] == max(2, p.pp * p.num_chunks_per_rank) and heads * 16 >= get["hidden"]
    if get["experts"]:
        assert get["experts"] % p.ep == 0 and get["top_k"] <= get["experts"]
    assert len(notes) >= 4 and all(" -> " in n or "dropped" in n for n in notes)
    p.validate(num_heads=heads, num_kv_heads=kv, vocab=get["vocab"], num_experts=get["experts"] or 0,
               num_layers=get["layers"])
    assert full["vocab_size"] > get["vocab"]  # the input is not modified


@pytest.mark.parametrize("kv, heads, tp, want", [(1, 48, 2, (1, 4)), (2, 32, 4, (2, 8)), (5, 20, 2, (3, 12)),
                                                 (8, 32, 2, (2, 8))])
def test_shrinking_keeps_kv_head_replication(kv, heads, tp, want):
    """KV heads tp does not divide (replicated on every tp rank) stay so in the shrunk model, with
    query heads tp does divide; KV heads tp divides stay divisible."""
    from autopar.plan import Plan
    from autopar.verification.shrink import shrink_config

    full = dict(model_type="llama", num_hidden_layers=4, hidden_size=heads * 64, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=1000, intermediate_size=512)
    cfg, notes = shrink_config(full, Plan.parse(f"tp={tp}"), seq_len=16)
    assert (cfg["num_key_value_heads"], cfg["num_attention_heads"]) == want
    assert (kv % tp == 0) == (want[0] % tp == 0) and want[1] % tp == 0 and want[1] % want[0] == 0


def test_a_field_saved_under_two_names_shrinks_under_both():
    """A key of a field holding the value read is the same quantity and shrinks with it; one
    holding another value means something else (multi-query Falcon's unused num_kv_heads)."""
    from autopar.plan import Plan
    from autopar.verification.shrink import shrink_config

    base = dict(model_type="falcon", num_hidden_layers=4, hidden_size=512, num_attention_heads=32,
                vocab_size=1000)
    both, _ = shrink_config(dict(base, num_key_value_heads=8, num_kv_heads=8), Plan.parse("dp=2"))
    assert both["num_key_value_heads"] == both["num_kv_heads"] == 2
    other, _ = shrink_config(dict(base, num_key_value_heads=1, num_kv_heads=32), Plan.parse("dp=2"))
    assert (other["num_key_value_heads"], other["num_kv_heads"]) == (1, 32)


@pytest.mark.parametrize("model_type, plan", [("deepseek_v3", "ep=2,dp=2"), ("falcon", "dp=2")])
def test_shrunk_configs_build_and_run(model_type, plan):
    """MLA's rope / no-rope / value / low-rank widths shrink together (DeepSeek-V3), and the
    dense-then-MoE layer split is kept; the shrunk model runs a forward pass."""
    import torch

    from autopar.plan import Plan
    from autopar.verification.shrink import shrink_config

    full = transformers.AutoConfig.for_model(model_type).to_dict()
    if model_type == "falcon":  # Falcon-40B's layout: grouped fused qkv, parallel attention and MLP
        full.update(new_decoder_architecture=True, num_attention_heads=128, num_kv_heads=8, hidden_size=8192,
                    multi_query=False, parallel_attn=True, alibi=False)
        if "num_key_value_heads" in full:  # transformers >= 5.25 writes the KV heads under both names
            full["num_key_value_heads"] = 8
    cfg, _ = shrink_config(full, Plan.parse(plan), seq_len=16)
    if model_type == "deepseek_v3":
        assert cfg["qk_rope_head_dim"] == cfg["head_dim"] and cfg["first_k_dense_replace"] == 1
    else:
        assert cfg["num_kv_heads"] < 8 and cfg["num_attention_heads"] % cfg["num_kv_heads"] == 0
        assert cfg.get("num_key_value_heads", cfg["num_kv_heads"]) == cfg["num_kv_heads"]
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    logits = model(torch.randint(0, cfg["vocab_size"], (2, 16))).logits
    assert logits.shape == (2, 16, cfg["vocab_size"])


def test_without_sgd_the_report_says_gradients_are_not_compared():
    import torch

    from autopar.verification.compare import compare

    state = {"w": torch.ones(3)}
    ref = {"losses": [1.0], "states": [state, state], "grads": {"w": torch.zeros(3)}}
    got = {"losses": [1.0 + 2e-5], "states": [state, {"w": torch.ones(3) + 1e-5}]}
    result = compare(ref, got, lr=None, model="m", plan="dp=2", world_size=2, steps=1, global_batch=4, seq_len=16,
                     optimizer="adamw", notes=[])
    assert result.worst_grad_diff is None and "gradients: not compared" in result.report()
    assert not result.ok and result.loss_diffs[0] > 1e-5 and result.worst_param_tensor == "w"
    assert "verdict: DIFFERENT" in result.report() and "the loss of step 1" in result.verdict()


@pytest.mark.parametrize("model_type, extra", [
    ("mistral", {"sliding_window": 4096}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21}),
    ("llama4_text", {}),
])
def test_shrinking_makes_windows_and_chunks_act(model_type, extra):
    """Windows and local-attention chunks longer than verify's sequence are cut below it, and a
    model whose sliding layers come last keeps one, so the certificate covers them."""
    from autopar.plan import Plan
    from autopar.verification.shrink import LENGTH_KEYS, shrink_config

    full = transformers.AutoConfig.for_model(model_type, **extra).to_dict()
    cfg, notes = shrink_config(full, Plan.parse("dp=2"), seq_len=16)
    lengths = {k: cfg[k] for k in LENGTH_KEYS if isinstance(cfg.get(k), int)}
    assert lengths and all(v <= 8 for v in lengths.values()), lengths
    if cfg.get("layer_types"):
        assert len(set(cfg["layer_types"])) == len(set(full["layer_types"])), cfg["layer_types"]
    assert any("so it applies" in n for n in notes)


def test_a_window_longer_than_the_test_sequence_is_exercised(tmp_path, capsys):
    """Mistral with a 4096-token window: verify cuts it below its 16 tokens and the plan is
    equal with the window acting (the mask stays a mask: passes/causal_mask.py check_sizes)."""
    config = _config(tmp_path, transformers.MistralConfig, vocab_size=256, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                     sliding_window=4096)
    assert main(["verify", "--model", config, "--plan", "dp=2"]) == 0
    out = capsys.readouterr().out
    assert "shrunk: sliding_window 4096 -> 8" in out
    assert _line(out, "verdict:").startswith("verdict: EQUAL")


def test_a_multimodal_gemma3_config_verifies_its_language_model(tmp_path, capsys):
    """Gemma 3's config.json (a text_config beside a vision_config): verify certifies its causal
    LM, the gemma3_text model, with a sliding and a full-attention layer kept."""
    config = tmp_path / "config.json"
    config.write_text(transformers.Gemma3Config().to_json_string(use_diff=False))
    assert main(["verify", "--model", str(config), "--plan", "tp=2,sp"]) == 0
    out = capsys.readouterr().out
    assert "note: multimodal gemma3 config: verifying its language model, text_config (model_type gemma3_text" in out
    assert _line(out, "shrunk: layer_types").endswith("-> ['sliding_attention', 'full_attention'] "
                                                      "(one entry per kept layer)")
    assert _line(out, "verdict:").startswith("verdict: EQUAL - plan 'tp=2,sp' on 2 ranks")


def test_a_mamba2_model_without_attention_heads_verifies(capsys):
    """Mamba-2 (no attention heads): its own heads, head width, groups and state are shrunk
    consistently (heads x head width = expand x hidden) and dp=2 is certified."""
    assert main(["verify", "--model", "mamba2", "--plan", "dp=2"]) == 0
    out = capsys.readouterr().out
    assert "shrunk: hidden_size 4096 -> 64 (no attention heads: 4 x 16 wide)" in out
    assert "shrunk: num_heads 128 -> 8 (x head width 16 = the mixer's width 128)" in out
    assert _line(out, "verdict:").startswith("verdict: EQUAL - plan 'dp=2' on 2 ranks")
