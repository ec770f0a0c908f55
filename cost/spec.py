"""ModelSpec: the dimensions of a decoder-only transformer, as the cost model sees it.

A spec comes from a preset (:meth:`ModelSpec.preset`), a Hugging Face ``config.json``
(:meth:`ModelSpec.from_hf_config`), a traced model (:meth:`ModelSpec.from_module`, via
``autopar.frontend.model_dims.model_dims``) or is written out by hand. The formulas that use it are
in memory.py (parameters, activations), flops.py and comm.py; ``values()`` maps the
spec onto the symbols of symbols.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from autopar.errors import AutoparError

__all__ = ["ModelSpec", "PRESETS"]


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer (see the cost contract for each field).

    MoE layout: layer ``i`` (0-based) is a mixture-of-experts layer when
    ``num_experts > 0``, ``i >= first_dense_layers`` and ``(i + 1) % moe_layer_freq == 0``.
    Each MoE layer has a router (hidden x experts), ``num_experts`` routed experts and
    ``num_shared_experts`` always-on experts, each an MLP of width ``moe_ffn``.
    ``qk_norm``: the q and k projections' whole outputs are RMS-normalised before the heads are
    split (OLMo 2), one weight vector each of their width.  ``router_aux_loss``: the loss adds
    a load-balancing loss in Hugging Face's form (per MoE layer, the tokens routed to each expert
    and the summed router probabilities over every token of the batch; ``output_router_logits``).
    ``qk_head_norm``: q and k are RMS-normalised per head, over the head dim (Qwen3), one weight
    vector of the head dim each.  ``kv_lora_rank > 0``: multi-head latent attention (DeepSeek-V2/V3):
    q (through a ``q_lora_rank`` latent, when > 0) and k of ``head_dim`` = no-rope + rope
    (``qk_rope_head_dim``) dims, k and v expanded from one normalised ``kv_lora_rank`` latent, one
    rope key shared by every head, v of ``v_head_dim``; tensor parallelism does not split it.
    Beyond the decoder (``ModelSpec.from_module`` reads them, frontend/spec_dims.py): ``layer_norms``
    norms per layer; ``proj_bias``: biases on o_proj and the MLP (q/k/v's are ``qkv_bias``);
    ``fused_qkv``: q, k and v come from one fused projection (under KV-head replication its KV rows' gradients
    are summed in backward, cost/comm.py);
    ``embedding_extra_params`` (positions, token types) and ``embedding_norm`` (a norm of the summed
    embeddings, BERT's) on the first pp rank and ``head_extra_params`` (a head transform) on the last,
    replicated over tp; ``lm_head_bias``; ``gathered_logits``: the
    logits reach the loss through other ops than views, so tp all-gathers them instead of a
    vocabulary-parallel cross-entropy; ``seq_cumsums`` cumulative sums along the sequence, which cp
    makes global by all-gathering chunk totals of ``seq_cumsum_bytes`` per sample (summed over
    them); ``cp_kv_heads``: the K/V heads the attention op receives when the GQA broadcast is not
    right before it (RoPE after the broadcast), which the CP collectives then move;
    ``elementwise_factor``: a layer's element-wise kernels' bytes over those of a Llama layer of its
    sizes, counted on the traced graphs (1 for a config or preset), which scales the time model's
    element-wise formula; ``norm_weight_offset``: the final norm scales by 1 + weight (Gemma), so its backward never
    reads the weight and ZeRO-3 does not re-gather a unit of that norm alone.
    """

    name: str = "custom"
    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    ffn: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    gated_mlp: bool = True
    tied_embeddings: bool = False
    num_experts: int = 0
    top_k: int = 0
    moe_ffn: int | None = None
    moe_layer_freq: int = 1
    num_shared_experts: int = 0
    shared_expert_gate: bool = False  # a sigmoid gate Linear(hidden, 1) on the shared experts (Qwen2-MoE)
    first_dense_layers: int = 0
    norm: str = "rmsnorm"
    qkv_bias: bool = False
    qk_norm: bool = False
    router_aux_loss: bool = False
    qk_head_norm: bool = False
    fused_qkv: bool = False  # q, k and v come from one fused projection (GPT-2's c_attn, Phi-3's qkv_proj)
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (DeepSeek), k and v from this latent
    q_lora_rank: int = 0  # MLA: q through a latent of this rank (0: a full q projection)
    qk_rope_head_dim: int = 0  # MLA: the rope part of head_dim (q and k heads are nope + rope)
    v_head_dim: int | None = None  # V's head dim (default head_dim; MLA's is its own)
    layer_norms: int = 2  # norms per layer (Gemma 2 normalises the attention and MLP outputs again: 4)
    proj_bias: bool = False  # the attention output and MLP projections have biases (GPT-2, OPT, BERT)
    embedding_extra_params: int = 0  # embedding tables beyond the token table (learned positions, token types)
    embedding_norm: bool = False  # a norm right after the embeddings, on the first pp rank (BERT's embeddings.LayerNorm)
    head_extra_params: int = 0  # other parameters between the last layer and the LM head (BERT's MLM transform)
    lm_head_bias: bool = False  # the LM head has a bias of the vocabulary's size
    gathered_logits: bool = False  # the logits reach the loss through other ops (a soft cap): tp gathers them
    seq_cumsums: int = 0  # cumulative sums along the sequence kept by the program (OPT's mask-derived positions)
    seq_cumsum_bytes: int = 0  # their bytes per sample and position slice, summed over them
    elementwise_factor: float = 1.0  # a layer's element-wise bytes over a Llama layer's (frontend/elementwise.py)
    norm_weight_offset: bool = False  # norms scale by 1 + weight (Gemma): backward reads the sum, never the weight
    cp_kv_heads: int | None = None  # K/V heads CP moves (default num_kv_heads; Falcon's before transformers 5.25: num_heads)

    def __post_init__(self):
        for name in ("num_layers", "hidden", "num_heads", "vocab", "ffn", "moe_layer_freq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AutoparError(
                    f"autopar: ModelSpec.{name} must be a positive integer, got {value!r}"
                )
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.cp_kv_heads is None:
            object.__setattr__(self, "cp_kv_heads", self.num_kv_heads)
        if self.head_dim is None:
            if self.hidden % self.num_heads:
                raise AutoparError(
                    f"autopar: hidden={self.hidden} is not a multiple of num_heads="
                    f"{self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise AutoparError(
                f"autopar: num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.norm not in ("rmsnorm", "layernorm"):
            raise AutoparError(
                f"autopar: unknown norm {self.norm!r}; expected 'rmsnorm' or 'layernorm'"
            )
        if self.num_experts < 0 or self.top_k < 0 or self.first_dense_layers < 0:
            raise AutoparError("autopar: num_experts, top_k and first_dense_layers must be >= 0")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise AutoparError(
                    f"autopar: top_k={self.top_k} must be between 1 and num_experts="
                    f"{self.num_experts} for a mixture-of-experts model"
                )
            if self.moe_ffn is None:
                object.__setattr__(self, "moe_ffn", self.ffn)
        elif self.moe_ffn is None:
            object.__setattr__(self, "moe_ffn", 0)

    # ------------------------------------------------------------------ structure
    def is_moe_layer(self, index: int) -> bool:
        return bool(self.num_experts) and index >= self.first_dense_layers and (
            (index + 1) % self.moe_layer_freq == 0
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_layers > 0

    @property
    def norm_vectors(self) -> int:
        """Weight vectors per norm: RMSNorm has a scale, LayerNorm a scale and a bias."""
        return 1 if self.norm == "rmsnorm" else 2

    # ------------------------------------------------------------------ parameter counts
    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def attention_weight_params(self) -> int:
        """The projections' matrices (cost/flops.py ``attention_weights`` in numbers)."""
        hd, nh, nkv, H = self.head_dim, self.num_heads, self.num_kv_heads, self.hidden
        rq, rkv = self.q_lora_rank, self.kv_lora_rank
        q = H * rq + rq * nh * hd if rq else H * nh * hd
        kv = H * (rkv + self.qk_rope_head_dim) + rkv * nh * (hd - self.qk_rope_head_dim + self.v_dim) if rkv \
            else 2 * H * nkv * hd
        return q + kv + nh * self.v_dim * H

    @property
    def attention_params(self) -> int:
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        extra = (nh + 2 * nkv) * hd * int(self.qkv_bias)
        extra += (nh + nkv) * hd * int(self.qk_norm) + 2 * hd * int(self.qk_head_norm)
        extra += (self.q_lora_rank + self.kv_lora_rank) * int(self.kv_lora_rank > 0)  # the latents' norms
        return self.attention_weight_params + extra + self.hidden * int(self.proj_bias)  # o_proj's bias

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden * width

    @property
    def layer_norm_params(self) -> int:
        return self.layer_norms * self.hidden * self.norm_vectors

    @property
    def dense_layer_params(self) -> int:
        mlp_bias = ((2 if self.gated_mlp else 1) * self.ffn + self.hidden) * int(self.proj_bias)
        return self.attention_params + self.mlp_params(self.ffn) + mlp_bias + self.layer_norm_params

    @property
    def moe_layer_params(self) -> int:
        experts = (self.num_experts + self.num_shared_experts) * self.mlp_params(self.moe_ffn)
        router = self.hidden * (self.num_experts + int(self.shared_expert_gate))
        return self.attention_params + experts + router + self.layer_norm_params

    @property
    def embedding_params(self) -> int:
        norm = self.hidden * self.norm_vectors * int(self.embedding_norm)
        return self.vocab * self.hidden + self.embedding_extra_params + norm

    @property
    def head_params(self) -> int:
        """LM head plus final norm (the head matrix is absent when tied to the embedding)."""
        head = (0 if self.tied_embeddings else self.vocab * self.hidden) + self.vocab * int(self.lm_head_bias)
        return head + self.hidden * self.norm_vectors + self.head_extra_params

    @property
    def num_params(self) -> int:
        moe = self.num_moe_layers
        return (
            (self.num_layers - moe) * self.dense_layer_params
            + moe * self.moe_layer_params
            + self.embedding_params
            + self.head_params
        )

    @property
    def num_active_params(self) -> int:
        """Parameters touched per token (top-k routed plus shared experts per MoE layer)."""
        if not self.is_moe:
            return self.num_params
        idle = (self.num_experts - self.top_k) * self.mlp_params(self.moe_ffn)
        return self.num_params - self.num_moe_layers * idle

    # ------------------------------------------------------------------ constructors
    @classmethod
    def preset(cls, name: str) -> "ModelSpec":
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise AutoparError(
                f"autopar: unknown model preset {name!r}; expected one of "
                f"{', '.join(sorted(PRESETS))}, or describe the model with ModelSpec(...) "
                f"or ModelSpec.from_hf_config('config.json')"
            )
        return PRESETS[key]

    @classmethod
    def from_hf_config(cls, path_or_dict) -> "ModelSpec":
        """Read a transformers ``config.json`` (Llama, Mistral, Mixtral, Qwen2(-MoE), Qwen3, DeepSeek,
        GPT-2, OPT, Falcon, Gemma 2, OLMo 2, Phi-3, BERT keys)."""
        if isinstance(path_or_dict, dict):
            cfg = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path, encoding="utf-8") as fh:
                    cfg = json.load(fh)
            except (OSError, json.JSONDecodeError) as exc:
                raise AutoparError(
                    f"autopar: could not read a model config from {path!r} ({exc}); pass the "
                    f"path of a transformers config.json or a dict of its keys"
                ) from None
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = {**cfg, **cfg["text_config"]}
        return cls(**_fields_from_hf(cfg))

    @classmethod
    def from_module(cls, model, example_inputs, example_kwargs=None) -> "ModelSpec":
        from autopar.frontend.model_dims import model_dims  # lazy: pulls in torch and the tracer

        return cls(**model_dims(model, example_inputs, example_kwargs))

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def _get(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _fields_from_hf(cfg: dict) -> dict:
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    missing = [n for n, v in (("num_hidden_layers", layers), ("hidden_size", hidden),
                              ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        raise AutoparError(
            f"autopar: the model config lacks {', '.join(missing)}; expected a transformers "
            f"decoder config (e.g. LlamaConfig); describe the model with ModelSpec(...) instead"
        )
    model_type = str(cfg.get("model_type", "")).lower()
    gpt_style = model_type in ("gpt2", "gpt_neox", "gptj", "opt", "gpt_bigcode") or "n_embd" in cfg
    ffn = _get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden
    experts = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", default=0) or 0)
    fields = dict(
        name=str(_get(cfg, "_name_or_path", "model_type", default="hf-model")) or "hf-model",
        num_layers=int(layers), hidden=int(hidden), num_heads=int(heads), vocab=int(vocab),
        ffn=int(ffn),
        num_kv_heads=int(_get(cfg, "num_key_value_heads", default=heads)),
        head_dim=_get(cfg, "head_dim", default=None),
        gated_mlp=not gpt_style,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", gpt_style)),
        norm="layernorm" if gpt_style else "rmsnorm",
        qkv_bias=bool(_get(cfg, "attention_bias", "qkv_bias", default=model_type.startswith("qwen2"))
                      or gpt_style),
        qk_norm=model_type in ("olmo2", "olmo3"),
        qk_head_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        router_aux_loss=bool(cfg.get("output_router_logits", False)) and experts > 0,
    )
    if experts:
        moe_ffn = int(_get(cfg, "moe_intermediate_size", default=ffn))
        shared = int(_get(cfg, "n_shared_experts", "num_shared_experts", default=0) or 0)
        shared_width = cfg.get("shared_expert_intermediate_size")
        if not shared and shared_width:
            shared = max(1, round(shared_width / moe_ffn))  # Qwen-MoE: one wide shared expert
        freq = int(_get(cfg, "decoder_sparse_step", "moe_layer_freq", default=1) or 1)
        first_dense = int(_get(cfg, "first_k_dense_replace", default=0) or 0)
        fields.update(num_experts=experts, top_k=int(_get(cfg, "num_experts_per_tok", "top_k", default=2)),
                      moe_ffn=moe_ffn, num_shared_experts=shared, moe_layer_freq=freq,
                      first_dense_layers=first_dense, shared_expert_gate=bool(shared_width))
    fields.update(_beyond_decoder_fields(cfg, model_type, int(hidden), gpt_style))
    if model_type == "falcon":
        fields.update(_falcon_fields(cfg, int(heads), int(hidden)))
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3): its own head dims
        rope, nope = int(cfg.get("qk_rope_head_dim") or 0), int(cfg.get("qk_nope_head_dim") or 0)
        fields.update(kv_lora_rank=int(cfg["kv_lora_rank"]), q_lora_rank=int(cfg.get("q_lora_rank") or 0),
                      qk_rope_head_dim=rope, head_dim=nope + rope,
                      v_head_dim=int(_get(cfg, "v_head_dim", default=nope + rope)))
    if fields["head_dim"] is not None:
        fields["head_dim"] = int(fields["head_dim"])
    return fields


# Encoders with a masked-LM head (BERT, RoBERTa): learned positions and token types, a head
# transform (dense h x h with bias, then a LayerNorm) and a biased decoder over the vocabulary.
_ENCODERS = ("bert", "roberta")
# Decoders with a learned position table (OPT offsets its positions by 2 rows).
_LEARNED_POSITIONS = {"gpt2": 0, "gpt_bigcode": 0, "opt": 2}
# Norms per layer where the attention and MLP outputs are normalised again (Gemma 2 and 3).
_SANDWICH_NORMS = ("gemma2", "gemma3", "gemma3_text")
# One projection for q, k and v, cut at its parts (Falcon's is cut by KV group: not parts).
_FUSED_QKV = ("gpt2", "gpt_bigcode", "phi3")
# Norms that scale by 1 + weight (Gemma's RMSNorm).
_OFFSET_NORMS = ("gemma", "gemma2", "gemma3", "gemma3_text")


def _beyond_decoder_fields(cfg: dict, model_type: str, hidden: int, gpt_style: bool) -> dict:
    """The fields ``from_module`` reads beyond a Llama-style decoder (frontend/spec_dims.py), from
    the config's keys: the same values for the architectures the tests trace
    (tests/unit/test_architecture_rules.py compares both)."""
    encoder = model_type in _ENCODERS
    out: dict = {"proj_bias": gpt_style or encoder,
                 "gathered_logits": cfg.get("final_logit_softcapping") is not None,
                 "layer_norms": 4 if model_type in _SANDWICH_NORMS else 2,
                 "norm_weight_offset": model_type in _OFFSET_NORMS,
                 "fused_qkv": model_type in _FUSED_QKV}
    if model_type in _LEARNED_POSITIONS or encoder:
        rows = int(_get(cfg, "n_positions", "max_position_embeddings", default=0)) + _LEARNED_POSITIONS.get(model_type, 0)
        rows += int(cfg.get("type_vocab_size") or 0) if encoder else 0
        out["embedding_extra_params"] = rows * hidden
    if encoder:
        # the MLM transform (dense and LayerNorm; its LayerNorm takes the final norm's place) after
        # the layers, the embeddings' LayerNorm before them
        out.update(gated_mlp=False, norm="layernorm", qkv_bias=True, lm_head_bias=True,
                   tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                   head_extra_params=hidden * hidden + hidden, embedding_norm=True)
    if model_type == "opt":  # positions from the cumulative sum of the (fp32) attention mask
        out.update(seq_cumsums=1, seq_cumsum_bytes=4)
    return out


def _transformers_version() -> tuple[int, int]:
    """The installed transformers' (major, minor), read from its metadata (no import); the
    newest behaviour when it is not installed."""
    import importlib.metadata
    import re
    try:
        found = re.findall(r"\d+", importlib.metadata.version("transformers"))
    except importlib.metadata.PackageNotFoundError:
        return (10**6, 0)
    return (int(found[0]), int(found[1]) if len(found) > 1 else 0)


def _falcon_fields(cfg: dict, heads: int, hidden: int) -> dict:
    """Falcon's own keys: KV heads (``num_kv_heads`` in the new decoder architecture, one with
    multi-query attention), a plain GELU MLP, LayerNorms with bias, optional projection biases."""
    if cfg.get("new_decoder_architecture"):
        kv = int(_get(cfg, "num_kv_heads", default=heads))
    else:
        kv = 1 if cfg.get("multi_query", True) else heads
    # transformers < 5.25's new decoder applied RoPE after broadcasting K and V to every query
    # head, so CP moved all heads; 5.25 ropes the KV heads and hands them to SDPA unbroadcast.
    cp_kv = heads if cfg.get("new_decoder_architecture") and _transformers_version() < (5, 25) else kv
    return dict(num_kv_heads=kv, cp_kv_heads=cp_kv, ffn=int(_get(cfg, "ffn_hidden_size", default=4 * hidden)),
                gated_mlp=False,
                norm="layernorm", qkv_bias=bool(cfg.get("bias", False)), tied_embeddings=bool(
                    cfg.get("tie_word_embeddings", True)))


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(name="llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn=14336, vocab=128256),
        ModelSpec(name="llama3-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8,
                  ffn=28672, vocab=128256),
        ModelSpec(name="llama3-405b", num_layers=126, hidden=16384, num_heads=128, num_kv_heads=8,
                  ffn=53248, vocab=128256),
        ModelSpec(name="mixtral-8x7b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                  ffn=14336, vocab=32000, num_experts=8, top_k=2),
        # The reference document's worked example (section 6): 80 layers, hidden 8192, 64 heads
        # of 128 (no GQA: its W_qkv is H x 3H), 64 experts, top-2, one MoE layer in 4 (20 in
        # all), dense and expert MLP width 4H (its W_gate is H x 4H). It states no vocabulary;
        # we use Llama 3's 128256.
        ModelSpec(name="reference-moe", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=64,
                  head_dim=128, ffn=32768, vocab=128256, num_experts=64, top_k=2,
                  moe_ffn=32768, moe_layer_freq=4),
    )
}
