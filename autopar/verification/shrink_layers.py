"""The shrinker's layer cut and its state-space widths.

:mod:`autopar.verification.shrink` (:func:`~autopar.verification.shrink.shrink_config`) calls
:func:`cut_layers` to keep a few of a model's decoder layers, and :func:`shrink_state_space` for
the widths of Mamba-style and recurrent mixers; the config keys and the :class:`Shrink` record
they write through are :mod:`autopar.verification.shrink_fields`.

A layer cut is a choice of which original layers survive (:func:`kept_layers`), applied alike to
everything a config says per layer: lists with one entry per layer (``layer_types``,
``mlp_layer_types``, ``no_rope_layers``, per-layer limits or head counts), lists of layer indices
(``mlp_only_layers``, ``index_layers``), per-layer lists whose entries are layer indices (the
layer whose keys and values a layer reads: ``kv_source_layers``) and per-layer dicts
(``per_layer_config``).  The survivors are chosen so that every kind of layer the model has is
kept where the count allows (a model whose sliding-window layers come last keeps one; a DeepSeek
keeps a dense and a mixture-of-experts layer), in their original order.  No torch here.
"""
from __future__ import annotations

import math

from autopar.plan import Plan
from autopar.verification.shrink_fields import HEAD_DIM, KEYS, Shrink, round_up, value

__all__ = ["kept_layers", "cut_layers", "RECURRENT_HIDDEN", "shrink_state_space"]

RECURRENT_HIDDEN = 64  # hidden size of a shrunk model without attention heads (4 x HEAD_DIM)
MAX_STATE = 16         # state size per channel of a shrunk state-space mixer
# Model type -> the layer kind whose layers share one block (Zamba's hybrid layers: one shared
# attention block, its weights tied across them), kept twice (:func:`_tied_twice`).
TIED_KINDS = {"zamba": "hybrid"}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _per_layer(cfg: dict, original: int) -> tuple[dict, dict, dict, dict]:
    """The config's per-layer entries: (lists of one entry per layer, of those the ones whose entries
    are layer indices, lists of layer indices, dicts keyed by layer index)."""
    lists, sources, indices, dicts = {}, {}, {}, {}
    for k, v in cfg.items():
        if isinstance(v, list) and len(v) == original and original > 1 and all(
                not isinstance(x, (dict, list)) for x in v):
            # An entry per layer that is an earlier layer's index (and not a 0/1 flag): a source layer.
            if all(_is_int(x) and 0 <= x <= i for i, x in enumerate(v)) and max(v) > 1:
                sources[k] = v
            else:
                lists[k] = v
        elif ("layer" in k and isinstance(v, list) and v and len(v) < original and all(_is_int(x) for x in v)
              and all(0 <= x < original for x in v) and v == sorted(set(v))):
            indices[k] = v
        elif "layer" in k and isinstance(v, dict) and v and all(str(x).isdigit() and int(x) < original for x in v):
            dicts[k] = v
    return lists, sources, indices, dicts


def kept_layers(kinds: list[set], layers: int, sources: dict[int, int] | None = None) -> list[int]:
    """Which of ``len(kinds)`` layers to keep, ``layers`` of them, in order: greedily the layer that
    adds most kinds not yet kept (the earliest among equals), then the earliest others.  A layer
    that reads another's keys and values (``sources``) comes with that layer, which costs it a
    kind.  More layers than the model has repeat its layers in order."""
    original, sources = len(kinds), sources or {}
    if layers >= original:
        return [i % original for i in range(layers)]
    keep: list[int] = []
    covered: set = set()

    def group(i: int) -> set[int]:
        return {i, sources.get(i, i)} - set(keep)

    def gain(i: int) -> int:
        g = group(i)
        if len(keep) + len(g) > layers:
            return -1
        return len(set().union(*(kinds[j] for j in g)) - covered) - (len(g) - 1)

    while len(keep) < layers:
        best = max((i for i in range(original) if i not in keep), key=lambda i: (gain(i), -i))
        if gain(best) <= 0:
            break
        for j in group(best):
            covered |= kinds[j]
        keep += sorted(group(best))
    keep += [i for i in range(original) if i not in keep][:layers - len(keep)]
    return sorted(keep)


def cut_layers(s: Shrink, original: int, layers: int, why: str) -> None:
    """Keep ``layers`` of the ``original`` decoder layers, and every per-layer entry with them."""
    s.field("layers", layers, why)
    if layers == original:
        return
    lists, sources, indices, dicts = _per_layer(s.cfg, original)
    kinds = [{(k, repr(v[i])) for k, v in lists.items()}
             | {(k, v[i] == i) for k, v in sources.items()}       # reads its own keys and values, or another's
             | {(k, i in v) for k, v in indices.items()}
             | {(k, str(i) in map(str, v)) for k, v in dicts.items()} for i in range(original)]
    varied = kept_layers(kinds, layers, {i: src for v in sources.values() for i, src in enumerate(v) if src != i})
    tied = TIED_KINDS.get(s.cfg.get("model_type"))
    keep = _tied_twice(varied, lists.get("layers_block_type"), tied)
    if lists or sources or indices or dicts:
        why = f"every kind of layer, where {layers} allow" if keep == varied else f"two {tied} layers: they share a block"
        s.notes.append(f"layers 0-{original - 1} -> {', '.join(map(str, keep))} kept ({why})")
    for k, v in lists.items():
        s.set(k, [v[i] for i in keep], "one entry per kept layer")
    for k, v in sources.items():  # a source layer not kept: the layer reads its own keys and values
        s.set(k, [max((p for p in range(j + 1) if keep[p] == v[i]), default=j) for j, i in enumerate(keep)],
              "the kept layers' sources, renumbered")
    for k, v in indices.items():
        s.set(k, [j for j, i in enumerate(keep) if i in set(v)], "the kept layers among them, renumbered")
    for k, v in dicts.items():
        by_layer = {int(x): x for x in v}
        s.set(k, {(str(j) if isinstance(by_layer[i], str) else j): v[by_layer[i]]
                  for j, i in enumerate(keep) if i in by_layer}, "the kept layers', renumbered")
    _cut_patterns(s, layers)


def _tied_twice(keep: list[int], kinds: list | None, tied: str | None) -> list[int]:
    """Two layers of a kind whose layers share one block's weights, where one was kept: transformers
    ties the block from the first such layer to the others, and fails on a model with one."""
    if not kinds or tied is None or [kinds[i] for i in keep].count(tied) != 1 or len(keep) < 2:
        return keep
    other = next((i for i in range(len(kinds)) if kinds[i] == tied and i not in keep), None)
    if other is None:
        return keep
    drop = max(i for i in keep if kinds[i] != tied)
    return sorted([i for i in keep if i != drop] + [other])


def _cut_patterns(s: Shrink, layers: int) -> None:
    """Per-layer settings a config writes as counts rather than lists."""
    cfg = s.cfg
    if isinstance(cfg.get("first_k_dense_replace"), int) and cfg["first_k_dense_replace"] >= layers:
        s.set("first_k_dense_replace", layers // 2, "keep a mixture-of-experts layer")
    for k in ("decoder_sparse_step", "moe_layer_freq"):
        if isinstance(cfg.get(k), int) and cfg[k] > layers:
            s.set(k, layers, "keep a mixture-of-experts layer")
    if isinstance(cfg.get("max_window_layers"), int) and cfg["max_window_layers"] >= layers:
        # Qwen2-style: layers from max_window_layers on slide; keep both kinds where it had both.
        s.set("max_window_layers", layers // 2 if cfg.get("use_sliding_window") else layers,
              "sliding and full layers both" if cfg.get("use_sliding_window") else "")
    shared = cfg.get("num_kv_shared_layers")  # the last N layers reuse the K/V of earlier ones of their kind
    kinds = cfg.get("layer_types")
    if isinstance(shared, int) and shared > 0 and isinstance(kinds, list):
        # Every kind must keep a layer that computes its own K/V (Gemma 3n checks it).
        fits = [n for n in range(min(shared, layers - 1), -1, -1) if set(kinds[:layers - n]) == set(kinds)]
        s.set("num_kv_shared_layers", fits[0] if fits else 0, "every kind of layer keeps one computing its K/V")
    types = cfg.get("attention_types")  # GPT-Neo: [[kinds, repeats], ...], expanded to attention_layers
    if isinstance(types, list) and isinstance(cfg.get("attention_layers"), list):
        s.set("attention_types", [[[kind], 1] for kind in cfg["attention_layers"]], "the kept layers' kinds")


def _ssm_keys(pure: bool) -> tuple[tuple, tuple]:
    """The keys of a state-space mixer's heads and head width; a model that is only state space
    (Mamba-2) names them ``num_heads`` / ``head_dim``."""
    heads, dims = KEYS["ssm_heads"], KEYS["ssm_head_dim"]
    return (heads + ("num_heads",), dims + ("head_dim",)) if pure else (heads, dims)


def shrink_state_space(s: Shrink, plan: Plan, pure: bool) -> None:
    """A state-space or recurrent model's widths, from the (shrunk) hidden size.

    ``pure``: the model has no attention heads (Mamba, Mamba-2, Falcon-Mamba, RWKV): its hidden
    size becomes :data:`RECURRENT_HIDDEN` (a multiple of tp).  Then, for any model: the state per
    channel at most :data:`MAX_STATE`; the mixer's heads and head width so that heads x head width =
    expand x hidden (what Mamba-2, Bamba and the like check), head width at most 16; the groups of
    its B/C projections dividing its heads; the time-step rank transformers' "auto" gives
    (ceil(hidden / 16)); a recurrent attention width (RWKV, Zamba) at the same multiple of hidden."""
    cfg, orig = s.cfg, s.original
    if pure:
        s.field("hidden", round_up(RECURRENT_HIDDEN, plan.tp), "no attention heads: 4 x 16 wide")
    hidden, old_hidden = int(value(cfg, "hidden")), int(value(orig, "hidden"))
    if value(cfg, "state"):
        s.field("state", min(int(value(cfg, "state")), MAX_STATE))
    _ssm_heads(s, hidden, old_hidden, pure)
    if _is_int(value(cfg, "dt_rank")):
        s.field("dt_rank", math.ceil(hidden / 16), "ceil(hidden / 16), transformers' 'auto'")
    width = cfg.get("attention_hidden_size")
    if _is_int(width) and width % old_hidden == 0:
        s.set("attention_hidden_size", width // old_hidden * hidden, "the same multiple of the hidden size")
        heads, head_width = value(cfg, "heads"), cfg.get("attention_head_dim")
        if heads and _is_int(head_width):
            s.set("attention_head_dim", cfg["attention_hidden_size"] // int(heads), "attention width / heads")


def _ssm_heads(s: Shrink, hidden: int, old_hidden: int, pure: bool) -> None:
    cfg = s.cfg
    head_keys, dim_keys = _ssm_keys(pure)
    heads_key = next((k for k in head_keys if _is_int(cfg.get(k))), None)
    expand = value(cfg, "expand", 2)
    if heads_key is None or not isinstance(expand, (int, float)):
        return
    inner, old_inner = int(expand * hidden), int(expand * old_hidden)
    if _is_int(cfg.get("mamba_d_ssm")):  # Falcon-H1 gives the mixer's width itself: the same share of hidden
        old_inner = cfg["mamba_d_ssm"]
        inner = max(HEAD_DIM, round_up(old_inner * hidden // old_hidden, HEAD_DIM))
        s.set("mamba_d_ssm", inner, "the same share of the hidden size")
    old_heads = cfg[heads_key]
    dim_key = next((k for k in dim_keys if _is_int(cfg.get(k))), None)
    old_dim = cfg[dim_key] if dim_key else old_inner // old_heads
    new_dim = min(old_dim, HEAD_DIM)
    while inner % new_dim:
        new_dim -= 1
    new_heads = inner // new_dim if dim_key else max(d for d in range(1, min(old_heads, inner // new_dim) + 1)
                                                       if inner % d == 0)
    s.set(heads_key, new_heads, f"x head width {inner // new_heads} = the mixer's width {inner}")
    if dim_key:
        s.set(dim_key, inner // new_heads)
    groups_key = next((k for k in KEYS["ssm_groups"] if _is_int(cfg.get(k))), None)
    if groups_key and cfg[groups_key] > 1:  # two groups (where it had several), dividing the heads
        s.set(groups_key, max(d for d in range(1, min(cfg[groups_key], 2) + 1) if new_heads % d == 0))
