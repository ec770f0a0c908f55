"""Memory per GPU: parameters, gradients, optimizer state, activations.

Precision conventions (``estimate(..., dtype_bytes=...)``):
  * ``dtype_bytes=2`` (mixed precision, Megatron; the runtime's ``mixed_precision="bf16"``):
    bf16 parameters (w_p = 2 B), fp32 main gradients (``grad_bytes``, default w_g = 4 B),
    reduced in the dtype they are held in (w_gc = w_g: Megatron-LM forces fp32
    accumulation and all-reduce with bf16), fp32 master weights + Adam m, v (w_o = 12 B):
    18 B per parameter before ZeRO (the ZeRO paper's 16 B assumes 2-byte gradients:
    pass ``grad_bytes=2``, which also reduces them in bf16);
  * ``dtype_bytes=4`` (all fp32, the CPU tests with torch AdamW): 4 B parameters, 4 B
    gradients, Adam m, v (8 B), no master copy.
ZeRO over the ``n`` ranks holding copies (dp*cp for dense weights, dp*cp/ep for
experts): ZeRO stage >= 1 divides the optimizer state by n, >= 2 the gradients, 3 the
parameters (plus a double buffer of one gathered layer, in w_p).  Under ZeRO-3 the
shard held is w_z bytes per element beyond the optimizer term: w_z = w_p in fp32; with
mixed precision w_z = 0, because the fp32 master shard (in w_o) is the parameter shard,
cast to bf16 as it is gathered (FSDP2's MixedPrecisionPolicy layout, not DeepSpeed's,
which keeps a bf16 shard besides the master).

Activations per layer and micro-batch, and outside the layers: :mod:`autopar.cost.activations`
(its docstring writes the formulas).

Beside them, for each micro-batch in flight on each of the rank's v chunks (``_stage_terms``):
  rope_tables    2*(S/cp)*d_rope*w      the rotary cos, sin the q and k rotations save
  stage_outputs  T_sp*h*w*((1 - last/v) - i*(1 - first/v))
                                        torch's stages keep a chunk's output until its backward; a
                                        chunk's input counted twice (i = 1 at w = 4 or full recompute)
and the moments of the step (``peak_memory``, ``peak_parts``: which terms are alive when):
  loss_backward       the loss beyond head_activations: forward's end or the loss's backward
  head_backward       the LM head's GEMM backward beyond head_activations  (_head_backward)
  layer_backward      a layer's first GEMM's working set in backward       (_layer_backward)
  low_precision_grads the bf16 gradients before they are folded into fp32  (mixed precision, ZeRO-0)
  ZeRO's sync and gather buffers                                            (_zero_transients)
Measured by torch's MemTracker at full width (tests/e2e/test_full_width.py) and by the CPU
allocator on small models (tests/dist/test_memory_peak.py); docs/cost-model.md has both tables.
"""
from __future__ import annotations

import sympy

from autopar.plan_space import ZERO_SCATTERS_IN_FLIGHT

from .activations import activation_parts, at_least_two
from .params import local_param_elems
from .symbols import (CBK, KEEP, TIED, UMX, Pe, en, nn, Vt, FIRST, INFL, LAST, NRECV, NSEND, NUD, RFULL, SP,
                      Z1, Z2, Z3, b, cp, d, dp, dr, ep, f, h, ld, le, lg, m, mla, s, tp, vpp, w, wg, wgc, wo,
                      wp, wz)

__all__ = ["memory_terms", "precision_bytes", "peak_memory", "peak_parts", "MOMENTS", "STATIC_TERMS", "HELD_TERMS"]


def precision_bytes(dtype_bytes: int, grad_bytes: int | None = None) -> dict[str, float]:
    """Bytes per parameter element: param, grad held, grad reduced, optimizer state (with the
    master copy), ZeRO-3 shard beyond the master (see the module docstring)."""
    if dtype_bytes >= 4:
        return dict(w_p=dtype_bytes, w_g=grad_bytes or dtype_bytes, w_gc=dtype_bytes, w_o=2 * dtype_bytes,
                    w_z=dtype_bytes)
    grad = grad_bytes or 4
    return dict(w_p=dtype_bytes, w_g=grad, w_gc=grad, w_o=12, w_z=0)


def _zero_transients(dense, expert, n_dense):
    """(zero_unit_buffer, zero_sync_buffer, collective_copies, zero3_buffer, zero3_layer_end): ZeRO's
    buffers beyond the model states, each alive in one phase of the step (:func:`peak_memory`).

    ZeRO-1/2 (runtime/gradients/zero_grads.py): a unit is a dp bucket, of u = min(u_max, P_dense) elements, the
    rank's largest (backward begins with the head's and the last layer's matrices, each a bucket
    of its own when it passes the cap; a model whose gradients fill one bucket has u = P_dense).
    ZeRO-1 holds its gradients whole in flat per-unit buffers (the ``grads`` term), each made at its
    unit's first gradient of the step and reduce-scattered in place: nothing more.  ZeRO-2 copies
    each gradient into its unit's buffer as backward makes it and frees the buffer once the unit's
    reduce-scatter is done.  When backward begins, the first unit's buffer is made beside the LM
    head's gradient, which autograd made and the hook adds into it (``zero_unit_buffer``); once the
    head's backward is done, with at most F = ``ZERO_SCATTERS_IN_FLIGHT`` reduce-scatters in flight,
    the next min(n_ud, F + 1) units' buffers are alive (one filling, F in flight; ZeRO-1 keeps them,
    ZeRO-2 frees each as its reduce-scatter ends):

        zero_unit_buffer = (z_1 - z_3) * u * w_gc
        zero_sync_buffer = (z_1 - z_3) * min(n_ud, F + 1) * u * w_gc

    A backend that copies the buffer of each collective it has been handed (gloo; c_bk = 1, 0 for
    NCCL) holds a copy per reduce-scatter in flight: under ZeRO-1/2 min(n_ud, F) units at the end
    of backward (ZeRO-1's last ones are started at the sync), ZeRO-3's one unit at a layer's end:

        collective_copies = c_bk * w_gc * ((z_1 - z_3) * min(n_ud, F) * u + z_3 * u_3)

    (in backward's window the unit being filled has not started: min(n_ud - 1, F) of them,
    :func:`peak_memory`).

    ZeRO-3's units (passes/zero.py): one per decoder layer (u_3 elements), the embedding's and the
    head's (the final norm and the LM head, P_head_unit).  When backward begins the head's unit is
    gathered and the last layer's prefetched; the head's is released once its gradient is
    reduce-scattered, and the embedding's is never re-gathered in backward (the lookup's backward
    reads only the indices) -- but where the head shares the embedding's table on this rank, that
    unit stays gathered from the head's backward to the embedding's (t = tied*first*last*V/tp*h):

        zero3_buffer = z_3 * (P_head_unit + t + u_3) * w_p

    At the end of a layer's backward the layer's unit and the next one prefetched are gathered, and
    the layer's gradient is reduce-scattered: autograd's per-parameter gradients (w_p per element) are joined into the
    gradient of the gathered buffer (the ``cat`` of the views' backward, already laid out for the
    reduce-scatter; FSDP2 copies its gradients into its reduce-scatter input the same way), which
    where the reduction is wider than the parameters (mixed precision: [w_gc > w_p]) is then cast
    to an fp32 copy -- two of the three alive at once -- and the shard it receives:

        zero3_layer_end = z_3 * ((t + 2 u_3) * w_p + u_3 * (w_p + max(w_p, [w_gc > w_p] * w_gc) + w_gc / n))"""
    in_flight = ZERO_SCATTERS_IN_FLIGHT
    u = sympy.Min(UMX, dense, evaluate=False)
    sync = (Z1 - Z3) * sympy.Min(NUD, in_flight + 1, evaluate=False) * u * wgc
    rest = dense.subs({ld: 0, le: 0})
    u3 = (dense + expert - rest) / sympy.Max(ld + le, 1, evaluate=False)
    copies = CBK * wgc * ((Z1 - Z3) * sympy.Min(NUD, in_flight, evaluate=False) * u + Z3 * u3)
    embedding_unit = FIRST * (Vt * h + Pe + en * h * nn)
    tied_table = TIED * FIRST * LAST * Vt * h
    zero3_buffer = Z3 * (rest - embedding_unit + tied_table + u3) * wp
    widened = sympy.Min(1, sympy.Max(0, wgc - wp, evaluate=False), evaluate=False)  # 1 when w_gc > w_p
    joined = sympy.Max(wp, widened * wgc, evaluate=False)  # the joined gradient, or its fp32 copy
    zero3_layer_end = Z3 * ((tied_table + 2 * u3) * wp + u3 * (wp + joined + wgc / n_dense))
    return (Z1 - Z3) * u * wgc, sync, copies, zero3_buffer, zero3_layer_end


def _low_precision():
    """1 when the working dtype is narrower than fp32 (w = 2: bf16 mixed precision), else 0."""
    return sympy.Max(0, sympy.Min(1, 3 - w, evaluate=False), evaluate=False)


def _head_backward():
    """(loss_backward, head_backward): the loss and the LM head beyond ``head_activations`` at two
    moments of backward (E = T*V/tp logits on the rank, ``vp`` = 1 where tp > 1 runs autopar's
    vocabulary-parallel cross-entropy, else aten's log-softmax and nll):

        loss_backward  max(E*4, vp*E*4 + (1 - vp)*2*E*4)
                                    forward's end (the logits in fp32: under mixed precision the
                                    program upcasts them before the loss, the bf16 ones freed, beside
                                    the exp or log-softmax made from them), or the loss's backward
                                    (the fp32 logits gradient, made in place; aten: nll's gradient
                                    and log-softmax's, their cast to w after the loss frees its exp)
        head_backward  E*w - E*4 + V/tp*h*w + T*h*w*(1 + sp)
                                    the head GEMM's backward: the exp freed; the logits gradient in
                                    w, the weight's gradient, the input's gradient and under SP the
                                    input all-gathered again for the weight's

    (autopar/ops/collectives.py ``_VocabParallelCrossEntropy``, measured by MemTracker at full width,
    tests/e2e/test_full_width.py).  Apart because what backward makes for the parameters starts at
    the second: ZeRO-3's units on the last pp rank (the head's re-gathered when its GEMM's backward
    reads the weight, the last layer's prefetched then) and ZeRO-1/2's first unit buffer (made at
    the head weight's gradient) are alive at the head GEMM only (peak_parts)."""
    T = b * s / cp
    logits = T * Vt
    vp = at_least_two(tp) * (1 - lg)
    loss_backward = sympy.Max(logits * 4, vp * logits * 4 + (1 - vp) * 2 * logits * 4, evaluate=False)
    head_gemm = logits * w - logits * 4 + Vt * h * w + T * h * w * (1 + SP)
    return LAST * loss_backward, LAST * head_gemm


def _layer_backward():
    """A layer's backward working set as its first GEMM (the MLP's row projection, down_proj) runs,
    every activation of the layer still alive: the gradient carried down the residual stream
    (T_sp*h*w), under SP all-gathered for the GEMM (T*h*w), the GEMM's input gradient
    (T*max(F, h)/tp*w) and its weight gradient (max(F, h)*h/tp*w, the parameters' dtype: added into
    the kept gradients, or kept itself)."""
    T = b * s / cp
    t_sp = T * (1 - SP + SP / tp)
    widest = sympy.Max(f, h, evaluate=False)
    return t_sp * h * w + SP * T * h * w + T * widest / tp * w + widest * h / tp * w


def _stage_terms():
    """(rope_tables, stage_outputs): per micro-batch in flight on each of the rank's ``v`` chunks.

    rope_tables: the rotary cos and sin tables the q and k rotations save, 2*(S/cp)*d_rope*w
    (computed once per chunk's forward, shared by its layers).  stage_outputs: torch's
    ``PipelineStage`` keeps each chunk's output until its backward (``fwd_cache``), T_sp*h*w for
    a chunk that is not the model's last; and a chunk's input, a receive buffer or the previous
    chunk's output counted there, is also what its first layer saves where that layer keeps its
    input itself (w = 4: the first norm's fp32 input; full recompute: the region's input), so it
    is taken off once for a chunk that is not the model's first.  The in-flight micro-batches are
    taken as spread evenly over the chunks."""
    T = b * s / cp
    t_sp = T * (1 - SP + SP / tp)
    held = INFL * vpp  # (chunk, micro-batch) pairs in flight
    rope = held * 2 * (s / cp) * ((1 - mla) * d + mla * dr) * w
    input_saved = RFULL + (1 - RFULL) * (1 - _low_precision())
    outputs = held * t_sp * h * (w * (1 - LAST / vpp) - w * input_saved * (1 - FIRST / vpp))
    return rope, outputs


def memory_terms(activation_formula: str = "derived") -> dict[str, sympy.Expr]:
    """Bytes per GPU on the scored pp rank, by category."""
    dense, expert, _ = local_param_elems()
    n_dense, n_exp = dp * cp, tp * dp * cp / ep  # experts are whole on each TP rank
    shard = lambda P, n, z: P * (1 - z + z / n)  # noqa: E731
    # Unsharded parameters in w_p; under ZeRO-3 the shard in w_z (0 when the master is it).
    params = (dense + expert) * (1 - Z3) * wp + Z3 * (dense / n_dense + expert / n_exp) * wz
    grads = (shard(dense, n_dense, Z2) + shard(expert, n_exp, Z2)) * wg
    optimizer = (shard(dense, n_dense, Z1) + shard(expert, n_exp, Z1)) * wo
    per_dense, per_moe, working, first, last = activation_parts(activation_formula)
    unit_buffer, sync, copies, zero3_buffer, zero3_layer_end = _zero_transients(dense, expert, n_dense)
    rope, outputs = _stage_terms()
    loss_backward, head_backward = _head_backward()
    # Transients (the peak timeline below): backward of the loss holds the fp32 gradient of the
    # logits and the log-softmax backward's temporary of the same size.
    T = b * s / cp
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "zero3_buffer": zero3_buffer,
        "activations": INFL * (ld * per_dense + le * per_moe),
        "recompute_buffer": working,
        "embedding_activations": FIRST * first,
        "head_activations": LAST * last,
        "loss_backward": loss_backward,
        "head_backward": head_backward,
        "head_weight_grad": LAST * Vt * h * w,   # backward's first gradient, in the parameters' dtype (peak_memory)
        "layer_backward": _layer_backward(),
        "rope_tables": rope,
        "stage_outputs": outputs,
        # Mixed precision without ZeRO: the micro-batch's bf16 gradients, left on the parameters until
        # backward ends (a pipeline: each chunk's backward) and they are folded into the fp32 main
        # gradients (runtime/stepping/precision.py MainGrads.accumulate).  ZeRO-1/2 fold each in its hook.
        "low_precision_grads": (1 - Z1) * _low_precision() * (dense + expert) * w / vpp,
        "zero_unit_buffer": unit_buffer,
        "zero_sync_buffer": sync,
        "collective_copies": copies,
        "zero3_layer_end": zero3_layer_end,
        # torch.distributed.pipelining keeps a receive buffer per micro-batch across steps for each
        # P2P receive (PipelineStage's args_recv_info / grad_recv_info): the rank's forward receives
        # of activations and, one per forward send, its backward receives of gradients.
        "pipeline_buffers": (NSEND + NRECV) * m * T * h * w * (1 - SP + SP / tp),
    }


# Terms alive at every point of the step; the rest peak in one phase or the other (peak_memory).
STATIC_TERMS = ("params", "optimizer", "pipeline_buffers")
# What each micro-batch in flight holds until its backward.
HELD_TERMS = ("activations", "rope_tables", "stage_outputs")


# The moments of a step whose largest is its peak (peak_parts), and what each is.
MOMENTS = {
    "B1_loss": "the first backward, every micro-batch in flight: the loss's backward",
    "B1_head": "the first backward, every micro-batch in flight: the LM head's backward",
    "B1_layer": "the first backward, every micro-batch in flight: its first layer's backward "
                "(ZeRO-1/2: the next units' buffers and reduce-scatters in flight)",
    "B2_loss": "a later backward (one micro-batch fewer in flight): the loss's backward",
    "B2_head": "a later backward (one micro-batch fewer in flight): the LM head's backward",
    "B2_layer": "a later backward (one micro-batch fewer in flight): its first layer's backward",
    "E": "a backward's end, its bf16 gradients not yet folded into the fp32 main gradients",
    "S": "backward done: the gradient sync",
    "B3": "ZeRO-3: the last layer's backward ends",
}


def _zero_window_factors():
    """(c_w, c_s): the share of ``collective_copies`` alive in backward's window (the unit being
    filled has not started) and of ``zero_sync_buffer`` at backward's end (none is being filled)."""
    in_flight = ZERO_SCATTERS_IN_FLIGHT
    started = sympy.Max(sympy.Min(NUD, in_flight, evaluate=False), 1, evaluate=False)
    c_w = sympy.Min(sympy.Max(NUD - 1, 0, evaluate=False), in_flight, evaluate=False) / started
    c_s = started / sympy.Max(sympy.Min(NUD, in_flight + 1, evaluate=False), 1, evaluate=False)
    return c_w, c_s


def peak_parts(terms: dict[str, sympy.Expr]) -> dict[str, dict[str, sympy.Expr]]:
    """Moment (:data:`MOMENTS`) -> term -> the bytes of that term alive then, beyond the static
    terms (:func:`peak_memory` has the formulas)."""
    g_1 = KEEP + (1 - KEEP) * at_least_two(m - INFL + 1)
    g_2 = KEEP + (1 - KEEP) * at_least_two(m)
    low = _low_precision()
    c_w, c_s = _zero_window_factors()
    zero12 = Z1 - Z3  # ZeRO-1 or 2: gradients go into unit buffers as they are made (hooks fold bf16 ones)
    first = {"zero3_buffer": 1, "embedding_activations": 1, **{x: 1 for x in HELD_TERMS}}
    later = {"zero3_buffer": 1, "embedding_activations": 1, **{x: 1 - 1 / INFL for x in HELD_TERMS}}
    head = {"head_activations": 1, "head_backward": 1}
    # The loss's backward: nothing made for the parameters yet (ZeRO-3's head unit not re-gathered,
    # ZeRO-1/2's first buffer not made: both come with the head GEMM's backward, _head_backward).
    loss = {"head_activations": 1, "loss_backward": 1, "zero3_buffer": 0}
    layer = {"recompute_buffer": 1, "layer_backward": 1}
    one_layer = 1 / (INFL * sympy.Max(ld + le, 1, evaluate=False))
    coefficients = {
        # The head's weight gradient, made first, is still held at the first layer's backward where
        # gradients are not kept (fp32), and as a bf16 gradient until backward ends (mixed precision);
        # under ZeRO-1/2 it is in its unit's buffer, the window's first.
        "B1_loss": {**first, "grads": g_1, **loss},
        "B1_head": {**first, "grads": g_1, **head, "zero_unit_buffer": 1},
        "B1_layer": {**first, "grads": g_1, **layer,
                     "head_weight_grad": (1 - zero12) * ((1 - g_1) * (1 - low) + low),
                     "zero_sync_buffer": Z2 - Z3 + (1 - g_1) * (Z1 - Z2), "collective_copies": zero12 * c_w},
        "B2_loss": {**later, "grads": g_2, **loss},
        "B2_head": {**later, "grads": g_2, **head},
        "B2_layer": {**later, "grads": g_2, **layer, "head_weight_grad": (1 - zero12) * low,
                     "zero_sync_buffer": Z2 - Z3, "collective_copies": (Z2 - Z3) * c_w},
        "E": {**{x: 1 - 1 / INFL for x in HELD_TERMS}, "grads": g_2, "low_precision_grads": 1},
        "S": {"grads": 1, "collective_copies": zero12, "zero_sync_buffer": (Z2 - Z3) * c_s},
        "B3": {"activations": 1 - one_layer, "embedding_activations": 1, "recompute_buffer": 1, "grads": g_2,
               "zero3_layer_end": 1, "collective_copies": Z3},
    }
    return {moment: {name: c * terms[name] for name, c in parts.items()} for moment, parts in coefficients.items()}


def peak_memory(terms: dict[str, sympy.Expr]) -> sympy.Expr:
    """The step's peak bytes on the scored rank: what is always alive plus the largest moment.

        peak = params + optimizer + pipeline_buffers
               + max(B1_loss, B1_head, B1_layer, B2_loss, B2_head, B2_layer, E, S, B3)
        B1_loss  = base - zero3_buffer + g_1 * grads + head_activations + loss_backward
                                               (the first backward, every micro-batch in flight: the
                                                loss's backward, nothing made for the parameters yet)
        B1_head  = base + g_1 * grads + H + zero_unit_buffer
                                               (then the LM head's backward: ZeRO-3's units gathered,
                                                ZeRO-1/2's first unit's gradient buffer)
        B1_layer = base + g_1 * grads + R + (1 - z_12) * h_g
                   + (z_2 - z_3 + (1 - g_1)(z_1 - z_2)) * zero_sync_buffer + z_12 * c_w * collective_copies
                                               (after the head, the first layer's: the head's
                                                activations freed; ZeRO-1/2: the next units' buffers,
                                                one filling, F reduce-scattering)
        B2_loss  = base' - zero3_buffer + g_2 * grads + head_activations + loss_backward
        B2_head  = base' + g_2 * grads + H     (a later backward: one micro-batch fewer,
        B2_layer = base' + g_2 * grads + R       earlier backwards' gradients)
                   + (1 - z_12) * L * head_weight_grad + (z_2 - z_3) * (zero_sync_buffer + c_w * collective_copies)
        E   = held (1 - 1/n_inflight) + g_2 * grads + low_precision_grads
                        (a backward's end under mixed precision: its bf16 gradients not yet folded)
        S   = grads + z_12 * collective_copies + (z_2 - z_3) * c_s * zero_sync_buffer
                        (backward done: the gradient sync; ZeRO-2's last units in flight)
        B3  = activations (1 - 1/(n_inflight (l_d + l_e))) + embedding_activations + recompute_buffer
              + g_2 * grads + zero3_layer_end + z_3 * collective_copies
                        (ZeRO-3: the last layer's backward ends; 0 without ZeRO-3)
        held  = activations + rope_tables + stage_outputs     (what each micro-batch in flight holds)
        base  = zero3_buffer + embedding_activations + held,  base' = the same with held (1 - 1/n_inflight)
        H     = head_activations + head_backward    (0 but on the last pp rank)
        R     = recompute_buffer + layer_backward
        h_g   = head_weight_grad ((1 - g_1)(1 - L) + L),   L = 1 under mixed precision (w = 2)
        g_1   = keep + (1 - keep) [m > n_inflight],   g_2 = keep + (1 - keep) [m >= 2]
        z_12  = z_1 - z_3 (ZeRO-1 or 2),   F = ZERO_SCATTERS_IN_FLIGHT
        c_w   = min(n_ud - 1, F) / min(n_ud, F),   c_s = min(n_ud, F) / min(n_ud, F + 1)

    ``keep`` (:func:`autopar.plan_space.grads_kept`, a plan value): plain data parallelism
    accumulates into persistent bucket buffers (runtime/gradients/grad_sync.py), alive all step; otherwise
    gradients are made by backward and freed after the step (ZeRO-1's flat buffers too, made at each
    unit's first gradient).  Without a pipeline (n_inflight = 1) B1 is the last micro-batch's
    backward, with the gradients of those before it; a 1F1B stage holding n_inflight micro-batches
    has no gradients at its first backward (B1, with the LM head's weight gradient, the first one
    made) unless the steady state follows (m > n_inflight), and then runs later backwards with a
    micro-batch fewer and every gradient (B2).  A backward's largest moment is the loss and LM
    head's (``head_backward``) or, after them, its first layer's, with that layer's recomputed
    activations (``recompute_buffer``) and its first GEMM's working set (``layer_backward``).
    ZeRO-1's buffers of earlier micro-batches are its ``grads`` (g_1 = 1 under accumulation), so
    B1_layer adds its window only when they are new; ``collective_copies`` is alive while its
    stage's reduce-scatters run: in backward and after it (ZeRO-1's last micro-batch, ZeRO-2), at a
    layer's end (ZeRO-3).  Each moment term by term is :func:`peak_parts` (``Cost.peak_breakdown``).
    Measured at full width by torch's MemTracker (tests/e2e/test_full_width.py) and on small models
    by the CPU allocator (tests/dist/test_memory_peak.py)."""
    moments = (sum(parts.values()) for parts in peak_parts(terms).values())
    return sum(terms[x] for x in STATIC_TERMS) + sympy.Max(*moments, evaluate=False)
