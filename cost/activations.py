"""Activation bytes: what a rank saves for backward, per layer and micro-batch, and outside the layers.

Activations per layer and micro-batch, bytes, with T = b*S/cp tokens on the rank and
T_sp = T/tp under SP (T otherwise) -- our derivation of what autopar's eager programs save
for backward (pre-norm RMSNorm computed in fp32 as Llama's, SwiGLU, flash attention, GQA by
expand + reshape, no dropout; checked tensor by tensor against ``ParallelModule.memory_report``):
  norms      2*(T_sp*h*(4 + w) + 4*T_sp)   (per norm: the fp32 input that pow and the
                                         normalising mul save -- the input itself when
                                         w = 4 --, the normalised input cast to w that the
                                         weight's mul saves, and the fp32 rstd)
  GEMM input 2*T_sp*h*w                (q/k/v and gate/up inputs: under SP the sequence shard,
                                        which backward all-gathers again, autopar/ops/regather.py)
  attention  T*(a + 2*g_s)*d*w/tp      (q, k, v as flash attention sees them; g_s = a when the
                                        model's expand + reshape copies K and V to all heads,
                                        i.e. when the rank holds g/tp >= 2 KV heads and cp = 1
                                        -- with one local KV head the reshape is a view, and
                                        the CP attention functions take K, V unexpanded --,
                                        and under KV-head replication, when tp does not
                                        divide g: this rank's slice of the copies --,
                                        else g)
           + T*a*d*w/tp + 4*T*a/tp     (its output, kept for o_proj and its backward; fp32 LSE)
  MLP        (2 + 2*gated)*T*F*w/tp    (gate, up, silu(gate), product -- or up, gelu(up))
  MoE block  T/tp tokens: fp32 router logits and probs 8*E, dispatched inputs and expert
             outputs 2*k*rho*h*w, expert MLP intermediates (2 + 2*gated)*(k*rho + n_sh)*F_e*w
  unfused attention (flash_attention=False): + b*a*S^2/(tp*cp)*(2w + 1) (softmax
             output, dropout mask, dropped probabilities; recomputed by selective)
  CP allgather: the gathered K,V are kept, + (cp - 1)*T*2g*d*w/tp
  MLA latents (multi-head latent attention, mla = 1): each latent's norm and its up-projection's
             input, whole on every tp rank and on all T tokens,
             + l_q*(T*r_q*(4 + 2w) + 4T) + T*r_kv*(4 + 2w) + 4T          (_latent_bytes)
Selective recompute recomputes attention (drops its output and LSE) and the MLP
activation function (drops silu(gate) and the product, or gelu(up)), plus, while backward
recomputes one of them, the larger of the two (``recompute_buffer``). Full recompute keeps
only each layer's input T_sp*h*w, plus one layer's activations while it recomputes
(passes/recompute.py cuts these regions; ParallelModule.memory_report measures both parts).
Outside the layers, for one micro-batch: the first pp rank keeps the int64 token ids its
embedding saves (8*T); the last pp rank the final norm (as above), the LM head's input
(T_sp*h*w: the shard under SP, re-gathered in backward) and the loss buffers: fp32 log-softmax of the logits (a loss
on upcast logits; under TP the fp32 ``exp`` of the vocabulary-parallel cross-entropy)
T*V/tp*4 and the int64 target 8*T (not modelled: the vocabulary-parallel loss's 6*T bytes of per-token sums and masks,
a materialised attention mask).
``korthikanti_layer_bytes`` is the GPT-layer formula of Korthikanti et al. (set C):
sbh(10 + 24/t + 5as/(ht)), (sbh/t)(34 + 5as/h) with SP, the 5as/h term dropped by
selective recompute, 2sbh with full recompute (written for 2-byte activations); with it
the last pp rank adds the logits ``T*V/tp*(w + 4)`` (bf16 logits + fp32 softmax).
The stage multiplies its layers' bytes by the micro-batches in flight (pipeline.py).

Neighbours: :mod:`autopar.cost.memory` (every memory term and the step's moments, which use these).
"""
from __future__ import annotations

import sympy

from .flops import KV_REPLICATED
from .symbols import (CPAG, E, FLASH, RFULL, RSEL, SP, Vt, a, b, cp, d, dv, f, fe, g, gated, h, k, ld, le, lq,
                      mla, nsh, rho, rkv, rq, s, tp, w)

__all__ = ["derived_layer_bytes", "derived_outside_bytes", "korthikanti_layer_bytes", "activation_parts", "at_least_two"]


def at_least_two(x):
    """1 when the positive integer ``x`` is >= 2, else 0 (a rational-free indicator for numpy)."""
    return sympy.Max(0, sympy.Min(1, x - 1, evaluate=False), evaluate=False)


def _norm_bytes(tokens, width=h):
    """An eager fp32-computing RMSNorm of ``width`` features: fp32 input, normalised input in w, fp32 rstd."""
    return tokens * width * (4 + w) + 4 * tokens


def _latent_bytes(tokens):
    """Multi-head latent attention's latents (0 without MLA): each latent's RMSNorm and the normalised
    latent its up-projection saves, whole on every tp rank (passes/tensor_parallel.py
    ``_latent_projections``) and on all ``tokens`` (its down-projection follows SP's all-gather).
    At w = 4 the kv norm's input is a view that shares its storage with the rope key (T*d_r*4 more
    in the meter's count), left out."""
    latent = lambda r: _norm_bytes(tokens, r) + tokens * r * w  # noqa: E731
    return mla * (lq * latent(rq) + latent(rkv))


def derived_layer_bytes():
    """(dense layer, MoE layer, recompute working set) activation bytes per micro-batch."""
    T = b * s / cp
    t_sp = T * (1 - SP + SP / tp)
    norms = 2 * _norm_bytes(t_sp)
    # Inputs of the q/k/v and gate/up groups: under SP the sequence shard, all-gathered again in
    # backward (autopar/ops/regather.py). A MoE block reads the rank's token slice.
    linear_in_dense = 2 * t_sp * h * w
    linear_in_moe = t_sp * h * w + (T / tp) * h * w
    # GQA's expand + reshape copies K and V to all local heads unless the rank holds one KV
    # head (then the reshape is a view); CP attention takes K, V at their own head count.
    kv_heads = g + (a - g) * at_least_two(g / tp) * (1 - at_least_two(cp))
    # KV-head replication (cp = 1): attention reads this rank's slice of the broadcast copies, a/tp heads
    kv_heads += KV_REPLICATED * (a - kv_heads)
    attn = T * (a * d + kv_heads * (d + dv)) * w / tp  # q, k, v (MLA's v is narrower)
    attn += _latent_bytes(T)
    attn_out = T * a * dv * w / tp + 4 * T * a / tp
    # Unfused attention keeps softmax output, dropout mask and dropped probabilities.
    attn_out += (1 - FLASH) * b * a * s**2 / (tp * cp) * (2 * w + 1)
    cp_kv = CPAG * (cp - 1) * T * g * (d + dv) * w / tp
    mlp_keep = (1 + gated) * T * f * w / tp          # gate and up (or up)
    mlp_act = (1 + gated) * T * f * w / tp           # silu(gate) and product (or gelu(up))
    Te = T / tp
    moe_keep = Te * (8 * E + 2 * k * rho * h * w) + (1 + gated) * Te * (k * rho + nsh) * fe * w
    moe_act = (1 + gated) * Te * (k * rho + nsh) * fe * w
    full_dense = norms + linear_in_dense + attn + attn_out + cp_kv + mlp_keep + mlp_act
    full_moe = norms + linear_in_moe + attn + attn_out + cp_kv + moe_keep + moe_act
    keep = 1 - RFULL
    layer_input = t_sp * h * w
    # Selective recompute keeps q, k, v but not what the attention op saves (its output, LSE and
    # under CP all-gather the gathered K,V).
    dense = RFULL * layer_input + keep * (full_dense - RSEL * (attn_out + cp_kv + mlp_act))
    moe = RFULL * layer_input + keep * (full_moe - RSEL * (attn_out + cp_kv + moe_act))
    # What one recomputation holds in backward: a whole layer (full); under selective the larger
    # of the two regions a layer recomputes, one at a time (attention output + LSE, MLP activations).
    larger = lambda x, y: sympy.Max(x, y, evaluate=False)  # noqa: E731
    working = (RFULL * (ld * full_dense + le * full_moe)
               + RSEL * (ld * larger(attn_out + cp_kv, mlp_act) + le * larger(attn_out + cp_kv, moe_act))) / (ld + le)
    return dense, moe, working


def derived_outside_bytes():
    """(first pp rank, last pp rank) activation bytes outside the layers, one micro-batch."""
    T = b * s / cp
    t_sp = T * (1 - SP + SP / tp)
    token_ids = 8 * T                                  # int64 ids saved by the embedding
    # Final norm, LM-head input (its sequence shard under SP), fp32 log-softmax (or the
    # vocabulary-parallel loss's exp) and the int64 target.
    head = _norm_bytes(t_sp) + t_sp * h * w + T * Vt * 4 + 8 * T
    return token_ids, head


def korthikanti_layer_bytes():
    """Korthikanti et al.'s GPT-layer activation bytes (set C), scaled from 2-byte to w-byte."""
    sbh = (s / cp) * b * h
    keep = sbh * ((1 - SP) * (10 + 24 / tp) + SP * 34 / tp + (1 - RSEL) * 5 * a * (s / cp) / (h * tp))
    layer = RFULL * 2 * sbh * (1 - SP + SP / tp) + (1 - RFULL) * keep
    return layer * w / 2


def activation_parts(activation_formula: str):
    """(per dense layer, per MoE layer, recompute working set, embedding stage, head stage) bytes."""
    if activation_formula == "korthikanti":
        per_layer = korthikanti_layer_bytes()
        working = RFULL * per_layer.subs({RFULL: 0, RSEL: 0})
        return per_layer, per_layer, working, sympy.Integer(0), b * s / cp * Vt * (w + 4)  # logits: bf16 + fp32 softmax
    if activation_formula == "derived":
        per_dense, per_moe, working = derived_layer_bytes()
        return (per_dense, per_moe, working, *derived_outside_bytes())
    raise ValueError(f"autopar: unknown activation_formula {activation_formula!r}; "
                     f"expected 'derived' or 'korthikanti'")
