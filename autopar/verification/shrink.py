"""Shrink a Hugging Face config to a model a few CPU processes train in seconds.

:func:`shrink_config` takes a transformers ``config.json`` (as a dict) and a :class:`~autopar.plan.Plan`
and returns a copy with few layers and small widths, plus one note per change, for
``autopar verify`` (:mod:`autopar.verification.api`).  The architecture stays what it was
(model type, GQA grouping, MoE routing, tied embeddings, norms, biases, rotary setup); the
widths are cut so that everything the plan splits still splits: the query and KV heads by
``tp`` (``tp*cp`` under Ulysses; KV heads that tp does not divide stay so, replicated), the
experts by ``ep``, the vocabulary and MLP widths by
``tp``.  Whether the plan fits the *original* model is checked before shrinking
(:func:`autopar.plan.Plan.validate`), so shrinking never hides a refusal.

:func:`preset_config` writes a cost-model preset (``autopar.cost`` ``PRESETS``) as a
transformers config (Llama for dense presets, Mixtral for MoE ones).  No torch here.
"""
from __future__ import annotations

import copy
import math

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import head_split, kv_replicated

__all__ = ["shrink_config", "preset_config", "default_layers", "KEYS", "LENGTH_KEYS"]

# Canonical field -> the config keys different model families use for it (first present wins).
KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "moe_ffn": ("moe_intermediate_size",),
    "shared_ffn": ("shared_expert_intermediate_size",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok", "top_k"),
    "vocab": ("vocab_size",),
}
# Lengths a config holds that act only on sequences longer than them (attention windows, local
# attention chunks, a state-space scan's chunks): cut below the test sequence, so that a
# certificate covers what they do at the user's length.
LENGTH_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "local_attention_window_len",
               "chunk_size", "mamba_chunk_size")
HEAD_DIM = 16      # per-head width of the shrunk model
MAX_GROUP = 4      # query heads per KV head, at most
MIN_VOCAB = 128    # vocabulary of the shrunk model (rounded up to a multiple of tp)
MAX_EXPERTS = 4    # experts of the shrunk model, at least ep


def _key(cfg: dict, field: str) -> str | None:
    return next((k for k in KEYS[field] if cfg.get(k) is not None), None)


def _value(cfg: dict, field: str, default=None):
    key = _key(cfg, field)
    return cfg[key] if key is not None else default


def default_layers(plan: Plan) -> int:
    """Layers of the shrunk model: 2, or one per pipeline chunk when the plan has more chunks
    (never more than the model has)."""
    return max(2, plan.pp * plan.num_chunks_per_rank)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _short(value) -> str:
    """A config value for a note: long lists by their length and first entries."""
    if isinstance(value, list) and len(value) > 4:
        return f"[{', '.join(map(repr, value[:2]))}, ... ({len(value)} entries)]"
    return repr(value) if isinstance(value, str) else str(value)


class _Shrink:
    """One config being shrunk: ``set`` records each change as a note."""

    def __init__(self, cfg: dict):
        self.cfg = copy.deepcopy(cfg)
        self.notes: list[str] = []

    def set(self, key: str, value, why: str = "") -> None:
        old = self.cfg.get(key)
        if old == value:
            return
        self.cfg[key] = value
        self.notes.append(f"{key} {_short(old)} -> {_short(value)}" + (f" ({why})" if why else ""))

    def field(self, field: str, value, why: str = "") -> None:
        """Set ``field``'s key, and every other key of it that holds the same value (a config
        saved by transformers >= 5.25 writes Falcon's KV heads as both ``num_kv_heads`` and
        ``num_key_value_heads``); a key of it holding another value means something else."""
        key = _key(self.cfg, field)
        if key is None:
            return
        old = self.cfg[key]
        for alias in KEYS[field]:
            if alias == key or self.cfg.get(alias) == old:
                self.set(alias, value, why)


def shrink_config(cfg: dict, plan: Plan, layers: int | None = None, seq_len: int = 16) -> tuple[dict, list[str]]:
    """A small copy of transformers config ``cfg`` that ``plan`` still splits; and what changed.

    ``layers``: decoder layers to build (default :func:`default_layers`); ``seq_len``: the
    sequence length verify trains on (a sliding window is cut below it so that it matters)."""
    if "text_config" in cfg and _key(cfg, "layers") is None:
        raise AutoparError("autopar: this config describes a multimodal model (it has a text_config); "
                           "verify builds causal language models, so pass the text model's config.json "
                           "(the text_config part, with its model_type).")
    missing = [f for f in ("layers", "hidden", "heads", "vocab") if _key(cfg, f) is None]
    if missing:
        raise AutoparError(f"autopar: the model config lacks {', '.join(KEYS[f][0] for f in missing)}; "
                           "expected a transformers decoder config (e.g. a Llama or Qwen2 config.json).")
    s = _Shrink(cfg)
    original = int(_value(cfg, "layers"))
    num_layers = layers if layers is not None else min(default_layers(plan), original)
    _shrink_layers(s, num_layers, "--layers" if layers is not None else "default: one per pipeline chunk, at least 2")
    _shrink_attention(s, plan)
    _shrink_mlp(s, plan)
    _shrink_vocab(s, plan)
    _fixups(s, seq_len)
    return s.cfg, s.notes


def _shrink_layers(s: _Shrink, layers: int, why: str) -> None:
    cfg = s.cfg
    s.field("layers", layers, why)
    for key in ("layer_types", "no_rope_layers"):  # per-layer lists (attention kinds, NoPE layers)
        if isinstance(cfg.get(key), list) and len(cfg[key]) != layers:
            s.set(key, _every_kind(cfg[key], layers), "one entry per layer, every kind kept")
    if isinstance(cfg.get("mlp_only_layers"), list):
        s.set("mlp_only_layers", [i for i in cfg["mlp_only_layers"] if i < layers])
    if isinstance(cfg.get("first_k_dense_replace"), int) and cfg["first_k_dense_replace"] >= layers:
        s.set("first_k_dense_replace", layers // 2, "keep a mixture-of-experts layer")
    for key in ("decoder_sparse_step", "moe_layer_freq"):
        if isinstance(cfg.get(key), int) and cfg[key] > layers:
            s.set(key, layers, "keep a mixture-of-experts layer")
    if isinstance(cfg.get("max_window_layers"), int) and cfg["max_window_layers"] >= layers:
        # Qwen2-style: layers from max_window_layers on slide; keep both kinds where it had both.
        s.set("max_window_layers", layers // 2 if cfg.get("use_sliding_window") else layers,
              "sliding and full layers both" if cfg.get("use_sliding_window") else "")


def _every_kind(pattern: list, layers: int) -> list:
    """``layers`` entries of a per-layer list, repeating its pattern, with every kind of entry it
    has kept where the layers allow (a model whose sliding layers come last keeps one)."""
    out = [pattern[i % len(pattern)] for i in range(layers)]
    kinds = list(dict.fromkeys(map(repr, pattern)))
    missing = [next(v for v in pattern if repr(v) == k) for k in kinds if k not in set(map(repr, out))]
    if missing and len(kinds) <= layers:
        out[len(out) - len(missing):] = missing
    return out


def _shrunk_heads(kv: int, group: int, split: int) -> tuple[int, int]:
    """(KV heads, query heads) of the shrunk model.  Where ``split`` (tp, or Ulysses' tp*cp) divides
    the original KV heads (then new_kv <= kv): grouped-query attention keeps two KV groups (where it
    had them) of up to MAX_GROUP query heads, multi-head attention four heads (where it had them).
    Where it does not (KV-head replication, cp = 1: :func:`autopar.plan_space.kv_replicated`), the
    shrunk model keeps a KV-head count tp does not divide -- so the certificate covers the
    replicated path -- and query heads it does."""
    if not kv_replicated(split, kv):
        new_kv = _round_up(min(kv, 2 if group > 1 else 4), split)
        return new_kv, new_kv * min(group, MAX_GROUP)
    new_kv = next((n for n in range(min(kv, 2), kv + 1) if kv_replicated(split, n)), 1)
    return new_kv, new_kv * _round_up(min(group, MAX_GROUP), split // math.gcd(new_kv, split))


def _shrink_attention(s: _Shrink, plan: Plan) -> None:
    cfg = s.cfg
    heads = int(_value(cfg, "heads"))
    kv = int(_value(cfg, "kv_heads", heads))
    split = head_split(plan.tp, plan.cp, plan.cp_variant)
    new_kv, new_heads = _shrunk_heads(kv, heads // kv, split)
    hidden = int(_value(cfg, "hidden"))
    head_dim = int(_value(cfg, "head_dim", hidden // heads))
    new_head_dim = min(head_dim, HEAD_DIM)
    s.field("heads", new_heads, f"divisible by {split}" if split > 1 else "")
    if _key(cfg, "kv_heads") is not None:
        s.field("kv_heads", new_kv, "" if split == 1 else f"divisible by {split}" if not kv_replicated(split, new_kv)
                else f"not divisible by tp={split}: replicated on every tp rank")
    s.field("hidden", new_heads * new_head_dim, f"{new_heads} heads x {new_head_dim}")
    s.field("head_dim", new_head_dim)
    if cfg.get("query_pre_attn_scalar") == head_dim:  # Gemma: scores scaled by head_dim
        s.set("query_pre_attn_scalar", new_head_dim)
    if isinstance(cfg.get("word_embed_proj_dim"), int):  # OPT
        s.set("word_embed_proj_dim", new_heads * new_head_dim)
    if isinstance(cfg.get("qk_rope_head_dim"), int):  # MLA (DeepSeek): head_dim is the rope part
        _shrink_mla(s, new_head_dim)


def _shrink_mla(s: _Shrink, rope_dim: int) -> None:
    """Multi-head latent attention's widths: the rope part of q/k is ``head_dim``; the no-rope
    part, the value head and the low-rank q and kv projections shrink alike."""
    cfg = s.cfg
    s.set("qk_rope_head_dim", rope_dim, "the rope part of each q/k head (= head_dim)")
    for key, width in (("qk_nope_head_dim", 2 * rope_dim), ("v_head_dim", 2 * rope_dim),
                       ("kv_lora_rank", 2 * rope_dim), ("q_lora_rank", 4 * rope_dim)):
        if isinstance(cfg.get(key), int) and cfg[key] > width:
            s.set(key, width)


def _shrink_mlp(s: _Shrink, plan: Plan) -> None:
    cfg = s.cfg
    hidden = int(_value(cfg, "hidden"))  # already shrunk; a multiple of tp (heads are)
    if _value(cfg, "ffn") is not None:
        s.field("ffn", min(int(_value(cfg, "ffn")), 2 * hidden), f"divisible by tp={plan.tp}" if plan.tp > 1 else "")
    if _value(cfg, "moe_ffn") is not None:
        s.field("moe_ffn", min(int(_value(cfg, "moe_ffn")), hidden))
    if _value(cfg, "shared_ffn"):
        s.field("shared_ffn", min(int(_value(cfg, "shared_ffn")), hidden))
    experts = int(_value(cfg, "experts", 0) or 0)
    if experts:
        # ep divides the original experts (checked before shrinking), so new <= experts.
        new = _round_up(min(experts, MAX_EXPERTS), plan.ep)
        s.field("experts", new, f"divisible by ep={plan.ep}" if plan.ep > 1 else "")
        top_k = _value(cfg, "top_k")
        if top_k is not None and int(top_k) > new:
            s.field("top_k", new, "at most the experts")
        for key in ("n_group", "topk_group"):  # DeepSeek's grouped routing: one group
            if isinstance(cfg.get(key), int) and cfg[key] > 1:
                s.set(key, 1)
    first_dense = cfg.get("first_k_dense_replace")
    layers = int(_value(cfg, "layers"))  # already shrunk
    if isinstance(first_dense, int) and first_dense >= layers > 1:  # keep dense and MoE layers both
        s.set("first_k_dense_replace", 1, "one dense layer, then MoE layers")


def _shrink_vocab(s: _Shrink, plan: Plan) -> None:
    cfg = s.cfg
    vocab = int(_value(cfg, "vocab"))
    new = min(vocab, _round_up(MIN_VOCAB, plan.tp))
    s.field("vocab", new, f"divisible by tp={plan.tp}" if plan.tp > 1 else "")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = cfg.get(key)
        if isinstance(value, list):
            fixed = [v if v < new else new - 1 for v in value]
            if fixed != value:
                s.set(key, fixed, "inside the vocabulary")
        elif isinstance(value, int) and value >= new:
            s.set(key, new - 1, "inside the vocabulary")


def _fixups(s: _Shrink, seq_len: int) -> None:
    cfg = s.cfg
    for key, value in list(cfg.items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            s.set(key, 0.0, "dropout off: verify compares exact numerics")
    for key in LENGTH_KEYS:  # windows and chunks shorter than the sequence, so they act in the test
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > seq_len // 2 > 0:
            s.set(key, seq_len // 2, "shorter than the sequence, so it applies")
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) not in (None, "float32"):
            s.set(key, "float32", "verify runs in fp32")
    if "quantization_config" in cfg:
        del cfg["quantization_config"]
        s.notes.append("quantization_config dropped (verify trains fp32 weights)")


def preset_config(spec) -> dict:
    """A transformers config dict for cost-model preset ``spec`` (an ``autopar.cost.ModelSpec``)."""
    if spec.norm != "rmsnorm" or not spec.gated_mlp:
        raise AutoparError(f"autopar: preset {spec.name!r} is not a Llama-style model (RMSNorm, gated MLP); "
                           "give its transformers config.json instead.")
    cfg = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.ffn,
               num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
               num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
               tie_word_embeddings=spec.tied_embeddings, attention_bias=spec.qkv_bias,
               max_position_embeddings=8192, _name_or_path=spec.name)
    if not spec.is_moe:
        return dict(model_type="llama", **cfg)
    return dict(model_type="mixtral", num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                **{**cfg, "intermediate_size": spec.moe_ffn})
