"""FLOPs: per micro-batch on one rank, by GEMM class, and for the whole model per step.

Each GEMM class carries its forward FLOPs, a backward multiplier and its effective size
``n = 3 / (1/M + 1/K + 1/N)`` (harmonic mean of the GEMM's dimensions), which time.py
turns into a compute efficiency (small or skinny GEMMs run further from peak).
``model_flops`` is the useful work per step (MFU's numerator, causal attention counted
once, no recomputation); ``megatron_flops`` is the published convention of the
calibration sets (non-causal attention, optionally with the recompute pass).

Per micro-batch on a rank (T = b*S/cp tokens, the stage holding l_d dense and l_e MoE
layers, * = 2 for matmul multiply-adds):
  q,k,v,o projections   2*T*h*(a + 2g)*d/tp + 2*T*a*d*h/tp         per layer
                        (latent attention: 2*T*(its weights, attention_weights())/tp, but the
                        down-projections to the latents whole: + 2*T*latent_down_weights()*(1 - 1/tp);
                        KV-head replication, kv_r = 1 where tp does not divide g: the
                        k and v projections whole, + kv_r*2*T*2*h*g*d*(1 - 1/tp))
  causal attention      b*S^2*a*(d + d_v)/(tp*cp)   (x2 when unfused) per layer
  dense MLP             2*T*(2 + gated)*h*F/tp                       per dense layer
  MoE (T/tp tokens)     2*(T/tp)*(h*E + (k*rho + n_sh)*(2 + gated)*h*F_e)  per MoE layer
  LM head               2*T*h*V/tp                                   last pp rank
Backward is 2x forward for GEMMs and 2.5x for flash attention (it recomputes the
scores; unfused attention, as in Megatron before 2023, computes the full masked score
matrix and its backward is 2x); recomputation adds a forward of the layers (full) or of attention (selective).

``counted_flops`` is what torch's ``FlopCounterMode`` counts for one optimizer step of the rank
(``Cost.flops(pp_rank)``), per micro-batch times m, with h_l = a/tp heads on the rank:
  matmul forward        the GEMM classes above but attention (2*M*K*N each; experts: the grouped
                        GEMM's rows, which FlopCounterMode counts given a formula for it)
  matmul backward       2x matmul forward (an input and a weight gradient per GEMM)
  attention forward     (l_d + l_e) * 2*b*h_l*A*(d + d_v)
  attention backward    (l_d + l_e) * 2*b*h_l*A*(3d + 2d_v)   (FlopCounterMode's fused-backward
                        formula: the scores recomputed, dV, dP, dQ, dK; CP's blockwise backward alike)
  recompute             full: the layers' matmul forward but down_proj (torch's early stop ends the
                        region at its last saved tensor), and attention forward; selective: attention
                        forward
where A is the score area a rank computes: S^2 for the fused kernel (cp = 1; FlopCounterMode counts
the whole matrix, causal or not), and under CP the (2cp + 1) blocks of (S/2cp)^2 that the causal
load-balanced split leaves a rank (autopar/ops/cp_attention.py: its two chunks against every chunk
at or before them; Ulysses computes the same area over a/(tp*cp) heads and the whole sequence).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .symbols import (Vt, FLASH, LAST, RFULL, RSEL, E, a, b, cp, d, dr, dv, ep, f, fe, g, gated, h, k, ld, le,
                      lq, m, mla, nsh, rho, rkv, rq, s, tp)

__all__ = ["Gemm", "KV_REPLICATED", "attention_weights", "kv_weights", "latent_down_weights", "gemm_classes", "model_flops",
           "megatron_flops", "per_token_layer_flops", "counted_flops"]


@dataclass(frozen=True)
class Gemm:
    name: str
    fwd: sympy.Expr        # forward FLOPs per micro-batch on this rank (whole stage)
    size: sympy.Expr       # effective GEMM size n for the efficiency curve
    bwd_factor: sympy.Expr  # backward FLOPs / forward FLOPs
    recompute: sympy.Expr  # fraction of the forward recomputed in backward (0..1)


def attention_weights():
    """Weight elements of one layer's attention, unsharded: ``(q, k and v projections, o)``.

    Grouped-query attention: ``h*(a + 2g)*d`` and ``a*d*h``.  Multi-head latent attention
    (``mla = 1``, DeepSeek): q through a rank-``r_q`` latent (``l_q = 1``: ``h*r_q + r_q*a*d``, else
    ``h*a*d``), k and v from one rank-``r_kv`` latent plus the shared rope key
    (``h*(r_kv + d_r)``) expanded to every head's no-rope key and value
    (``r_kv*a*(d - d_r + d_v)``), and the output from V's head dim, ``a*d_v*h``."""
    q = (1 - lq) * h * a * d + lq * (h * rq + rq * a * d)
    kv = (1 - mla) * 2 * h * g * d + mla * (h * (rkv + dr) + rkv * a * (d - dr + dv))
    return q + kv, a * dv * h


# KV-head replication (autopar.plan_space.kv_replicated): 1 where tp does not divide the KV heads,
# whose K and V projections every tp rank then holds whole (passes/tensor_parallel.py).
KV_REPLICATED = sympy.Min(sympy.Mod(g, tp), 1)


def latent_down_weights():
    """Elements of one layer's multi-head latent attention down-projections, which every tp rank
    keeps whole (the latents are shared by all heads; passes/tensor_parallel.py
    ``_latent_projections``): ``h*r_q`` (``l_q = 1``) and ``h*(r_kv + d_r)``; 0 without MLA.  The
    up-projections and o split by heads like any column / row."""
    return mla * (lq * h * rq + h * (rkv + dr))


def kv_weights(bias=0):
    """Elements of one layer's K and V projections, unsharded: ``2*g*d*(h + bias)`` (``bias``: the
    0/1 indicator of their biases); none under multi-head latent attention (its shared latents:
    :func:`latent_down_weights`)."""
    return (1 - mla) * 2 * g * d * (h + bias)


def _n(M, K, N):
    return 3 / (1 / M + 1 / K + 1 / N)


def gemm_classes() -> list[Gemm]:
    T = b * s / cp
    Te = T / tp
    lay = ld + le
    mlp_mult = 2 + gated
    tokens_per_expert = Te * k * rho * ep / E
    qkv, o = attention_weights()
    return [
        Gemm("qkv_proj", lay * 2 * T * (qkv / tp + (KV_REPLICATED * kv_weights() + latent_down_weights()) * (1 - 1 / tp)),
             _n(T, h, qkv / (h * tp)), 2, RFULL),
        Gemm("o_proj", lay * 2 * T * o / tp, _n(T, a * dv / tp, h), 2, RFULL),
        # Flash attention skips the masked half (bwd recomputes the scores: 2.5x); unfused
        # attention multiplies the full score matrix (and its backward is 2x).
        Gemm("attention", lay * b * s**2 * a * (d + dv) * (2 - FLASH) / (tp * cp), _n(s / cp, d, s),
             2 + FLASH / 2,
             RSEL + RFULL),  # recompute modes are exclusive
        Gemm("mlp", ld * 2 * T * mlp_mult * h * f / tp, _n(T, h, f / tp), 2, RFULL),
        Gemm("router", le * 2 * Te * h * E, _n(Te, h, E), 2, RFULL),
        Gemm("experts", le * 2 * Te * k * rho * mlp_mult * h * fe, _n(tokens_per_expert, h, fe), 2,
             RFULL),
        Gemm("shared_experts", le * 2 * Te * nsh * mlp_mult * h * fe, _n(Te, h, fe), 2, RFULL),
        Gemm("lm_head", LAST * 2 * T * h * Vt, _n(T, h, Vt), 2, sympy.Integer(0)),
    ]


_MATMULS = ("qkv_proj", "o_proj", "mlp", "router", "experts", "shared_experts", "lm_head")


def counted_flops() -> dict[str, sympy.Expr]:
    """One optimizer step's FLOPs on the scored pp rank, term by term, as torch's FlopCounterMode
    counts them (the module docstring's table; their sum is ``Cost.flops(pp_rank)``)."""
    classes = {gemm.name: gemm.fwd for gemm in gemm_classes()}
    matmul = sum(classes[name] for name in _MATMULS)
    cp_blocks = sympy.Max(0, sympy.Min(1, cp - 1, evaluate=False), evaluate=False)  # 1 under CP
    area = (1 - cp_blocks) * s**2 + cp_blocks * (2 * cp + 1) * (s / (2 * cp))**2
    per_score = (ld + le) * 2 * b * (a / tp) * area
    attention = per_score * (d + dv)
    down_proj = ld * 2 * (b * s / cp) * h * f / tp
    return {
        "matmul_forward": m * matmul,
        "matmul_backward": m * 2 * matmul,
        "attention_forward": m * attention,
        "attention_backward": m * per_score * (3 * d + 2 * dv),
        "recompute": m * (RFULL * (matmul - classes["lm_head"] - down_proj) + (RSEL + RFULL) * attention),
    }


def per_token_layer_flops(spec, seq_len: int) -> tuple[float, float, float]:
    """Forward FLOPs per token of (a dense layer, a MoE layer, the LM head), unsharded."""
    H = spec.hidden
    attn = 2 * spec.attention_weight_params + seq_len * spec.num_heads * (spec.head_dim + spec.v_dim)
    mult = 3 if spec.gated_mlp else 2
    dense = attn + 2 * mult * H * spec.ffn
    moe = attn + 2 * H * spec.num_experts + 2 * (spec.top_k + spec.num_shared_experts) * mult * H * (
        spec.moe_ffn or 0)
    return float(dense), float(moe), float(2 * H * spec.vocab)


def model_flops(spec, seq_len: int, global_batch: int) -> float:
    """Useful FLOPs per step: 3x the forward (causal attention, no recompute)."""
    dense, moe, head = per_token_layer_flops(spec, seq_len)
    nmoe = spec.num_moe_layers
    per_token = (spec.num_layers - nmoe) * dense + nmoe * moe + head
    return 3.0 * per_token * seq_len * global_batch


def megatron_flops(spec, seq_len: int, global_batch: int, *, recompute: bool = False) -> float:
    """The published Megatron count: 72*B*s*l*h^2*(1 + s/6h + V/12lh) for a GPT layer (MHA,
    FFN 4h), generalised as in Megatron-LM's ``num_floating_point_operations`` (GQA, gated MLP,
    experts); with ``recompute`` the forward is counted twice more for the layers (96 instead of
    72, the SC'21 paper's convention: 96*B*s*l*h^2*(1 + s/6h + V/16lh))."""
    H, Lyr = spec.hidden, spec.num_layers
    q_ratio = spec.num_heads * spec.head_dim / H
    kv_ratio = spec.num_kv_heads / spec.num_heads
    gated_mult = 1.5 if spec.gated_mlp else 1.0
    moe_frac = spec.num_moe_layers / Lyr
    mlp = (1 - moe_frac) * spec.ffn / H * gated_mult + moe_frac * (
        (spec.moe_ffn or 0) / H * (spec.top_k + spec.num_shared_experts) * gated_mult)
    layer = (1 + kv_ratio + seq_len / H) * q_ratio + mlp
    expansion = 16 if recompute else 12   # (3 passes, or 4 with the recompute) x 2 FLOPs per MAC x 2
    logit = spec.vocab / (2 * Lyr * H) * (12 / expansion)
    return expansion * global_batch * seq_len * Lyr * H * H * (layer + logit)
