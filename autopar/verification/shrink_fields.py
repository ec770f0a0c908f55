"""What the shrinker reads and writes with: the keys of each quantity, the config being shrunk, and
the rules for the fields around the attention and MLP widths.

:mod:`autopar.verification.shrink` (:func:`~autopar.verification.shrink.shrink_config`, used by
``autopar verify`` and by the zoo, benchmarks/zoo_engine.py) shrinks a transformers config; the
layer cut and the state-space widths are :mod:`autopar.verification.shrink_layers`.  Here:

* :data:`KEYS`: the config keys model families use for each quantity (``n_layer``,
  ``decoder_layers``, ``d_model``, ``mamba_d_state``, ...), and :class:`Shrink`, the copy being
  shrunk, which notes each change;
* :func:`text_model`: the causal LM inside a multimodal config (its ``text_config``);
* :func:`fit_rotary`: ``rotary_dim`` / ``partial_rotary_factor`` consistent with the shrunk head dim;
* :func:`shrink_towers`: a multimodal causal LM's vision and audio towers;
* :func:`scale_overrides`: per-layer overrides (``per_layer_config``) scaled like the fields they override;
* :func:`fill_unset`: fields a default config leaves ``None`` that the model's code needs.

No torch here (transformers' model-type table is read lazily, only to unwrap a multimodal config).
"""
from __future__ import annotations

import copy

__all__ = ["KEYS", "HEAD_DIM", "Shrink", "key", "value", "layer_count", "round_up", "text_model", "fit_rotary",
           "scale_overrides", "shrink_towers", "fill_unset"]

# Canonical field -> the config keys different model families use for it (first present wins;
# :meth:`Shrink.field` also changes the other keys of the field that hold the same value: an
# encoder-decoder's encoder_layers beside its decoder_layers, xLSTM's num_blocks beside its layers).
KEYS = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
               "num_blocks", "encoder_layers", "num_encoder_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model", "emb_dim", "embedding_dim"),
    "heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads",
              "num_decoder_attention_heads", "encoder_attention_heads", "num_encoder_attention_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim", "d_head", "attention_head_size"),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "feed_forward_size"),
    "moe_ffn": ("moe_intermediate_size",),
    "shared_ffn": ("shared_expert_intermediate_size",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "top_k", "num_experts_per_token", "moe_topk", "moe_k"),
    "vocab": ("vocab_size",),
    # State-space (Mamba-style) mixers: the state per channel, their own heads and head width, the
    # expansion of the hidden size they work in, the groups of B/C projections, the time-step rank.
    "state": ("state_size", "ssm_state_size", "mamba_d_state"),
    "ssm_heads": ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"),
    "ssm_head_dim": ("mamba_d_head", "mamba_head_dim", "mamba_headdim"),
    "expand": ("expand", "mamba_expand"),
    "ssm_groups": ("n_groups", "mamba_n_groups", "mamba_ngroups"),
    "dt_rank": ("time_step_rank", "mamba_dt_rank"),
}
HEAD_DIM = 16  # per-head width of the shrunk model
# Where a composite config keeps its language model (transformers' get_text_config looks there).
TEXT_KEYS = ("text_config", "decoder")


def key(cfg: dict, field: str) -> str | None:
    """The first key of ``field`` that ``cfg`` sets (not None)."""
    return next((k for k in KEYS[field] if cfg.get(k) is not None), None)


def value(cfg: dict, field: str, default=None):
    k = key(cfg, field)
    return cfg[k] if k is not None else default


def layer_count(cfg: dict) -> int | None:
    """The decoder layers: the layer key, else the length of the per-layer kinds list that stands
    for it (Nemotron-H's ``layers_block_type``)."""
    if key(cfg, "layers") is not None:
        return int(value(cfg, "layers"))
    kinds = next((cfg[k] for k in ("layer_types", "layers_block_type") if isinstance(cfg.get(k), list)), None)
    return len(kinds) if kinds else None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _short(v) -> str:
    """A config value for a note: long lists by their length and first entries."""
    if isinstance(v, list) and len(v) > 4:
        return f"[{', '.join(map(repr, v[:2]))}, ... ({len(v)} entries)]"
    if isinstance(v, dict) and len(v) > 3:
        return f"{{{', '.join(map(repr, list(v)[:2]))}, ... ({len(v)} entries)}}"
    return repr(v) if isinstance(v, str) else str(v)


class Shrink:
    """One config being shrunk (a deep copy: the user's config is never changed); ``set`` records
    each change as a note.  ``original`` is the config as given, for rules that scale by it."""

    def __init__(self, cfg: dict):
        self.original = cfg
        self.cfg = copy.deepcopy(cfg)
        self.notes: list[str] = []

    def set(self, k: str, v, why: str = "") -> None:
        old = self.cfg.get(k)
        if old == v:
            return
        self.cfg[k] = v
        self.notes.append(f"{k} {_short(old)} -> {_short(v)}" + (f" ({why})" if why else ""))

    def field(self, field: str, v, why: str = "") -> None:
        """Set ``field``'s key, and every other key of it that holds the same value (a config
        saved by transformers >= 5.25 writes Falcon's KV heads as both ``num_kv_heads`` and
        ``num_key_value_heads``); a key of it holding another value means something else."""
        k = key(self.cfg, field)
        if k is None:
            return
        old = self.cfg[k]
        for alias in KEYS[field]:
            if alias == k or self.cfg.get(alias) == old:
                self.set(alias, v, why)


def _causal_lm_types() -> set[str]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # no transformers: every text model is taken as a causal LM of its own
        return set()
    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def text_model(cfg: dict) -> tuple[dict, str | None, bool]:
    """``(config to shrink, where it sat, standalone)``: a multimodal config's language model.

    A config that names its layers is shrunk as it is (``where`` None).  One that keeps them in a
    sub-config (``text_config``; a text-to-audio model's ``decoder``) is a composite: its causal LM
    is that sub-config's model.  ``standalone``: transformers builds the sub-config's model type as a
    causal LM of its own (``gemma3_text``: Gemma3ForCausalLM, as the text half of Gemma 3); else
    the composite config is kept around the shrunk sub-config and built as the composite type
    (Mllama, Emu3: their AutoModelForCausalLM class takes the text config)."""
    if layer_count(cfg) is not None:
        return cfg, None, False
    for where in TEXT_KEYS:
        sub = cfg.get(where)
        if isinstance(sub, dict) and layer_count(sub) is not None:
            standalone = sub.get("model_type") in _causal_lm_types() - {cfg.get("model_type")}
            return sub, where, standalone
    return cfg, None, False


def _even_width(factor: float, head_dim: int) -> int:
    """The rotated width ``factor * head_dim``, even and at least 2 (rotary rotates pairs)."""
    return max(2, min(head_dim, 2 * round(factor * head_dim / 2)))


def fit_rotary(s: Shrink, old_head_dim: int, new_head_dim: int) -> None:
    """Rotary embeddings over part of each head stay over the same share of the shrunk head.

    ``rotary_dim`` (GPT-J, CodeGen) is a width: kept at ``old_head_dim`` it would exceed the shrunk
    head (the model fails, or rotates pairs that are not there).  ``partial_rotary_factor`` /
    ``rotary_pct`` are shares: kept unless the share of a 16-wide head is not a whole even width."""
    cfg = s.cfg
    rotary = cfg.get("rotary_dim")
    if isinstance(rotary, int) and not isinstance(rotary, bool) and old_head_dim and rotary > 0:
        s.set("rotary_dim", _even_width(rotary / old_head_dim, new_head_dim),
              f"the same share of the {new_head_dim}-wide head as {rotary} of {old_head_dim}")

    def fit(holder: dict, k: str, where: str) -> None:
        factor = holder.get(k)
        if isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor < 1:
            width = _even_width(factor, new_head_dim)
            if width != factor * new_head_dim:
                holder[k] = width / new_head_dim
                s.notes.append(f"{where}{k} {factor} -> {holder[k]} ({width} of the {new_head_dim}-wide head)")

    for k in ("partial_rotary_factor", "rotary_pct"):
        fit(cfg, k, "")
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):  # flat, or one dict per attention kind (Gemma 3: sliding / full)
        for kind, params in [("", rope)] + [(f"{k}.", v) for k, v in rope.items() if isinstance(v, dict)]:
            fit(params, "partial_rotary_factor", f"rope_parameters.{kind}")


def scale_overrides(s: Shrink) -> None:
    """Per-layer overrides (``per_layer_config``: Gemma 4's wider global heads, dots3's narrower
    layers) of a field the shrinker changed: a count of heads becomes the shrunk count (times the
    override's whole multiple of the original, so the plan still splits it); a width keeps its
    ratio to the shrunk width."""
    overrides = s.cfg.get("per_layer_config")
    if not isinstance(overrides, dict) or not overrides:
        return
    counts = set(KEYS["heads"]) | set(KEYS["kv_heads"]) | set(KEYS["experts"])
    scaled = {}
    for layer, inner in overrides.items():
        if not isinstance(inner, dict):
            scaled[layer] = inner
            continue
        fixed = dict(inner)
        for k, v in inner.items():
            old, new = s.original.get(k), s.cfg.get(k)
            if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (v, old, new)) or old == new:
                continue
            fixed[k] = new * max(1, round(v / old)) if k in counts else max(2, 2 * round(new * v / old / 2))
        scaled[layer] = fixed
    s.set("per_layer_config", scaled, "overrides scaled like the fields they override")


TOWER_HEADS = 2  # heads of a shrunk vision or audio tower (x HEAD_DIM wide)


def shrink_towers(s: Shrink) -> None:
    """The other towers of a multimodal causal LM (GIT's vision encoder, Phi-4-multimodal's vision
    and audio encoders): verify builds them but feeds them nothing (token ids only), so they
    become 2 layers of 2 heads x 16, with every width equal to the tower's hidden size cut alike."""
    for where, sub in list(s.cfg.items()):
        if not (where.endswith("_config") and isinstance(sub, dict) and sub.get("model_type")
                and key(sub, "hidden") is not None and key(sub, "heads") is not None):
            continue
        tower, old_hidden, hidden = Shrink(sub), value(sub, "hidden"), TOWER_HEADS * HEAD_DIM
        tower.field("layers", min(2, layer_count(sub) or 2))
        tower.field("heads", TOWER_HEADS)
        tower.field("kv_heads", TOWER_HEADS)
        tower.field("head_dim", HEAD_DIM)
        for k, v in sub.items():  # the hidden size under other names (an audio tower's channels)
            if v == old_hidden and not isinstance(v, bool):
                tower.set(k, hidden)
        if isinstance(value(sub, "ffn"), int):
            tower.field("ffn", min(value(sub, "ffn"), 2 * hidden))
        s.set(where, tower.cfg, f"a tower verify does not feed: {len(tower.notes)} fields cut")


def fill_unset(s: Shrink, head_dim: int | None) -> None:
    """Fields the config sets to None that the model's code reads (default configs of HunYuan,
    Nemotron, Ministral, DeepSeek-V2, X-MOD): the value None stands for, written out."""
    cfg = s.cfg
    if "head_dim" in cfg and cfg["head_dim"] is None and head_dim:
        s.set("head_dim", head_dim, "unset; hidden size / heads")
    heads = value(cfg, "heads")
    for k in KEYS["kv_heads"]:
        if k in cfg and cfg[k] is None and heads and key(cfg, "kv_heads") is None:
            s.set(k, heads, "unset; one KV head per query head")
            break
    if cfg.get("languages") and "default_language" in cfg and cfg["default_language"] is None:
        s.set("default_language", list(cfg["languages"])[0], "unset; X-MOD's first language adapter")
    if key(cfg, "experts") is None and value(cfg, "moe_ffn"):  # an MoE config without its expert counts (dots1)
        for k in KEYS["experts"]:
            if k in cfg:
                s.set(k, 4, "unset; a mixture of experts needs experts")
                break
        if "n_shared_experts" in cfg and cfg["n_shared_experts"] is None:
            s.set("n_shared_experts", 1, "unset; one shared expert")
    experts = value(cfg, "experts")
    if experts and key(cfg, "top_k") is None:
        for k in KEYS["top_k"]:
            if k in cfg:
                s.set(k, min(2, int(experts)), "unset; routed experts per token")
                break

