"""The shrinker's rules (autopar/verification/shrink.py, shrink_fields.py, shrink_layers.py), on configs only.

No model is built and nothing trains: each test shrinks a config dict -- written here, or
transformers' default config of a model type (configs only, no weights) -- and checks the fields
the rule is about: a multimodal config's text model, state-space widths, per-layer lists and
layer indices cut with the layers, the other keys families use for layers and heads, and rotary
widths that fit the shrunk head.  What builds and trains from such configs is the zoo's
(tests/e2e/test_zoo.py) and verify's (tests/e2e/test_verify.py).
"""
from __future__ import annotations

import copy

import pytest

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.verification.shrink import shrink_config
from autopar.verification.shrink_layers import kept_layers

DP = Plan.parse("dp=2")


def _llama(**fields) -> dict:
    return dict(model_type="llama", num_hidden_layers=12, hidden_size=1024, num_attention_heads=16,
                num_key_value_heads=4, intermediate_size=4096, vocab_size=32000, **fields)


def test_every_kind_of_layer_is_kept_and_every_per_layer_entry_cut_alike():
    """layer_types and mlp_layer_types cut with the same kept layers, each kind kept; a list of
    layer indices and a per-layer dict renumbered; the user's config untouched."""
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    full = _llama(layer_types=kinds * 2, mlp_layer_types=["dense"] * 3 + ["sparse"] * 9,
                  mlp_only_layers=[0, 1, 2], per_layer_config={"05": {"head_dim": 128}, "11": {"head_dim": 128}},
                  head_dim=64)
    before = copy.deepcopy(full)
    cfg, notes = shrink_config(full, DP)
    assert cfg["num_hidden_layers"] == 2
    assert sorted(cfg["layer_types"]) == ["full_attention", "sliding_attention"]
    assert sorted(cfg["mlp_layer_types"]) == ["dense", "sparse"]
    kept = [i for i, kind in enumerate(cfg["layer_types"]) if kind == "full_attention"]
    assert list(cfg["per_layer_config"]) == [str(i) for i in kept]  # the full layer's override, renumbered
    assert cfg["per_layer_config"][str(kept[0])]["head_dim"] == 2 * cfg["head_dim"]  # twice as wide, as before
    assert cfg["mlp_only_layers"] == [i for i, kind in enumerate(cfg["mlp_layer_types"]) if kind == "dense"]
    assert any(n.startswith("layers 0-11 -> ") for n in notes)
    assert full == before


def test_layers_that_read_another_layers_keys_and_values_are_renumbered():
    """kv_source_layers: each kept layer's source is renumbered, or the layer reads its own where
    its source is not kept."""
    full = dict(_llama(layer_types=["sliding_attention"] * 4 + ["indexed_attention"] * 2,
                       kv_source_layers=[0, 1, 2, 3, 4, 4]), num_hidden_layers=6)
    cfg, _ = shrink_config(full, DP, layers=3)
    assert cfg["layer_types"] == ["sliding_attention", "indexed_attention", "indexed_attention"]
    assert cfg["kv_source_layers"] == [0, 1, 1]
    two, _ = shrink_config(full, DP)
    assert all(src <= i for i, src in enumerate(two["kv_source_layers"]))


@pytest.mark.parametrize("kinds, layers", [(["a", "b", "c"], 2), (["a"] * 8 + ["b"], 2), (["a", "b"], 4)])
def test_kept_layers_are_in_order_and_cover_what_the_count_allows(kinds, layers):
    keep = kept_layers([{("t", k)} for k in kinds], layers)
    assert len(keep) == layers and (keep == sorted(keep) or layers > len(kinds))
    assert len({kinds[i] for i in keep}) == min(layers, len(set(kinds)))


def test_a_multimodal_config_gives_its_text_model():
    full = dict(model_type="gemma3", image_token_index=262144,
                vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, num_hidden_layers=27),
                text_config=dict(_llama(layer_types=["sliding_attention"] * 5 + ["full_attention"] * 7),
                                 model_type="gemma3_text", query_pre_attn_scalar=64, head_dim=64))
    cfg, notes = shrink_config(full, Plan.parse("tp=2"))
    assert cfg["model_type"] == "gemma3_text" and "vision_config" not in cfg
    assert cfg["num_hidden_layers"] == 2 and cfg["num_attention_heads"] % 2 == 0
    assert cfg["query_pre_attn_scalar"] == cfg["head_dim"] == 16
    assert notes[0].startswith("multimodal gemma3 config: verifying its language model, text_config")


def test_a_text_model_that_is_no_causal_lm_of_its_own_stays_inside_its_composite():
    """Mllama's text model type is built through the Mllama config (AutoModelForCausalLM takes its
    text config): the composite is kept around the shrunk text config."""
    pytest.importorskip("transformers")
    full = dict(model_type="mllama", vision_config=dict(model_type="mllama_vision_model", hidden_size=1280),
                text_config=dict(_llama(), model_type="mllama_text_model"))
    cfg, notes = shrink_config(full, DP)
    assert cfg["model_type"] == "mllama" and cfg["vision_config"] == full["vision_config"]
    assert cfg["text_config"]["num_hidden_layers"] == 2 and cfg["text_config"]["vocab_size"] == 128
    assert "built inside the mllama config" in notes[0]


def test_a_config_without_layers_or_a_text_model_is_an_autopar_error():
    with pytest.raises(AutoparError, match="autopar: the model config lacks num_hidden_layers, hidden_size"):
        shrink_config(dict(model_type="x", vision_config=dict(num_hidden_layers=2), vocab_size=10), DP)


def test_a_field_no_rule_expects_is_an_autopar_error():
    with pytest.raises(AutoparError, match="autopar: could not shrink this llama config \\(ValueError"):
        shrink_config(dict(_llama(), num_key_value_heads="four"), DP)


@pytest.mark.parametrize("tp", [1, 2])
def test_mamba2_widths_stay_consistent(tp):
    """Mamba-2 has no attention heads: its own heads x head width = expand x hidden, its groups
    divide its heads, the state and the scan's chunk are small."""
    full = dict(model_type="mamba2", num_heads=128, head_dim=64, hidden_size=4096, expand=2, n_groups=8,
                state_size=128, num_hidden_layers=64, vocab_size=32768, time_step_rank=256, chunk_size=256)
    cfg, _ = shrink_config(full, Plan.parse(f"tp={tp}"))
    assert cfg["hidden_size"] == 64 and cfg["num_heads"] * cfg["head_dim"] == 2 * cfg["hidden_size"]
    assert cfg["num_heads"] % cfg["n_groups"] == 0 and 1 < cfg["n_groups"] <= 2
    assert cfg["state_size"] <= 16 and cfg["time_step_rank"] == 4 and cfg["chunk_size"] == 8


def test_recurrent_and_hybrid_models_shrink_without_or_beside_attention_heads():
    mamba, _ = shrink_config(dict(model_type="mamba", hidden_size=768, state_size=16, num_hidden_layers=32,
                                  vocab_size=50280, expand=2, intermediate_size=1536, time_step_rank=48), DP)
    assert (mamba["hidden_size"], mamba["intermediate_size"], mamba["time_step_rank"]) == (64, 128, 4)
    rwkv, _ = shrink_config(dict(model_type="rwkv", hidden_size=4096, attention_hidden_size=4096,
                                 intermediate_size=16384, num_hidden_layers=32, vocab_size=50277), DP)
    assert rwkv["hidden_size"] == rwkv["attention_hidden_size"] == 64
    bamba, _ = shrink_config(_llama(mamba_n_heads=128, mamba_d_head=64, mamba_expand=2, mamba_n_groups=1,
                                    mamba_d_state=256), DP)
    assert bamba["mamba_n_heads"] * bamba["mamba_d_head"] == 2 * bamba["hidden_size"]
    assert bamba["mamba_d_state"] == 16 and bamba["mamba_n_groups"] == 1


def test_encoder_decoder_and_gpt2_style_keys():
    """BART-style (decoder_layers, d_model, decoder_attention_heads, the encoder's alike), MPT-style
    (n_layers, n_heads) and GPT-Neo's attention_types are shrunk like num_hidden_layers & co."""
    bart, _ = shrink_config(dict(model_type="bart", d_model=1024, decoder_layers=12, encoder_layers=12,
                                 decoder_attention_heads=16, encoder_attention_heads=16, decoder_ffn_dim=4096,
                                 encoder_ffn_dim=4096, vocab_size=50265), DP)
    assert bart["decoder_layers"] == bart["encoder_layers"] == 2 and bart["d_model"] == 64
    assert bart["decoder_attention_heads"] == bart["encoder_attention_heads"] == 4
    assert bart["decoder_ffn_dim"] == bart["encoder_ffn_dim"] == 128
    mpt, _ = shrink_config(dict(model_type="mpt", d_model=2048, n_heads=16, n_layers=24, vocab_size=50368), DP)
    assert (mpt["n_layers"], mpt["n_heads"], mpt["d_model"]) == (2, 4, 64)
    neo, _ = shrink_config(dict(model_type="gpt_neo", hidden_size=2048, num_layers=24, num_heads=16,
                                vocab_size=50257, attention_types=[[["global", "local"], 12]],
                                attention_layers=["global", "local"] * 12), DP)
    assert neo["num_layers"] == 2 and neo["attention_layers"] == ["global", "local"]
    assert neo["attention_types"] == [[["global"], 1], [["local"], 1]]


def test_rotary_widths_fit_the_shrunk_head():
    """GPT-J rotates 64 of 256 head dims: a quarter of the 16-wide head; a share that is no whole
    even width of it is rounded to one."""
    gptj, notes = shrink_config(dict(model_type="gptj", n_embd=4096, n_head=16, n_layer=28, rotary_dim=64,
                                     vocab_size=50400), Plan.parse("tp=2"))
    assert gptj["n_layer"] == 2 and gptj["rotary_dim"] == 4 and gptj["n_embd"] == 16 * gptj["n_head"]
    assert any(n.startswith("rotary_dim 64 -> 4") for n in notes)
    odd, _ = shrink_config(_llama(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1}), DP)
    assert odd["rope_parameters"]["partial_rotary_factor"] * 16 == 2
    kept, _ = shrink_config(_llama(partial_rotary_factor=0.5), DP)
    assert kept["partial_rotary_factor"] == 0.5


def test_unset_fields_the_model_needs_are_written_out():
    """A default config that leaves head_dim, the KV heads or the experts per token None."""
    cfg, _ = shrink_config(dict(_llama(head_dim=None, num_experts_per_tok=None, n_routed_experts=64,
                                       moe_intermediate_size=1024), num_key_value_heads=None), DP)
    assert cfg["head_dim"] == 16 and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    assert cfg["num_experts_per_tok"] == 2


def test_default_configs_of_formerly_unshrinkable_types():
    """transformers' own default configs (configs only): the fields their validators check agree."""
    transformers = pytest.importorskip("transformers")
    for model_type, check in [
        ("gemma3", lambda c: c["model_type"] == "gemma3_text" and c["num_hidden_layers"] == 2),
        ("llama4", lambda c: c["model_type"] == "llama4_text" and c["num_local_experts"] <= 4),
        ("deepseek_v32", lambda c: len(c["mlp_layer_types"]) == 2 == len(set(c["mlp_layer_types"]))),
        ("kimi_linear", lambda c: sorted(set(c["layer_types"])) == ["full_attention", "linear_attention"]),
        ("xlstm", lambda c: c["num_hidden_layers"] == c["num_blocks"] == 2 and c["embedding_dim"] == 64),
        ("zamba2", lambda c: c["mamba_expand"] * c["hidden_size"] % c["n_mamba_heads"] == 0),
        ("zamba", lambda c: c["layers_block_type"] == ["hybrid", "hybrid"]),  # its shared block needs two
        ("falcon_h1", lambda c: c["mamba_d_ssm"] == c["mamba_n_heads"] * c["mamba_d_head"]),
        ("longcat_flash", lambda c: c["qk_head_dim"] == c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
        ("xlnet", lambda c: c["d_head"] * c["n_head"] == c["d_model"]),
        ("git", lambda c: c["vision_config"]["num_hidden_layers"] == 2 and c["vision_config"]["hidden_size"] == 32),
    ]:
        cfg, _ = shrink_config(transformers.AutoConfig.for_model(model_type).to_dict(), DP)
        assert check(cfg), (model_type, cfg)


@pytest.mark.parametrize("experts,ep,shrunk", [(64, 2, 4), (7, 2, 5), (7, 4, 7), (6, 4, 4), (1, 2, 2)])
def test_experts_shrink_as_unevenly_as_the_original(experts, ep, shrunk):
    """An ep that divides the experts divides the shrunk count; one that does not (FlexOlmo's 7 over
    ep=2) leaves it uneven, so the padding of the last rank acts; where no uneven count gives every
    rank an expert (6 over 4; HunYuan's 1 over 2) the count rounds up to a multiple of ep."""
    cfg, _ = shrink_config(_llama(num_local_experts=experts, num_experts_per_tok=1, moe_intermediate_size=1024),
                           Plan.parse(f"dp={ep},ep={ep}"))
    assert cfg["num_local_experts"] == shrunk
