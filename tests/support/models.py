"""Model factories shared by the test suite (not a test module itself).

``MODELS`` maps a name to ``(factory, loss_fn, example_kwargs)``: ``factory(seed=0)``
returns a fresh model with deterministic weights, ``loss_fn(output, target)`` turns
its output into a scalar loss, and ``example_kwargs`` are the keyword arguments its
forward needs besides ``input_ids``. The example decoder lives in
``examples/model.py``; the Hugging Face Llama is built from a tiny config (no
downloads) and needs ``transformers``.
"""
from __future__ import annotations

import torch
from torch.export import Dim

from benchmarks.models import (example_model, example_module, example_moe, hf_llama, hf_loss, hf_model,  # noqa: F401
                               lm_loss, make_batch)

__all__ = [
    "example_module",
    "example_model",
    "hf_llama",
    "hf_loss",
    "hf_gpt2",
    "hf_mixtral",
    "example_moe",
    "hf_qwen_moe",
    "hf_jetmoe",
    "hf_gemma2",
    "hf_opt",
    "hf_phi3",
    "hf_gpt_bigcode",
    "hf_olmo2",
    "hf_mixtral_aux",
    "hf_qwen3",
    "hf_qwen3_next",
    "hf_lfm3",
    "hf_hy_v4",
    "hf_deepseek_v32",
    "hf_llama4",
    "HashMoE",
    "hash_moe",
    "example_head_split",
    "example_adapters",
    "position_mixer",
    "hf_llama_functions",
    "HalfGradient",
    "hf_mistral_window",
    "hf_qwen2_window",
    "hf_gemma2_window",
    "hf_gpt_oss_window",
    "aux_loss",
    "lm_loss",
    "make_batch",
    "MODELS",
    "dynamic_shapes",
    "logits_of",
]

def _example_tied(seed: int = 0, **overrides):
    return example_model(seed, tie_embeddings=True, **overrides)


def _example_fused(seed: int = 0, **overrides):
    return example_model(seed, fused_qkv=True, fused_gate_up=True, **overrides)


def hf_gpt2(seed: int = 0, **overrides):
    """A tiny ``transformers.GPT2LMHeadModel``: Conv1D (addmm, [in, out] weights), fused QKV,
    LayerNorm with bias, learned position embeddings, tied LM head; dropout off."""
    return hf_model("GPT2Config", "GPT2LMHeadModel", seed, dict(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"), overrides)


def hf_mixtral(seed: int = 0, **overrides):
    """A tiny ``transformers.MixtralForCausalLM``: stacked [E, ...] expert weights run by a grouped
    matmul on tokens sorted by expert (vocab 128, hidden 64, 2 layers, 4 experts, top-2)."""
    return hf_model("MixtralConfig", "MixtralForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="sdpa"), overrides)


def hf_qwen_moe(seed: int = 0, **overrides):
    """A tiny ``transformers.Qwen2MoeForCausalLM``: stacked experts plus a gated shared expert
    that every token passes through (vocab 128, hidden 64, 2 layers, 4 experts, top-2)."""
    return hf_model("Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=64, attn_implementation="sdpa"), overrides)


def hf_jetmoe(seed: int = 0, **overrides):
    """A tiny ``transformers.JetMoeForCausalLM``: MLP experts and attention experts (query and output
    projections around the attention), both stacked ``[E, out, in]`` weights applied expert by expert
    to rows split by per-expert counts (vocab 128, hidden 64, 2 layers, 4 experts, top-2)."""
    return hf_model("JetMoeConfig", "JetMoeForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        attn_implementation="sdpa"), overrides)


def hf_gemma2(seed: int = 0, **overrides):
    """A tiny ``transformers.Gemma2ForCausalLM``: four RMSNorms per layer (the attention and MLP
    outputs are normalised again after the row-parallel projection), ``(1 + weight)`` norms,
    a scaled embedding, attention-logit and final-logit soft-capping (eager attention: Gemma 2
    has no SDPA path), sliding-window layers, a tied LM head (vocab 128, hidden 64, 2 layers)."""
    return hf_model("Gemma2Config", "Gemma2ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=64,
        sliding_window=8, attn_implementation="eager"), overrides)


def hf_opt(seed: int = 0, **overrides):
    """A tiny ``transformers.OPTForCausalLM``: learned positions derived from the attention mask
    (``cumsum`` of an all-ones mask when none is given), LayerNorm with bias, biased projections,
    a tied LM head; dropout off (vocab 128, hidden 64, 2 layers, 4 heads)."""
    return hf_model("OPTConfig", "OPTForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        attn_implementation="sdpa"), overrides)


def hf_phi3(seed: int = 0, **overrides):
    """A tiny ``transformers.Phi3ForCausalLM``: fused qkv cut by slicing (``qkv[..., :q]``), fused
    gate_up cut by ``chunk`` (vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads)."""
    return hf_model("Phi3Config", "Phi3ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, attn_implementation="sdpa"), overrides)


def hf_gpt_bigcode(seed: int = 0, **overrides):
    """A tiny ``transformers.GPTBigCodeForCausalLM``: multi-query attention (one KV head) whose
    ``c_attn`` projects the query heads and the KV head in one fused weight, cut by ``split``
    (vocab 128, hidden 64, 2 layers, 4 heads)."""
    return hf_model("GPTBigCodeConfig", "GPTBigCodeForCausalLM", seed, dict(
        vocab_size=128, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=64, multi_query=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa"), overrides)


MODELS = {
    "example": (example_model, lm_loss, {}),
    "example_tied": (_example_tied, lm_loss, {}),
    "example_fused": (_example_fused, lm_loss, {}),
    "hf_llama": (hf_llama, hf_loss, {"use_cache": False}),
    "hf_gpt2": (hf_gpt2, hf_loss, {"use_cache": False}),
    "example_moe": (example_moe, lm_loss, {}),
    "hf_mixtral": (hf_mixtral, hf_loss, {"use_cache": False}),
    "hf_qwen_moe": (hf_qwen_moe, hf_loss, {"use_cache": False}),
    "hf_jetmoe": (hf_jetmoe, hf_loss, {"use_cache": False}),
    "hf_gemma2": (hf_gemma2, hf_loss, {"use_cache": False}),
    "hf_opt": (hf_opt, hf_loss, {"use_cache": False}),
    "hf_phi3": (hf_phi3, hf_loss, {"use_cache": False}),
    "hf_gpt_bigcode": (hf_gpt_bigcode, hf_loss, {"use_cache": False}),
}


def hf_olmo2(seed: int = 0, **overrides):
    """A tiny ``transformers.Olmo2ForCausalLM``: q and k RMS-normalised over the whole projection
    width (before the heads are split), norms after attention and MLP (vocab 128, hidden 64, 2 layers)."""
    return hf_model("Olmo2Config", "Olmo2ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        attn_implementation="sdpa"), overrides)


MODELS["hf_olmo2"] = (hf_olmo2, hf_loss, {"use_cache": False})


def hf_mixtral_aux(seed: int = 0, **overrides):
    """:func:`hf_mixtral` with ``output_router_logits=True``: the model also returns its
    load-balancing loss (token fractions per expert times mean router probabilities, over every
    token of the batch), which :func:`aux_loss` adds to the cross-entropy."""
    return hf_mixtral(seed, **{"output_router_logits": True, **overrides})


def aux_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the load-balancing loss, weighted 0.1 (Mixtral trains with 0.02; larger
    here so a rank-local statistic would move the router weights past the tests' tolerance)."""
    return hf_loss(output, target) + 0.1 * output.aux_loss


MODELS["hf_mixtral_aux"] = (hf_mixtral_aux, aux_loss, {"use_cache": False})


def hf_qwen3(seed: int = 0, **overrides):
    """A tiny ``transformers.Qwen3ForCausalLM``: q and k RMS-normalised per head (over the head
    dim, which tp does not split), an explicit head dim (vocab 128, hidden 64, 2 layers)."""
    return hf_model("Qwen3Config", "Qwen3ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa"), overrides)


MODELS["hf_qwen3"] = (hf_qwen3, hf_loss, {"use_cache": False})


def hf_qwen3_next(seed: int = 0, **overrides):
    """A tiny dense ``transformers.Qwen3NextForCausalLM``: layer 0 a gated delta net (linear
    attention: q|k|v|z and b|a projected grouped by key head, q|k|v concatenated and convolved per
    channel, 2 key heads repeated to 4 value heads, a chunked recurrence, a gated norm per head),
    layer 1 full attention; dense MLPs, so plain tp runs too (vocab 128, hidden 64)."""
    return hf_model("Qwen3NextConfig", "Qwen3NextForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"], num_experts=0, mlp_only_layers=[0, 1],
        max_position_embeddings=64, attn_implementation="sdpa"), overrides)


MODELS["hf_qwen3_next"] = (hf_qwen3_next, hf_loss, {"use_cache": False})


def hf_lfm3(seed: int = 0, **overrides):
    """A tiny ``transformers.Lfm3ForCausalLM``: layer 0 a short convolution (``in_proj`` fused
    B|C|x, transposed to channels first and chunked in three, ``B * x`` convolved per channel over
    a causal window of 3, gated by C, ``out_proj``), layer 1 full attention; sandwich norms (vocab
    128, hidden 64)."""
    return hf_model("Lfm3Config", "Lfm3ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["conv", "full_attention"], conv_L_cache=3,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, max_position_embeddings=64,
        attn_implementation="sdpa"), overrides)


MODELS["hf_lfm3"] = (hf_lfm3, hf_loss, {"use_cache": False})


def hf_mamba(seed: int = 0, **overrides):
    """A tiny ``transformers.MambaForCausalLM``: its scan loops over the positions, so export fixes
    the sequence length (no sequence symbol: SP finds the sequence by its length); ``in_proj``
    fused x|z chunked after a transpose to channels first, a depthwise convolution, ``x_proj``
    contracting the channels into the step sizes and B, C (read again by the scan), ``dt_proj``,
    ``out_proj`` (vocab 128, hidden 64, 2 layers, 128 channels, state 16)."""
    return hf_model("MambaConfig", "MambaForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=8, initializer_range=0.02), overrides)


MODELS["hf_mamba"] = (hf_mamba, hf_loss, {"use_cache": False})


def hf_mamba2(seed: int = 0, **overrides):
    """A tiny ``transformers.Mamba2ForCausalLM``: ``in_proj`` fused z|xBC|dt, its xBC split into
    x|B|C after the depthwise convolution, B and C one group shared by the 8 heads (every tp rank
    keeps them whole), a chunked scan over chunks of 4 (the test sequence spans 4 chunks), a gated
    norm over all channels, ``out_proj`` (vocab 128, hidden 64, 2 layers, 8 heads of 16, state 16)."""
    return hf_model("Mamba2Config", "Mamba2ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, num_heads=8, head_dim=16,
        n_groups=1, conv_kernel=4, chunk_size=4, tie_word_embeddings=False, initializer_range=0.02), overrides)


MODELS["hf_mamba2"] = (hf_mamba2, hf_loss, {"use_cache": False})


def hf_falcon(seed: int = 0, **overrides):
    """A tiny ``transformers.FalconForCausalLM`` with the new decoder architecture: one fused qkv
    laid out by KV group (each group's query heads, then its key and value) and cut by slices and
    list indices, projections written ``x @ w.T``, attention and MLP in parallel from two norms
    (vocab 128, hidden 64, 2 layers, 4 heads in 2 KV groups)."""
    return hf_model("FalconConfig", "FalconForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, parallel_attn=True, bias=False, alibi=False, multi_query=False,
        max_position_embeddings=64, attn_implementation="sdpa"), overrides)


MODELS["hf_falcon"] = (hf_falcon, hf_loss, {"use_cache": False})


def hf_deepseek_v3(seed: int = 0, **overrides):
    """A tiny ``transformers.DeepseekV3ForCausalLM``: multi-head latent attention (low-rank q and kv
    projections, a rope / no-rope split of each head, K wider than V), a dense first layer, then a
    MoE layer with a shared expert and sigmoid routing limited to the best of two expert groups
    (score-correction bias, routing weights gathered from the scores) (vocab 128, hidden 64,
    2 layers, 4 heads, 4 experts, top-2)."""
    model = hf_model("DeepseekV3Config", "DeepseekV3ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        max_position_embeddings=64, rope_interleave=True, attn_implementation="sdpa"), overrides)
    with torch.no_grad():  # a score-correction bias that changes the picks (a trained model's is not 0)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.tensor([0.02, -0.01, 0.01, -0.02]))
    return model


MODELS["hf_deepseek_v3"] = (hf_deepseek_v3, hf_loss, {"use_cache": False})


def hf_llama4(seed: int = 0, **overrides):
    """A tiny ``transformers.Llama4ForCausalLM``: dense experts (the tokens repeated per expert, scaled
    by the sigmoid of the top-k router logits, one batched matmul over all 4 experts, summed) beside a
    shared expert (vocab 128, hidden 64, 2 layers, 4 heads, top-2)."""
    return hf_model("Llama4TextConfig", "Llama4ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, attn_implementation="sdpa"), overrides)


MODELS["hf_llama4"] = (hf_llama4, hf_loss, {"use_cache": False})


def hf_hy_v4(seed: int = 0, **overrides):
    """A tiny ``transformers.HYV4ForCausalLM``: sparse attention whose indexer keeps 8 of the 16
    keys per query (``index_topk`` below the test sequence, so the selection acts), computed by
    layers 0 and 1 and reused by layers 2 and 3 (``indexer_types`` "shared": the int32 top-k
    indices are a layer's second output, so a pipeline cut between layers 1 and 2 sends them),
    low-rank q / kv projections, hyper-connection streams, a dense MLP then MoE layers (vocab 128,
    hidden 64, 4 layers, 4 heads, 4 experts, top-2)."""
    return hf_model("HYV4Config", "HYV4ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        mlp_layer_types=["dense", "sparse", "dense", "sparse"], layer_types=["indexed_attention"] * 4,
        indexer_types=["full", "full", "shared", "shared"], index_topk=8, index_n_heads=2, index_head_dim=16,
        pad_token_id=127, bos_token_id=127, eos_token_id=127, max_position_embeddings=64), overrides)


MODELS["hf_hy_v4"] = (hf_hy_v4, hf_loss, {"use_cache": False})


def hf_deepseek_v32(seed: int = 0, **overrides):
    """A tiny ``transformers.DeepseekV32ForCausalLM``: latent attention with a sparse-attention
    indexer keeping 8 of the 16 keys per query (``index_topk`` below the test sequence); the
    indexer's ``min(index_topk, seq)`` is one SymInt that every later layer reuses, so a pipeline
    cut carries a size, not a tensor; 2 dense layers then 2 MoE layers (vocab 128, hidden 64,
    4 layers, 4 heads, 4 experts, top-2)."""
    return hf_model("DeepseekV32Config", "DeepseekV32ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=2, index_topk=8, index_n_heads=2, index_head_dim=16,
        max_position_embeddings=64), overrides)


MODELS["hf_deepseek_v32"] = (hf_deepseek_v32, hf_loss, {"use_cache": False})


def hf_bert(seed: int = 0, **overrides):
    """A tiny ``transformers.BertForMaskedLM``: an encoder (bidirectional attention: its mask
    allows every position), learned positions sliced from a buffer, token-type embeddings,
    post-LayerNorm, attention and MLP each split over two sibling modules, a tied head with a
    transform and a bias; dropout off (vocab 128, hidden 64, 2 layers, 4 heads)."""
    return hf_model("BertConfig", "BertForMaskedLM", seed, dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
        type_vocab_size=2, attn_implementation="sdpa"), overrides)


MODELS["hf_bert"] = (hf_bert, hf_loss, {})


def hf_mistral_window(seed: int = 0, **overrides):
    """A tiny ``transformers.MistralForCausalLM`` whose sliding window (8 tokens) is shorter than the
    tests' sequence (16): the window acts in every test (vocab 128, hidden 64, 2 layers, GQA)."""
    return hf_model("MistralConfig", "MistralForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=8, attn_implementation="sdpa"),
        overrides)


MODELS["hf_mistral_window"] = (hf_mistral_window, hf_loss, {"use_cache": False})


_WINDOWED = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)


def hf_qwen2_window(seed: int = 0, **overrides):
    """A tiny ``transformers.Qwen2ForCausalLM`` with ``use_sliding_window``: layer 0 full attention,
    layer 1 an 8-token window (``max_window_layers=1``), shorter than the tests' sequence (16)."""
    return hf_model("Qwen2Config", "Qwen2ForCausalLM", seed, dict(
        _WINDOWED, use_sliding_window=True, max_window_layers=1, attn_implementation="sdpa"), overrides)


def hf_gemma2_window(seed: int = 0, **overrides):
    """A tiny ``transformers.Gemma2ForCausalLM``, its local layers with an 8-token window (shorter than
    the sequence).  transformers 5.25 refuses SDPA for Gemma 2 (its soft-capped scores), so it runs
    its eager attention, whose mask the graph keeps."""
    return hf_model("Gemma2Config", "Gemma2ForCausalLM", seed, dict(_WINDOWED, head_dim=16, attn_implementation="eager"),
               overrides)


def hf_gpt_oss_window(seed: int = 0, **overrides):
    """A tiny ``transformers.GptOssForCausalLM``: alternating 8-token-window and full layers, attention
    sinks (eager attention: transformers 5.25 has no SDPA path for it), 4 experts, top-2."""
    return hf_model("GptOssConfig", "GptOssForCausalLM", seed, dict(
        _WINDOWED, head_dim=16, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager"), overrides)


MODELS["hf_qwen2_window"] = (hf_qwen2_window, hf_loss, {"use_cache": False})
MODELS["hf_gemma2_window"] = (hf_gemma2_window, hf_loss, {"use_cache": False})
MODELS["hf_gpt_oss_window"] = (hf_gpt_oss_window, hf_loss, {"use_cache": False})


def logits_of(out):
    """A model's logits: a transformers output's ``.logits``, or the tensor itself."""
    return out.logits if hasattr(out, "logits") else out


def dynamic_shapes(kwargs):
    """Symbolic batch and sequence dimensions of ``input_ids`` (the models' tables hold 64 positions)."""
    batch, seq = Dim("batch"), Dim("seq", max=64)
    if kwargs:
        spec = {"input_ids": {0: batch, 1: seq}}
        spec.update({k: None for k in kwargs})
        return spec
    return ({0: batch, 1: seq},)


class _PositionMix(torch.nn.Module):
    """A layer that mixes positions by a running sum over the sequence of ``h`` read transposed
    (channels first), so the gradient of its input is a strided tensor (a transpose of a
    contiguous one)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((hidden, 1), 0.5))
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, h):
        return self.norm((h.transpose(1, 2).cumsum(-1) * self.scale).transpose(1, 2))


class PositionMixer(torch.nn.Module):
    """Embedding, ``num_layers`` position-mixing layers, a head (vocab 128, hidden 32)."""

    def __init__(self, num_layers: int = 2, hidden: int = 32, vocab: int = 128):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(_PositionMix(hidden) for _ in range(num_layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def position_mixer(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return PositionMixer(**overrides)


MODELS["position_mixer"] = (position_mixer, lm_loss, {})



class HalfGradient(torch.autograd.Function):
    """The identity whose backward halves the gradient: not autograd's derivative of its forward."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class _GatedPair(torch.autograd.Function):
    """``(silu(g) * u, u * slope)`` (a tuple, a float argument), whose backward drops the SiLU's
    second term and doubles the second output's share: a straight-through estimate."""

    @staticmethod
    def forward(ctx, g, u, slope):
        ctx.save_for_backward(g, u)
        ctx.slope = slope
        return torch.nn.functional.silu(g) * u, u * slope

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        g, u = ctx.saved_tensors
        return grad_a * u * torch.sigmoid(g), grad_a * torch.nn.functional.silu(g) + 2 * ctx.slope * grad_b, None


class _FunctionMLP(torch.nn.Module):
    """Llama's MLP through two custom Functions, its projections kept (so tp splits them)."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x):
        x = HalfGradient.apply(x)
        a, b = _GatedPair.apply(self.gate_proj(x), self.up_proj(x), 0.25)
        return self.down_proj(a + b)


def hf_llama_functions(seed: int = 0, **overrides):
    """A tiny Llama whose MLPs apply custom ``torch.autograd.Function`` s with their own backward
    (kept whole by the trace and run as they are: autopar/frontend/custom_functions.py)."""
    model = hf_llama(seed, **overrides)
    for layer in model.model.layers:
        layer.mlp = _FunctionMLP(layer.mlp)
    return model


MODELS["hf_llama_functions"] = (hf_llama_functions, hf_loss, {"use_cache": False})


class HashMoE(torch.nn.Module):
    """A tiny LM whose one MoE block routes by hash, as DeepSeek-V4's first layers do: the experts of
    token ``t`` are row ``input_ids[t]`` of a fixed ``[vocab, k]`` table (a buffer), weighted by a
    learned router's scores gathered at them; stacked experts run by transformers' grouped matmul on
    the (token, slot) rows sorted by expert, counted by a histogram (vocab 128, hidden 32, 4 experts,
    top-2)."""

    def __init__(self, vocab: int = 128, hidden: int = 32, width: int = 16, experts: int = 4, top_k: int = 2):
        super().__init__()
        from transformers.integrations import moe as _hf_moe  # noqa: F401  (registers grouped_mm_fallback)

        self.num_experts = experts
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.register_buffer("tid2eid", torch.randint(0, experts, (vocab, top_k)))
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * width, hidden) / hidden ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, width) / width ** 0.5)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        x = h.reshape(-1, h.shape[-1])
        scores = torch.nn.functional.softplus(self.router(x)).sqrt()
        index = self.tid2eid[input_ids.reshape(-1)].long()
        weights = scores.gather(1, index)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.head(h + self.experts(x, index, weights).view_as(h))

    def experts(self, x, index, weights):
        top_k, grouped_mm = index.shape[1], torch.ops.transformers.grouped_mm_fallback
        keys, perm = index.reshape(-1).sort()
        rows = x[perm // top_k]
        counts = torch.histc(keys.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = counts.cumsum(0, dtype=torch.int32)
        gate, up = grouped_mm(rows, self.gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
        out = grouped_mm(torch.nn.functional.silu(gate) * up, self.down.transpose(-2, -1), offsets)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, top_k, x.shape[-1]).sum(1)


def hash_moe(seed: int = 0, **overrides):
    """:class:`HashMoE` with weights and a table of expert ids from ``seed``."""
    torch.manual_seed(seed)
    return HashMoE(**overrides)


MODELS["hash_moe"] = (hash_moe, lm_loss, {})


class _CastLinear(torch.nn.Linear):
    """A linear that casts its input and weight to fp32 first (Ergo's ``ErgoLinearWithFP32Output``)."""

    def forward(self, x):
        return torch.nn.functional.linear(x.float(), self.weight.float())


def example_head_split(seed: int = 0, **overrides):
    """The example decoder written as Ergo's attention is: its fused qkv viewed into heads and split by
    heads, in counts of heads (``qkv(x).view(b, s, -1, d).split((heads, kv_heads, kv_heads), dim=-2)``),
    and every linear casting its weight to fp32 before the product (the graph's weights reach their
    projections through casts)."""
    model = example_model(seed, fused_qkv=True, **overrides)
    base, rotary = type(model.layers[0].attn), example_module()._apply_rotary

    class HeadSplitAttention(base):
        def forward(self, x, cos, sin):
            batch, seq, _ = x.shape
            qkv = self.qkv_proj(x).view(batch, seq, -1, self.head_dim)
            q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=-2)
            q, k, v = rotary(q.transpose(1, 2), cos, sin), rotary(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim))

    for layer in model.layers:
        layer.attn.__class__ = HeadSplitAttention
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.bias is None:
            module.__class__ = _CastLinear
    return model


MODELS["example_head_split"] = (example_head_split, lm_loss, {})


class AdapterDecoder(torch.nn.Module):
    """The example decoder with XMOD's language adapters after every layer: the batch's rows picked by
    a boolean mask of their group (``input_ids.sum(-1) % num_adapters``), each group through its own
    linear, written back by the mask (``out[mask] = adapter(h[mask])``)."""

    def __init__(self, decoder: torch.nn.Module, num_adapters: int = 2):
        super().__init__()
        self.decoder = decoder
        hidden, num_layers = decoder.config.hidden_size, len(decoder.layers)
        self.adapters = torch.nn.ModuleList(  # per layer, as XMOD's are
            torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(num_adapters)) for _ in range(num_layers))

    def forward(self, input_ids):
        d = self.decoder
        positions = torch.arange(input_ids.shape[1], device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, d.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        groups = self.groups(input_ids)
        x = d.embed_tokens(input_ids)
        for layer, adapters in zip(d.layers, self.adapters):
            x = layer(x, cos, sin)
            out = torch.zeros_like(x)
            for i, adapter in enumerate(adapters):
                mask = groups == i
                out[mask] = adapter(x[mask])
            x = x + out
        return d.lm_head(d.norm(x))

    def groups(self, input_ids):
        """Each row's adapter: by the sum of its tokens."""
        return input_ids.sum(-1) % len(self.adapters[0])


def example_adapters(seed: int = 0, **overrides):
    model = example_model(seed, **overrides)
    return AdapterDecoder(model)


MODELS["example_adapters"] = (example_adapters, lm_loss, {})
