"""Gradient buckets: how many bucketed collectives a pipeline rank issues per step.

The data-parallel pass (``passes/data_parallel.py``) packs the gradients of the weight copies
into buckets of at most ``bucket_bytes`` local bytes, one collective per bucket (plain DP's
all-reduce; ZeRO-1/2's reduce-scatter and after-step all-gather, a bucket being a ZeRO unit).
The packing rule has one home, :func:`autopar.plan_space.pack_buckets`; this module runs it
on the tensors a :class:`~autopar.cost.spec.ModelSpec` describes and gives comm.py, per pipeline
rank, the four counts its DP / ZeRO rows use (symbols.py): ``n_bd`` and ``n_be``, the buckets of
dense and of routed-expert gradients with a tensor on the rank, and ``n_ud`` and ``n_ue``, the
same buckets cut at pipeline-chunk borders (ZeRO-2's units under pp); and for memory.py the
elements of its largest dense bucket ``u_max`` (ZeRO-1/2's units in flight at the start of
backward are the largest ones: a matrix bigger than the cap is a bucket of its own).  A greedy packing has no
closed form, so these are numbers, like the stage views of pipeline.py, not formulas.

Tensors (:func:`param_tensors`), in the parameter order of a transformers Llama or Mixtral
(the layouts the counts are exact for; the order of other architectures may differ, which
moves bucket borders only for models whose gradients fill more than one bucket):
  * the first chunk: the token table ``[ceil(V/tp), H]`` (padded vocabulary), the extra embedding tables (``P_emb``),
    the embedding norm;
  * each layer: q, k, v (weight, then bias under ``q_b``; one weight and one bias for a fused QKV; MLA: q_a, its norm, q_b (or q),
    kv_a, its norm, kv_b), o (its bias under ``p_b``), the q/k norms; a dense MLP's gate, up
    and down (biases under ``p_b``), or a MoE block's router ``[E, H]``, its routed experts
    ``[n, (1 + gated) F_e, H]`` and ``[n, H, F_e]`` (``n = ceil(E/ep)``), its shared experts' gate, up and down
    ``[n_sh F_e, H]`` and their gate ``[1, H]``; then the layer's norms (``n_ln * n_norm``
    vectors of ``H``);
  * the last chunk: the head transform (``P_head``), the final norm, the LM head ``[ceil(V/tp), H]``
    (the token table itself when tied) and its bias ``[ceil(V/tp)]``.
A tensor's local bytes are ``x = w_p * elements / split`` (split: tp for the projections that
tp splits -- k and v only where tp divides the KV heads, ``autopar.plan_space.kv_replicated`` --,
the token table and the head; ep for the routed experts; else 1).

Counting, with ``C = bucket_bytes``: the dense tensors (routed experts are packed apart, over
their own ranks) in backward's order ``x_J, ..., x_1`` are cut into runs ``B_1 .. B_n``, a run
closing before tensor ``j`` when ``|B_k| + x_j > C``.  Under pp the runs are cut over the whole
model and a rank keeps each run's tensors that it holds (``H_r``: its chunks' tensors, the tied
table on the first and the last chunk's ranks), so

    n_b(r) = #{k : B_k ∩ H_r ≠ ∅}
    n_u(r) = Σ_k #{owner chunk of j : j ∈ B_k ∩ H_r}      (owner: the first chunk using j)

and without pp ``n_b = n_u = n``.  The same for the routed experts gives ``n_be``, ``n_ue``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autopar.plan_space import DEFAULT_BUCKET_BYTES, chunk_rank, chunks_per_rank, kv_replicated, local_experts, pack_buckets

from .pipeline import place_layers

__all__ = ["BucketCounts", "BUCKET_FIELDS", "param_tensors", "bucket_counts", "DEFAULT_BUCKET_BYTES"]

EMBEDDING, HEAD = "embedding", "head"


@dataclass(frozen=True)
class BucketCounts:
    """The bucket counts of one pipeline rank (the symbols ``n_bd``, ``n_ud``, ``n_be``, ``n_ue``)."""

    dense: int           # buckets of dense gradients with a tensor on the rank
    dense_units: int     # the same, cut at chunk borders (ZeRO-2 under pp)
    expert: int          # buckets of routed-expert gradients with a tensor on the rank
    expert_units: int
    dense_largest: float = 0.0  # elements of the rank's largest dense bucket (its tensors on the rank)


BUCKET_FIELDS = {"nbd": "dense", "nud": "dense_units", "nbe": "expert", "nue": "expert_units",
                 "umx": "dense_largest"}
"""Plan-array column (``model.plan_values``) -> :class:`BucketCounts` attribute."""


def _attention(spec, tp: int) -> list[int]:
    """The attention's tensors, local elements, in order."""
    H, a, g, d = spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.kv_lora_rank:  # MLA: the down-projections and latent norms whole, the rest split by heads
        rq, rkv, dr = spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim
        q = [H * rq, rq, rq * a * d // tp] if rq else [H * a * d // tp]
        return q + [H * (rkv + dr), rkv, rkv * a * (d - dr + spec.v_dim) // tp, a * spec.v_dim * H // tp]
    kv = 1 if kv_replicated(tp, g) else tp  # KV heads tp does not divide: whole (KV-head replication)
    weights = [heads * d * H // split for heads, split in ((a, tp), (g, kv), (g, kv))]
    biases = [heads * d // split for heads, split in ((a, tp), (g, kv), (g, kv))] if spec.qkv_bias else []
    if spec.fused_qkv:  # one weight (and one bias) holding the rank's q, k and v rows
        out = [sum(weights)] + ([sum(biases)] if biases else [])
    else:
        out = [x for i, w in enumerate(weights) for x in [w] + biases[i:i + 1]]
    out.append(H * a * spec.v_dim // tp)
    if spec.proj_bias:
        out.append(H)  # o_proj's bias, added after the reduction: whole
    if spec.qk_norm:
        out += [a * d, g * d]
    if spec.qk_head_norm:
        out += [d, d]
    return out


def _mlp(spec, width: int, tp: int, bias: bool) -> list[int]:
    """A (gated) MLP's gate, up and down projections, local elements, in order."""
    H = spec.hidden
    out = []
    for _ in range(2 if spec.gated_mlp else 1):  # gate, up: column-parallel
        out += [width * H // tp] + ([width // tp] if bias else [])
    return out + [H * width // tp] + ([H] if bias else [])  # down: row-parallel, its bias whole


def _layer(spec, index: int, tp: int, ep: int) -> list[tuple[int, bool]]:
    """(local elements, routed expert) of layer ``index``'s tensors, in order."""
    out = [(x, False) for x in _attention(spec, tp)]
    if spec.is_moe_layer(index):
        H, E, fe = spec.hidden, spec.num_experts, spec.moe_ffn
        out.append((E * H, False))  # the router
        n = local_experts(E, ep)
        out += [(n * (1 + int(spec.gated_mlp)) * fe * H, True), (n * H * fe, True)]
        if spec.num_shared_experts:
            out += [(x, False) for x in _mlp(spec, spec.num_shared_experts * fe, 1, False)]
        if spec.shared_expert_gate:
            out.append((H, False))
    else:
        out += [(x, False) for x in _mlp(spec, spec.ffn, tp, spec.proj_bias)]
    return out + [(spec.hidden, False)] * (spec.layer_norms * spec.norm_vectors)


def param_tensors(spec, tp: int = 1, ep: int = 1) -> list[tuple[int, object, bool]]:
    """``(local elements, where, routed expert)`` of every parameter tensor, in model order;
    ``where`` is a layer index, ``"embedding"`` (the first chunk's) or ``"head"`` (the last
    chunk's); the token table is the first tensor, shared with the head when tied."""
    H, V, norm = spec.hidden, spec.vocab, spec.norm_vectors
    out: list[tuple[int, object, bool]] = [(-(-V // tp) * H, EMBEDDING, False)]
    out += [(x, EMBEDDING, False) for x in ([spec.embedding_extra_params] if spec.embedding_extra_params else [])]
    out += [(H, EMBEDDING, False)] * (norm * int(spec.embedding_norm))
    for i in range(spec.num_layers):
        out += [(x, i, e) for x, e in _layer(spec, i, tp, ep)]
    out += [(x, HEAD, False) for x in ([spec.head_extra_params] if spec.head_extra_params else [])]
    out += [(H, HEAD, False)] * norm
    out += [(-(-V // tp) * H, HEAD, False)] * int(not spec.tied_embeddings)
    return out + [(-(-V // tp), HEAD, False)] * int(spec.lm_head_bias)


def _owners(spec, pp: int, schedule: str, vpp: int, head_layers: float):
    """(chunk of each layer, number of chunks, rank of chunk ``c``) of the pipeline placement."""
    nchunks = pp * chunks_per_rank(schedule, vpp) if pp > 1 else 1
    layer_chunk: list[int] = []
    for c, n in enumerate(place_layers(spec.num_layers, nchunks, round(float(head_layers), 3))):
        layer_chunk += [c] * n
    return layer_chunk, nchunks, (lambda c: chunk_rank(c, pp, schedule) if pp > 1 else 0)


@lru_cache(maxsize=64)
def _packed(spec, tp: int, ep: int, param_bytes: int, bucket_bytes: int):
    """The packing, which no pipeline layout changes: per kind (dense, routed expert), the indices
    in :func:`param_tensors` of its tensors in backward's order, their local bytes and the run each
    falls in; and every tensor's placement code (its layer index; -1: the first chunk's, -2: the
    last chunk's)."""
    tensors = param_tensors(spec, tp, ep)
    kinds = {}
    for expert in (False, True):
        order = [j for j in reversed(range(len(tensors))) if tensors[j][2] == expert]
        sizes = [tensors[j][0] * param_bytes for j in order]
        run = np.zeros(len(order), dtype=np.int64)
        for k, cut in enumerate(pack_buckets(sizes, bucket_bytes)):
            run[cut.start:cut.stop] = k
        kinds[expert] = (np.array(order, dtype=np.int64), np.array(sizes, dtype=np.float64), run)
    where = np.array([-1 if w == EMBEDDING else -2 if w == HEAD else w for _, w, _ in tensors], dtype=np.int64)
    return kinds, where


@lru_cache(maxsize=1024)
def bucket_counts(spec, *, tp: int, ep: int, pp: int, schedule: str, vpp: int, head_layers: float,
                  param_bytes: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[BucketCounts, ...]:
    """The :class:`BucketCounts` of every pipeline rank (see the module docstring).  The runs are
    packed once per (tp, ep) (:func:`_packed`); a layout only places each tensor on its chunk's
    rank, and the counts are distinct (run, rank) and (run, rank, chunk) pairs, counted with numpy
    (the search asks this for every pp, schedule, vpp, tp and ep of a cluster: thousands of layouts)."""
    layer_chunk, nchunks, rank_of = _owners(spec, pp, schedule, vpp, head_layers)
    kinds, where = _packed(spec, tp, ep, param_bytes, bucket_bytes)
    layer_chunk = np.array(layer_chunk + [0], dtype=np.int64)  # (+1: a safe index for -1 and -2)
    chunk = np.where(where == -1, 0, np.where(where == -2, nchunks - 1, layer_chunk[np.maximum(where, 0)]))
    ranks = np.array([rank_of(c) for c in range(nchunks)], dtype=np.int64)[chunk]
    tied_rank = rank_of(nchunks - 1) if spec.tied_embeddings else None  # the tied table is the head's too
    counts, largest = {}, np.zeros(pp)
    for expert, (order, sizes, run) in kinds.items():
        r, c, nbytes, k = ranks[order], chunk[order], sizes, run
        if tied_rank is not None and not expert and (order == 0).any():
            first = int(np.nonzero(order == 0)[0][0])
            if tied_rank != r[first]:
                r, c = np.append(r, tied_rank), np.append(c, c[first])
                nbytes, k = np.append(nbytes, nbytes[first]), np.append(k, k[first])
        held = np.unique(k * pp + r)
        buckets = np.bincount(held % pp, minlength=pp)
        units = np.bincount((np.unique((k * pp + r) * nchunks + c) // nchunks) % pp, minlength=pp)
        if not expert and len(k):
            sums = np.bincount(k * pp + r, weights=nbytes)[held] / param_bytes
            np.maximum.at(largest, held % pp, sums)
        counts[expert] = (buckets, units if pp > 1 else buckets)
    (bd, ud), (be, ue) = counts[False], counts[True]
    return tuple(BucketCounts(int(bd[x]), int(ud[x]), int(be[x]), int(ue[x]), float(largest[x])) for x in range(pp))
