"""The sympy symbols of the cost model, in one place.

Every formula in ``autopar.cost`` (comm.py, flops.py, memory.py, pipeline.py,
time.py) is written in these symbols, each defined here once (one Python name, one sympy
name). ``model.py`` lambdifies the formulas once and evaluates them with numbers: scalars for
the model and hardware symbols, numpy arrays (one entry per candidate plan) for the plan
symbols (:mod:`autopar.planning.search`).

Groups:
  * model: ``b`` (micro-batch size per replica), ``s`` (sequence length), ``h``,
    ``a`` (heads), ``g`` (KV heads), ``d`` (head dim), ``f`` (dense FFN), ``fe``
    (expert FFN), ``V``, ``E`` (experts), ``k`` (top-k), ``w`` (dtype bytes), the
    parameters beyond the decoder (``n_ln``, ``p_b``, ``P_emb``, ``emb_norm``, ``P_head``, ``head_bias``; ModelSpec's
    fields of frontend/spec_dims.py), the logits gather ``gathered_logits``, the sequence cumsums
    ``n_cs`` / ``c_cs`` and the CP K/V heads ``g_cp``, ``tied`` (the LM head shares the embedding), ``norm_offset`` (norms scale by 1 + weight), ``x_ew`` (a layer's element-wise bytes over a
    Llama layer's), and
    the per-pp-rank layer counts ``ld`` (dense layers) / ``le`` (MoE layers) on the pp rank being scored;
  * plan: degrees ``tp, dp, cp, pp, ep, vpp, m`` (micro-batches per step) and 0/1
    indicators (``sp``, recompute, ZeRO stage, CP variant, stage role) so that every
    formula is a rational function without ``Piecewise`` (fast to evaluate on arrays), and the
    scored rank's gradient-bucket counts ``n_bd``, ``n_ud``, ``n_be``, ``n_ue`` (buckets.py) and
    whether it keeps whole gradients all step (``keep``);
  * options of the run: ``tp_overlap`` (TPOV), ``zero_overlap`` (ZOV) and ``dualpipe`` (DPV), and of
    the backend: ``c_bk`` (CBK, it copies each collective's buffer);
  * hardware and calibration constants (``peak``, ``hbm_bw``, ``ew_bw``, ``opt_bw``, link bandwidths
    and latencies per axis and kind, ring collectives' factors ``x_ar``, ``x_ag``, ``x_rs``, the
    attention kernel's ``x_attn``, :func:`link_symbols`; ``eta_max``, ``kappa``, ``eps``, ``phi``).
"""
from __future__ import annotations

import sympy

__all__ = [
    "b", "s", "h", "a", "g", "d", "f", "fe", "V", "E", "k", "w", "nsh", "sgate", "nn", "qb", "qkn", "qkh", "fq", "aux",
    "gated", "mla", "lq", "rq", "rkv", "dr", "dv", "nl", "pb", "Pe", "en", "Ph", "hb", "lg", "ncs", "ccs", "gc",
    "ld", "le", "L", "Le", "Vt",
    "tp", "dp", "cp", "pp", "ep", "vpp", "m", "SP", "RSEL", "RFULL",
    "Z1", "Z2", "Z3", "CPRING", "CPAG", "CPUL", "FIRST", "LAST", "INFL", "NSEND", "NRECV", "NBD", "NUD", "NBE", "NUE",
    "UMX", "KEEP", "rho", "FLASH", "TIED", "NOFF", "XEW", "TPOV", "ZOV", "DPV", "CBK", "wg", "wgc", "wo", "wp", "wz",
    "peak", "hbm_bw", "ew_bw", "opt_bw", "x_ar", "x_ag", "x_rs", "RING_FACTORS", "x_attn", "eta_max", "kappa", "eps",
    "phi",
    "MODEL_SYMBOLS", "PLAN_SYMBOLS", "ALL_SYMBOLS", "link_symbols",
]

_pos = dict(positive=True)

# ---- model
b, s, h, a, g, d = sympy.symbols("b S H a g d", **_pos)  # micro-batch, seq, hidden, heads, kv heads, head dim
f, fe, V, E, k = sympy.symbols("F F_e V E k", **_pos)     # ffn, expert ffn, vocab, experts, top-k
w = sympy.Symbol("w", **_pos)                              # bytes per activation / parameter element
nsh = sympy.Symbol("n_sh", nonnegative=True)               # shared experts per MoE layer
sgate = sympy.Symbol("shared_gate", nonnegative=True)      # 1: a Linear(h, 1) gate on the shared experts
nn = sympy.Symbol("n_norm", **_pos)                        # weight vectors per norm (1 RMSNorm, 2 LayerNorm)
qb = sympy.Symbol("q_b", nonnegative=True)                 # 1 if q/k/v projections have a bias
qkn = sympy.Symbol("qk_norm", nonnegative=True)            # 1 if q and k are normalised over their whole width
qkh = sympy.Symbol("qk_head_norm", nonnegative=True)       # 1 if q and k are normalised per head
fq = sympy.Symbol("fused_qkv", nonnegative=True)           # 1 if q, k and v come from one fused projection
aux = sympy.Symbol("aux_loss", nonnegative=True)           # 1 if the loss has the MoE load-balancing loss
gated = sympy.Symbol("gated", nonnegative=True)            # 1 for SwiGLU (3 matrices), 0 for plain (2)
mla = sympy.Symbol("mla", nonnegative=True)                # 1 for multi-head latent attention (DeepSeek)
lq = sympy.Symbol("l_q", nonnegative=True)                 # 1 if MLA's q goes through a low-rank latent
rq, rkv = sympy.symbols("r_q r_kv", nonnegative=True)      # MLA: q and kv latent ranks
dr = sympy.Symbol("d_r", nonnegative=True)                 # MLA: the rope part of each q/k head (in d)
dv = sympy.Symbol("d_v", **_pos)                           # V's head dim (d without MLA)
nl = sympy.Symbol("n_ln", **_pos)                          # norms per layer (2; Gemma 2: 4)
pb = sympy.Symbol("p_b", nonnegative=True)                 # 1 if o_proj and the MLP projections have biases
Pe = sympy.Symbol("P_emb", nonnegative=True)               # embedding parameters beyond the token table
en = sympy.Symbol("emb_norm", nonnegative=True)           # 1 if a norm follows the embeddings (first pp rank)
Ph = sympy.Symbol("P_head", nonnegative=True)              # parameters of a head transform (outside the layers)
hb = sympy.Symbol("head_bias", nonnegative=True)           # 1 if the LM head has a bias [V]
lg = sympy.Symbol("gathered_logits", nonnegative=True)     # 1 if tp all-gathers the logits (no vocab-parallel loss)
ncs = sympy.Symbol("n_cs", nonnegative=True)               # cumulative sums along the sequence (per micro-batch)
ccs = sympy.Symbol("c_cs", nonnegative=True)               # bytes per sample of one such sum's position slice
gc = sympy.Symbol("g_cp", **_pos)                          # K/V heads the CP collectives move (g, or a)
ld, le = sympy.symbols("l_d l_e", nonnegative=True)        # dense / MoE layers on the scored pp rank
L, Le = sympy.symbols("L L_e", **_pos)                     # layers in the model / MoE layers in the model
TIED = sympy.Symbol("tied", nonnegative=True)              # 1 if the LM head shares the embedding matrix
NOFF = sympy.Symbol("norm_offset", nonnegative=True)       # 1 if the norms scale by 1 + weight (Gemma)
XEW = sympy.Symbol("x_ew", positive=True)                  # a layer's element-wise bytes over a Llama layer's

# ---- plan
tp, dp, cp, pp, ep, vpp, m = sympy.symbols("tp dp cp pp ep v m", **_pos)
SP = sympy.Symbol("sp", nonnegative=True)                  # sequence parallelism on (1) / off (0)
# vocabulary rows of the embedding / LM head on one tp rank: ceil(V/tp), the vocabulary padded to a
# multiple of tp where tp does not divide it (passes/tensor_parallel.py)
Vt = sympy.ceiling(V / tp)
RSEL, RFULL = sympy.symbols("r_sel r_full", nonnegative=True)
Z1, Z2, Z3 = sympy.symbols("z_1 z_2 z_3", nonnegative=True)  # 1 if ZeRO stage >= 1, >= 2, == 3
CPRING, CPAG, CPUL = sympy.symbols("cp_ring cp_ag cp_ul", nonnegative=True)
FIRST, LAST = sympy.symbols("first last", nonnegative=True)  # scored pp rank holds the embedding / the head
INFL = sympy.Symbol("n_inflight", positive=True)           # micro-batches of activations held (in stage units)
NSEND, NRECV = sympy.symbols("n_send n_recv", nonnegative=True)  # P2P sends / receives per micro-batch (fwd)
# Gradient buckets with a tensor on the scored rank (buckets.py): dense and routed-expert gradients,
# and the same cut at pipeline-chunk borders (ZeRO-2's units under pp).
NBD, NUD, NBE, NUE = sympy.symbols("n_bd n_ud n_be n_ue", nonnegative=True)
UMX = sympy.Symbol("u_max", nonnegative=True)              # elements of the rank's largest dense bucket
# 1 if the scored rank keeps its whole gradients all step (plain dp's buckets, ZeRO-1's flat
# buffers): autopar.plan_space.grads_kept, evaluated per plan (model.plan_values).
KEEP = sympy.Symbol("keep", nonnegative=True)
rho = sympy.Symbol("rho", positive=True)                   # EP routing imbalance (or capacity factor)
FLASH = sympy.Symbol("flash", nonnegative=True)            # 1: fused (flash) attention, 0: scores materialised

# ---- options of the run
TPOV = sympy.Symbol("tp_overlap", nonnegative=True)        # 1 if TP communication overlaps compute
DPV = sympy.Symbol("dualpipe", nonnegative=True)           # 1 under the dualpipev schedule
# 1 if ZeRO-1/2's reduce-scatters and parameter all-gathers overlap compute (Megatron's distributed
# optimizer, calibration set A); autopar's runtime runs them blocking: 0.
ZOV = sympy.Symbol("zero_overlap", nonnegative=True)
# 1 if the collective backend copies the buffer of every reduce-scatter and all-gather it runs
# (gloo, measured: benchmarks/zero_memory.py, cost/memory.py ``collective_copies``); 0 for NCCL.
CBK = sympy.Symbol("c_bk", nonnegative=True)

# ---- precision (bytes per element)
wp = sympy.Symbol("w_p", **_pos)    # parameter
wg = sympy.Symbol("w_g", **_pos)    # gradient held in memory
wgc = sympy.Symbol("w_gc", **_pos)  # gradient as reduced over dp
wo = sympy.Symbol("w_o", nonnegative=True)  # optimizer state per parameter (with the fp32 master, if any)
wz = sympy.Symbol("w_z", nonnegative=True)  # ZeRO-3 parameter shard, beyond the master copy counted in w_o

# ---- hardware and calibration
peak, hbm_bw = sympy.symbols("P_peak B_hbm", **_pos)
# Bandwidths the element-wise kernels and the optimizer step reach (B_hbm unless a measured
# hardware profile gives them: time.py, hardware.Cluster).
ew_bw, opt_bw = sympy.symbols("B_ew B_opt", **_pos)
# Seconds per byte of each ring collective over the link's fitted ring rate (1 unless a measured
# profile timed each collective alone: gloo's all-gather and reduce-scatter are ~3x its all-reduce).
x_ar, x_ag, x_rs = sympy.symbols("x_ar x_ag x_rs", **_pos)
RING_FACTORS = {"all_reduce": x_ar, "all_gather": x_ag, "reduce_scatter": x_rs}
# The attention kernel's seconds over its FLOPs priced as a GEMM of its size (1 unless a profile measured it).
x_attn = sympy.Symbol("x_attn", **_pos)
eta_max, kappa, eps, phi = sympy.symbols("eta_max kappa epsilon phi", **_pos)


def link_symbols(axis: str, kind: str):
    """(seconds per byte sent, seconds per pass) on mesh axis ``axis`` (one of
    :data:`autopar.plan_space.GROUP_AXES`) for ``kind`` 'ring' or 'a2a'."""
    return (sympy.Symbol(f"beta_{kind}_{axis}", nonnegative=True),
            sympy.Symbol(f"alpha_{kind}_{axis}", nonnegative=True))


MODEL_SYMBOLS = (b, s, h, a, g, d, f, fe, V, E, k, w, nsh, sgate, nn, qb, qkn, qkh, fq, aux, gated, mla, lq, rq, rkv, dr,
                 dv, nl, pb, Pe, en, Ph, hb, lg, ncs, ccs, gc, L, Le, TIED, NOFF, XEW)
PLAN_SYMBOLS = (tp, dp, cp, pp, ep, vpp, m, SP, RSEL, RFULL, Z1, Z2, Z3, CPRING, CPAG, CPUL,
                FIRST, LAST, INFL, NSEND, NRECV, NBD, NUD, NBE, NUE, UMX, KEEP, ld, le, rho, FLASH)
ALL_SYMBOLS = MODEL_SYMBOLS + PLAN_SYMBOLS + (CBK, wp, wg, wgc, wo, wz, peak, hbm_bw, ew_bw, opt_bw, x_ar, x_ag, x_rs,
                                               x_attn, eta_max, kappa, eps, phi)
