"""Time: compute at a calibrated efficiency, collectives by alpha-beta, overlap, step time.

Compute. A GEMM class of F FLOPs and effective size n (flops.py) takes
    F / (P_peak * eta(n)),   eta(n) = eta_max * n / (n + kappa * 1.5 * w * P_peak / B_hbm),
a smoothed roofline: a GEMM's arithmetic intensity is (2 / 3w) n FLOP/byte and the GPU's
balance point P_peak / B_hbm, so small or skinny GEMMs (large tp, small micro-batches) run
further from peak, more so on GPUs with more FLOPs per byte of bandwidth. eta_max
(hardware.py's gemm_efficiency, per GPU) is the fraction of peak that large GEMMs reach.
The attention kernel is priced as a GEMM of its FLOPs and size, times x_attn (1 for a preset; in a
profile the measured seconds of the device's causal SDPA over that price).
Element-wise work (norms, residuals, RoPE, activation functions, MoE permutes, softmax
cross-entropy) is memory bound: bytes moved / B_ew, where B_ew = B_hbm for a preset and, in a
hardware profile measured by ``autopar calibrate``, the bandwidth at which this byte count
reproduces an eager decoder layer's element-wise kernels on the machine (profile.py).

Collectives. A call moving ``sent`` bytes (the byte convention of docs/architecture.md) on axis X costs
    sent * beta_X + passes * alpha_X,
where beta_X, alpha_X come from the axis' layout (hardware.py: NVLink inside a node, the
network across nodes, hierarchical rings, the collective efficiency ``epsilon`` folded
into both bandwidths); a ring collective's beta is times its factor x_ar / x_ag / x_rs (1 for a
preset; a measured profile's ring bandwidth over that collective's own).

Exposure. Asynchronous communication hides behind compute up to a fraction ``phi``:
exposed = max((1 - phi) t, t - window), the window being the compute it can run under:
  * DP gradient reduction: the last micro-batch's backward (plain DP's bucket all-reduces);
    ZeRO 2-3's per-unit reduce-scatters: each backward; parameter all-gathers (ZeRO-3 per use):
    the forward (or backward) they prefetch for; with ``zero_overlap`` (the default: autopar's
    runtime, as Megatron's distributed optimizer) ZeRO-1's reduce-scatters the last backward and
    ZeRO 1-2's after-step all-gathers the next forward; without it both are exposed (blocking);
  * CP ring: the attention block it pipelines with; PP P2P: (1 - phi) t;
  * TP/SP collectives sit on the critical path unless ``tp_comm_overlap`` (then
    (1 - phi) t); EP all-to-alls likewise, except under dualpipev (overlapped);
  * CP all-gather / Ulysses, the tp gradient all-reduce, the loss all-reduce: exposed.

Step. Per micro-batch, the slowest pp rank takes T_f = compute_f + exposed_f and
T_b = compute_b + exposed_b; step = m (T_f + T_b) + bubble (pipeline.py) + exposed
per-step collectives + the optimizer update (memory bound: bytes / B_opt; B_opt = B_hbm for a
preset, the measured rate of torch's AdamW step in a profile).

The four constants (eta_max, kappa, epsilon, phi) are fitted to calibration.md (see
calibration.py and docs/cost-model.md).
"""
from __future__ import annotations

import sympy

from .comm import RowSpec
from .params import local_param_elems
from .flops import gemm_classes
from .symbols import (XEW, Vt, RING_FACTORS, DPV, FLASH, LAST, RFULL, RSEL, SP, TPOV, Z1, Z2, ZOV, m, x_attn, E, a, b,
                      cp, d, dp, ep, eta_max, f,
                      fe, g, gated, h, hbm_bw, k, kappa, ld, le, link_symbols, nsh, opt_bw, peak, phi, rho, s, tp, w,
                      wg, wo, wp, ew_bw)

__all__ = ["CALIBRATED", "efficiency", "compute_terms", "row_time", "exposure", "optimizer_time"]

# Fitted to calibration.md sets A, B, C (calibration.py; docs/cost-model.md has the table).
# eta_max is per GPU (hardware.GPU_PRESETS' gemm_efficiency, 0.75 on A100 and H100 alike);
# a value here overrides it. kappa = 1 puts the efficiency knee at the roofline's.
CALIBRATED = dict(eta_max=None, kappa=1.0, epsilon=0.9, phi=0.8)

def efficiency(n):
    """eta_max * n / (n + n_knee), n_knee = kappa * 1.5 * w * P_peak / B_hbm: a smoothed roofline,
    since a GEMM's arithmetic intensity is 2 / (w (1/M + 1/K + 1/N)) = (2 / 3w) n FLOP/byte."""
    return eta_max * n / (n + kappa * sympy.Rational(3, 2) * w * peak / hbm_bw)


def _elementwise_bytes_fwd():
    T = b * s / cp
    t_sp = T * (1 - SP + SP / tp)
    Te = T / tp
    per_layer = 10 * t_sp * h * w + 2 * T * (a + g) * d * w / tp
    # Unfused attention: scores written, scale-mask-softmax read+write, dropout read+write
    # plus a 1-byte mask, read by the PV GEMM: (6w + 1) bytes per score element.
    per_layer += (1 - FLASH) * b * a * s**2 / (tp * cp) * (6 * w + 1)
    dense = per_layer + (2 + gated) * T * f * w / tp
    moe = per_layer + (2 + gated) * Te * (k * rho + nsh) * fe * w + 4 * Te * k * rho * h * w + Te * E * 8
    # x_ew: the model's layers' element-wise bytes over a Llama layer's (frontend/elementwise.py)
    return XEW * (ld * dense + le * moe), LAST * 2 * T * Vt * (w + 4)


def compute_terms() -> dict[str, sympy.Expr]:
    """Per micro-batch compute seconds on the scored pp rank: fwd, bwd (incl. recompute), weight-grad share."""
    terms: dict[str, sympy.Expr] = {}
    fwd = bwd = wgrad = sympy.Integer(0)
    for gemm in gemm_classes():
        t = gemm.fwd / (peak * efficiency(gemm.size))
        if gemm.name == "attention":
            t = t * x_attn  # the attention kernel against a GEMM of its size (a profile's measured factor)
        terms[f"compute.fwd.{gemm.name}"] = t
        terms[f"compute.bwd.{gemm.name}"] = t * (gemm.bwd_factor + gemm.recompute)
        fwd += t
        bwd += t * (gemm.bwd_factor + gemm.recompute)
        if gemm.name != "attention":
            wgrad += t  # weight gradient = one forward's worth of the GEMM
    layers_bytes, head_bytes = _elementwise_bytes_fwd()
    ew_f = (layers_bytes + head_bytes) / ew_bw
    scores = (1 - FLASH) * (ld + le) * b * a * s**2 / (tp * cp) * (6 * w + 1)
    ew_b = (2 * layers_bytes + head_bytes + RFULL * layers_bytes + RSEL * scores) / ew_bw
    terms.update({"compute.fwd.elementwise": ew_f, "compute.bwd.elementwise": ew_b,
                  "fwd": fwd + ew_f, "bwd": bwd + ew_b,
                  "wgrad": wgrad})
    return terms


def row_time(row: RowSpec) -> sympy.Expr:
    """Seconds per call of ``row`` (P2P receives are free: links are full duplex)."""
    if row.collective == "recv":
        return sympy.Integer(0)
    if row.axis == "pp_embed":
        beta, alpha = link_symbols("pp", "a2a")
    else:
        kind = "ring" if row.collective in RING_FACTORS else "a2a"
        beta, alpha = link_symbols(row.axis, kind)
        beta = beta * RING_FACTORS.get(row.collective, 1)
    return row.sent * beta + row.passes * alpha


def exposure(row: RowSpec, t: sympy.Expr, comp: dict[str, sympy.Expr]) -> sympy.Expr:
    """Exposed part of ``t`` seconds of ``row`` (see the module docstring)."""
    hide = lambda window: sympy.Max((1 - phi) * t, t - window, evaluate=False)  # noqa: E731
    dim, phase = row.dimension, row.phase
    if dim in ("tp", "sp") and phase in ("fwd", "bwd"):
        return t * (1 - TPOV * phi)
    if dim == "ep":
        return t * (1 - DPV * phi)
    if dim == "pp" and phase in ("fwd", "bwd"):
        return (1 - phi) * t
    if dim == "cp":
        if row.collective in ("send", "recv"):
            core = comp["compute.fwd.attention"]
            return hide(core if phase == "fwd" else 2.5 * core)
        return t
    if dim == "zero" and phase in ("fwd", "bwd"):
        return hide(comp["fwd"] if phase == "fwd" else comp["bwd"])
    if dim == "zero" and phase == "step":
        # ZeRO 1-2's all-gather of the updated parameters: started after the step, waited for at
        # each unit's first use in the next forward (blocking without zero_overlap).
        return ZOV * hide(comp["fwd"]) + (1 - ZOV) * t
    if dim == "dp" and phase == "grad":
        # Plain DP's bucket all-reduces start in the last backward; ZeRO 2-3 reduce-scatter each
        # unit under every micro-batch's backward (m of them hide); ZeRO-1 in the last backward
        # with zero_overlap (the default), else after it, blocking.
        blocking = (Z1 - Z2) * (1 - ZOV)
        return blocking * t + (1 - blocking) * hide(comp["bwd"] * (1 + (m - 1) * Z2))
    return t


def optimizer_time() -> sympy.Expr:
    """Adam update: read grads, read/write state and master weights, write parameters (at B_opt)."""
    dense, expert, _ = local_param_elems()
    n = dp * cp
    shard = (dense + expert * ep) / n * Z1 + (dense + expert) * (1 - Z1)
    return (shard * (wg + 2 * wo) + (dense + expert) * wp) / opt_bw
