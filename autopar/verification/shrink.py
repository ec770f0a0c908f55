"""Shrink a Hugging Face config to a model a few CPU processes train in seconds.

:func:`shrink_config` takes a transformers ``config.json`` (as a dict) and a :class:`~autopar.plan.Plan`
and returns a copy with few layers and small widths, plus one note per change, for
``autopar verify`` (:mod:`autopar.verification.api`) and the zoo (benchmarks/zoo_engine.py).  The
architecture stays what it was (model type, GQA grouping, MoE routing, tied embeddings, norms,
biases, rotary setup, every kind of layer where the layer count allows); the widths are cut so
that everything the plan splits still splits: the query and KV heads by ``tp`` (``tp*cp`` under
Ulysses; KV heads that tp does not divide stay so, replicated), the experts by ``ep``, the
vocabulary and MLP widths by ``tp``.  Whether the plan fits the *original* model is checked before
shrinking (:func:`autopar.plan.Plan.validate`), so shrinking never hides a refusal.

Here: the attention, MLP, MoE and vocabulary widths and the run-length fixups.  Its neighbours:
:mod:`autopar.verification.shrink_fields` (the keys families use for each quantity, the record
of changes, a multimodal config's text model, rotary widths, towers, unset fields) and
:mod:`autopar.verification.shrink_layers` (the layer cut with every per-layer entry, and
state-space widths: Mamba, RWKV, hybrids).

:func:`preset_config` writes a cost-model preset (``autopar.cost`` ``PRESETS``) as a
transformers config (Llama for dense presets, Mixtral for MoE ones).  No torch here.
"""
from __future__ import annotations

import copy
import math

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import experts_ok, head_split, kv_replicated
from autopar.verification.shrink_fields import (HEAD_DIM, KEYS, Shrink, fill_unset, fit_rotary, layer_count,
                                                round_up, scale_overrides, shrink_towers, text_model)
from autopar.verification.shrink_fields import key as _key
from autopar.verification.shrink_fields import value as _value
from autopar.verification.shrink_layers import cut_layers, shrink_state_space

__all__ = ["shrink_config", "preset_config", "default_layers", "KEYS", "LENGTH_KEYS"]

# Lengths a config holds that act only on sequences longer than them (attention windows, local
# attention chunks, a state-space scan's chunks, the keys a sparse-attention indexer keeps per
# query): cut below the test sequence, so that a
# certificate covers what they do at the user's length.
LENGTH_KEYS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "local_attention_window_len",
               "chunk_size", "mamba_chunk_size", "local_attn_chunk_length", "lsh_attn_chunk_length",
               "index_topk")
MAX_GROUP = 4      # query heads per KV head, at most
MIN_VOCAB = 128    # vocabulary of the shrunk model (rounded up to a multiple of tp)
MAX_EXPERTS = 4    # experts of the shrunk model, at least ep
# Model types whose causal LM class refuses a config that is not marked a decoder (an assertion in
# Reformer's); others with that flag (BERT-likes) build either way and are left as they are.
DECODER_ONLY = ("reformer",)


def default_layers(plan: Plan) -> int:
    """Layers of the shrunk model: 2, or one per pipeline chunk when the plan has more chunks
    (never more than the model has)."""
    return max(2, plan.pp * plan.num_chunks_per_rank)


def shrink_config(cfg: dict, plan: Plan, layers: int | None = None, seq_len: int = 16) -> tuple[dict, list[str]]:
    """A small copy of transformers config ``cfg`` that ``plan`` still splits; and what changed.

    ``layers``: decoder layers to build (default :func:`default_layers`); ``seq_len``: the
    sequence length verify trains on (a sliding window is cut below it so that it matters).
    A multimodal config gives its causal LM, the model of its ``text_config``
    (:func:`~autopar.verification.shrink_fields.text_model`)."""
    try:
        return _shrink(cfg, plan, layers, seq_len)
    except AutoparError:
        raise
    except Exception as exc:  # a field of a form no rule expects: say so, not a bare TypeError
        raise AutoparError(f"autopar: could not shrink this {cfg.get('model_type', '')} config ({type(exc).__name__}: "
                           f"{exc}); expected the fields of a transformers causal LM config: write a small "
                           "config.json yourself (--layers and widths as you want them) or pass a MODULE:FUNCTION."
                           ) from exc


def _shrink(cfg: dict, plan: Plan, layers: int | None, seq_len: int) -> tuple[dict, list[str]]:
    text, where, standalone = text_model(cfg)
    missing = [f for f in ("hidden", "vocab") if _key(text, f) is None]
    missing = (["layers"] if layer_count(text) is None else []) + missing
    if missing:
        raise AutoparError(f"autopar: the model config lacks {', '.join(KEYS[f][0] for f in missing)}"
                           f"{' (and has no text_config that has them)' if where is None else ''}; expected a "
                           "transformers decoder config (e.g. a Llama, Qwen2 or Mamba config.json).")
    s = Shrink(text)
    if where is not None:
        how = ("built as its own causal LM" if standalone else
               f"built inside the {cfg.get('model_type')} config, as transformers' AutoModelForCausalLM builds it")
        s.notes.append(f"multimodal {cfg.get('model_type')} config: verifying its language model, {where} "
                       f"(model_type {text.get('model_type')}, {how}); the other towers are not verified")
    original = layer_count(text)
    num_layers = layers if layers is not None else min(default_layers(plan), original)
    cut_layers(s, original, num_layers, "--layers" if layers is not None else "default: one per pipeline chunk, at least 2")
    # A model without attention heads (Mamba, RWKV), or whose only heads are a state-space mixer's
    # (Mamba-2's num_heads), is shrunk by its state-space widths alone.
    pure = _key(text, "heads") is None or (_key(text, "state") is not None and _key(text, "heads") == "num_heads")
    head_dims = (None, None) if pure else _shrink_attention(s, plan)
    shrink_state_space(s, plan, pure)
    if head_dims[0]:
        fit_rotary(s, *head_dims)
    _shrink_mlp(s, plan)
    _shrink_vocab(s, plan)
    scale_overrides(s)
    shrink_towers(s)
    fill_unset(s, head_dims[1])
    _fixups(s, seq_len)
    if where is None or standalone:
        return s.cfg, s.notes
    outer = copy.deepcopy(cfg)
    outer[where] = s.cfg
    return outer, s.notes


def _shrunk_heads(kv: int, group: int, split: int) -> tuple[int, int]:
    """(KV heads, query heads) of the shrunk model.  Where ``split`` (tp, or Ulysses' tp*cp) divides
    the original KV heads (then new_kv <= kv): grouped-query attention keeps two KV groups (where it
    had them) of up to MAX_GROUP query heads, multi-head attention four heads (where it had them).
    Where it does not (KV-head replication, cp = 1: :func:`autopar.plan_space.kv_replicated`), the
    shrunk model keeps a KV-head count tp does not divide -- so the certificate covers the
    replicated path -- and query heads it does."""
    if not kv_replicated(split, kv):
        new_kv = round_up(min(kv, 2 if group > 1 else 4), split)
        return new_kv, new_kv * min(group, MAX_GROUP)
    new_kv = next((n for n in range(min(kv, 2), kv + 1) if kv_replicated(split, n)), 1)
    return new_kv, new_kv * round_up(min(group, MAX_GROUP), split // math.gcd(new_kv, split))


def _shrink_attention(s: Shrink, plan: Plan) -> tuple[int, int]:
    """Heads, KV heads, hidden size and head dim; returns (old, new) head dim."""
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
    if isinstance(cfg.get("index_num_heads"), int) and cfg["index_num_heads"] > new_heads // new_kv:
        # Kolibri's sparse-attention indexer: heads within one KV group (its config checks it)
        s.set("index_num_heads", new_heads // new_kv, "at most the query heads of a KV head")
    if isinstance(cfg.get("word_embed_proj_dim"), int):  # OPT
        s.set("word_embed_proj_dim", new_heads * new_head_dim)
    if isinstance(cfg.get("qk_rope_head_dim"), int):  # MLA (DeepSeek): head_dim is the rope part
        _shrink_mla(s, head_dim, new_head_dim)
    return head_dim, new_head_dim


def _shrink_mla(s: Shrink, old_head_dim: int, new_head_dim: int) -> None:
    """Multi-head latent attention's widths.  Where the rope part of q/k is ``head_dim`` (DeepSeek),
    it is the shrunk head dim, and the no-rope part, the value head and the low-rank q and kv
    projections shrink alike.  Where the config's ``head_dim`` is wider than the rope part and a
    no-rope part is given (dots3, whose sliding layers' heads are the two parts together), every
    part keeps its share of the head."""
    cfg = s.cfg
    rope = cfg["qk_rope_head_dim"]
    if rope == old_head_dim or not isinstance(cfg.get("head_dim"), int) or not isinstance(cfg.get("qk_nope_head_dim"), int):
        s.set("qk_rope_head_dim", new_head_dim, "the rope part of each q/k head (= head_dim)")
        caps = (("qk_nope_head_dim", 2 * new_head_dim), ("v_head_dim", 2 * new_head_dim))
    else:
        share = new_head_dim / old_head_dim
        s.set("qk_rope_head_dim", max(2, 2 * round(rope * share / 2)), f"its share of the {new_head_dim}-wide head")
        caps = tuple((k, max(2, round(cfg[k] * share))) for k in ("qk_nope_head_dim", "v_head_dim")
                     if isinstance(cfg.get(k), int))
    for key, width in caps + (("kv_lora_rank", 2 * new_head_dim), ("q_lora_rank", 4 * new_head_dim)):
        if isinstance(cfg.get(key), int) and cfg[key] > width:
            s.set(key, width)
    if isinstance(cfg.get("qk_head_dim"), int):  # stored by some configs (LongCat-Flash): rope + no-rope parts
        s.set("qk_head_dim", cfg["qk_rope_head_dim"] + cfg.get("qk_nope_head_dim", 0), "the no-rope and rope parts")


def _shrink_mlp(s: Shrink, plan: Plan) -> None:
    cfg = s.cfg
    hidden = int(_value(cfg, "hidden"))  # already shrunk; a multiple of tp (heads are)
    ffn = _value(cfg, "ffn")
    if ffn is not None:  # a list: one width per layer (Gemma 3n), already cut with the layers
        s.field("ffn", [min(int(w), 2 * hidden) for w in ffn] if isinstance(ffn, list) else min(int(ffn), 2 * hidden),
                f"divisible by tp={plan.tp}" if plan.tp > 1 else "")
    if _value(cfg, "moe_ffn") is not None:
        s.field("moe_ffn", min(int(_value(cfg, "moe_ffn")), hidden))
    if _value(cfg, "shared_ffn"):
        s.field("shared_ffn", min(int(_value(cfg, "shared_ffn")), hidden))
    experts = int(_value(cfg, "experts", 0) or 0)
    if experts:
        # An ep that divides the experts divides the shrunk count too; one that does not keeps that,
        # so the padding of the last rank's experts acts in the test.
        new = min(experts, MAX_EXPERTS)
        uneven = [n for n in range(max(new, plan.ep), experts + 1) if n % plan.ep and experts_ok(plan.ep, n)]
        # An ep the original's count is not a multiple of stays uneven (up to the next such count) where
        # that can give every rank an expert; otherwise the count rounds up to ep (HunYuan's 1 over ep=2).
        new = uneven[0] if experts % plan.ep and uneven else round_up(new, plan.ep)
        s.field("experts", new, ("padded over" if new % plan.ep else "divisible by")
                + f" ep={plan.ep}" if plan.ep > 1 else "")
        top_k = _value(cfg, "top_k")
        if isinstance(top_k, int) and top_k > new:
            s.field("top_k", new, "at most the experts")
        zero = cfg.get("zero_expert_num")  # LongCat's identity experts, as many per routed one as before
        if isinstance(zero, int) and zero > 0:
            s.set("zero_expert_num", max(1, zero * new // experts), "identity experts in the same proportion")
        for key in ("n_group", "topk_group", "num_expert_group"):  # DeepSeek's grouped routing: one group
            if isinstance(cfg.get(key), int) and cfg[key] > 1:
                s.set(key, 1)
    first_dense = cfg.get("first_k_dense_replace")
    layers = layer_count(cfg)  # already shrunk
    if isinstance(first_dense, int) and first_dense >= layers > 1:  # keep dense and MoE layers both
        s.set("first_k_dense_replace", 1, "one dense layer, then MoE layers")


def _shrink_vocab(s: Shrink, plan: Plan) -> None:
    cfg = s.cfg
    vocab = int(_value(cfg, "vocab"))
    new = min(vocab, round_up(MIN_VOCAB, plan.tp))
    s.field("vocab", new, f"divisible by tp={plan.tp}" if plan.tp > 1 else "")
    for key, value in list(cfg.items()):  # other token tables (Gemma 3n's per-layer inputs): within it
        if key.startswith("vocab_size") and isinstance(value, int) and value > new:
            s.set(key, new, "a token table within the vocabulary")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = cfg.get(key)
        if isinstance(value, list):
            fixed = [v if v < new else new - 1 for v in value]
            if fixed != value:
                s.set(key, fixed, "inside the vocabulary")
        elif isinstance(value, int) and value >= new:
            s.set(key, new - 1, "inside the vocabulary")


def _fixups(s: Shrink, seq_len: int) -> None:
    cfg = s.cfg
    for key, value in list(cfg.items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
            s.set(key, 0.0, "dropout off: verify compares exact numerics")
    for key in LENGTH_KEYS:  # windows and chunks shorter than the sequence, so they act in the test
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > seq_len // 2 > 0:
            s.set(key, seq_len // 2, "shorter than the sequence, so it applies")
    _axial_positions(s, seq_len)
    if cfg.get("model_type") in DECODER_ONLY and not cfg.get("is_decoder"):
        s.set("is_decoder", True, "its causal LM class requires it")
    for key in ("dtype", "torch_dtype"):
        if cfg.get(key) not in (None, "float32"):
            s.set(key, "float32", "verify runs in fp32")
    if "quantization_config" in cfg:
        del cfg["quantization_config"]
        s.notes.append("quantization_config dropped (verify trains fp32 weights)")


def _axial_positions(s: Shrink, seq_len: int) -> None:
    """Reformer's axial position embeddings: their widths add up to the hidden size, and in training
    their shape multiplies out to the sequence length (its model checks both)."""
    cfg = s.cfg
    dims, shape = cfg.get("axial_pos_embds_dim"), cfg.get("axial_pos_shape")
    if not (cfg.get("axial_pos_embds") and isinstance(dims, list) and isinstance(shape, list) and len(dims) == 2):
        return
    hidden, total = int(_value(cfg, "hidden")), sum(dims)
    first = max(1, hidden * dims[0] // total)
    s.set("axial_pos_embds_dim", [first, hidden - first], f"adding up to the hidden size {hidden}")
    s.set("axial_pos_shape", [2, seq_len // 2], f"multiplying out to the sequence length {seq_len}")


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
