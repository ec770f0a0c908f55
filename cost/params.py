"""Parameter elements on the scored pipeline rank, by how they are replicated.

:func:`local_param_elems` splits the rank's parameters into the dense weights (replicated over
dp*cp), the routed experts (over tp*dp*cp/ep) and the tp-replicated weights whose gradients are
partial sums over tp.  Its neighbours: comm.py prices the gradient collectives of each class
(and re-exports this function), memory.py counts their bytes, time.py the optimizer's work;
flops.py holds the attention's weight counts it builds on (``attention_weights``, ``kv_weights``).
"""
from __future__ import annotations

import sympy

from .flops import KV_REPLICATED, attention_weights, kv_weights, latent_down_weights
from .symbols import (E, FIRST, LAST, SP, TIED, Vt, Pe, Ph, a, d, en, ep, f, fe, fq, g, gated, h, hb, ld, le, lq,
                      mla, nl, nn, nsh, pb, qb, qkh, qkn, rkv, rq, sgate, tp)

__all__ = ["local_param_elems"]


def _mlp(width):
    return (2 + gated) * h * width


def local_param_elems():
    """Parameter elements on the scored pp rank, by replication class.

    Returns ``(dense, expert, tp_replicated_partial)``: ``dense`` are replicated over
    dp*cp (TP-sharded weights count 1/tp, norms are whole), ``expert`` over tp*dp*cp/ep,
    and ``tp_replicated_partial`` the replicated weights whose gradients are partial sums
    over tp (norms under SP; routers and shared experts, which see a token slice; OLMo 2's
    whole-width q/k norm weights, which each rank reads its slice of; the k and v projections
    under KV-head replication, ``KV_REPLICATED``, flops.py; multi-head latent attention's
    down-projections and latent norms, which every rank computes whole for its heads).  Besides the decoder:
    ``n_ln`` norms per layer; with ``p_b`` the column biases (MLP up/gate) split over tp and the
    row biases (o_proj, down: h each) whole, added after the reduction; ``P_emb`` (position and
    token-type tables) and ``emb_norm`` a norm of the embeddings (BERT's) on the first pp rank and
    ``P_head`` (a head transform) on the last, whole;
    the LM head's bias ``head_bias * ceil(V/tp)`` (``Vt``: a vocabulary tp does not divide is padded).  Under SP the row biases, the tables and the head
    transform see a sequence shard, so their gradients are partial too.
    """
    # replicated: the norm weights are not split with q and k (whole width, or per head: 2 d)
    qk_norms = qkn * (a + g) * d + qkh * 2 * d
    qkv, o = attention_weights()
    latent_norms = mla * (lq * rq + rkv)  # MLA's norms of its q and kv latents: whole
    attn = (qkv + qb * (a + 2 * g) * d + o) / tp + qk_norms + latent_norms + pb * h
    # KV-head replication: the k and v projections (and biases) whole on every tp rank, their
    # gradients partial over tp (each rank's query heads' share); so are MLA's down-projections
    kv_whole = KV_REPLICATED * kv_weights(qb) + latent_down_weights()
    attn += kv_whole * (1 - 1 / tp)
    # in a fused QKV (f_q) the KV rows' gradients are summed in backward instead (sum_whole_rows)
    kv_partial = kv_whole - fq * KV_REPLICATED * kv_weights(qb)
    norms = nl * h * nn
    mlp = _mlp(f) / tp + pb * ((1 + gated) * f / tp + h)
    router_shared = h * E + nsh * _mlp(fe) + sgate * h
    dense = (ld * (attn + mlp + norms) + le * (attn + norms + router_shared)
             + FIRST * (Vt * h + Pe + en * h * nn) + LAST * (Vt * h * (1 - TIED * FIRST) + h * nn + hb * Vt + Ph))
    expert = le * sympy.ceiling(E / ep) * _mlp(fe)  # ceil(E/ep): an ep that does not divide E pads
    partial = (SP * ((nl * (ld + le) + LAST + en * FIRST) * h * nn + pb * (2 * ld + le) * h + FIRST * Pe + LAST * Ph)
               + le * router_shared + (ld + le) * (qk_norms + kv_partial + latent_norms))
    return dense, expert, partial
