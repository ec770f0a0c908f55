"""Communication rows: bytes per collective per rank, for every parallel dimension.

Each :class:`RowSpec` is one kind of collective call on one mesh axis with sympy
formulas (symbols.py) for its group size, the bytes a rank sends and receives per call
(the ring convention of docs/architecture.md) and the number of calls per micro-batch or per step.
``estimate.py`` evaluates them into :class:`CommRow` for ``Cost.comm_table()`` and
``time.py`` prices them with the per-axis alpha-beta figures of hardware.py.

Layer structure seen by the rows, per stage (``l_d`` dense and ``l_e`` MoE layers):
  * TP without SP: all-reduce after o_proj / down_proj and the vocab-parallel embedding
    (forward), and at the entry of q/k/v, gate/up and the LM head (backward);
  * TP with SP: all-gather before each column group and the head, reduce-scatter after
    each row-parallel projection and the embedding, and their duals in backward; the GEMMs
    save the sequence shard and backward all-gathers it again (but inside a fully
    recomputed layer, whose recomputation gathers anyway);
    norms (and MoE routers / shared experts) get a per-step tp all-reduce of gradients;
  * KV-head replication (``KV_REPLICATED = min(g mod tp, 1)``): the k/v weights' gradients,
    ``2 g d (h + q_b)`` elements a layer, join that per-step partial-gradient sum; in a fused QKV
    (``f_q = 1``) they are summed in backward instead, per layer and micro-batch, one all-reduce of
    ``2 g d h w`` bytes for the weight and (``q_b``) one of ``2 g d w`` for the bias;
  * MoE blocks run on the rank's 1/tp slice of the tokens with whole experts (expert
    tensor parallelism 1, as in the reference): with SP there is no TP collective around
    them, without SP one all-gather restores the replicated output (and one in backward);
    dispatch and combine are all-to-alls over ``ep`` (buffer = tokens * top-k * h * rho);
  * CP ring: K,V circulate ``cp - 1`` times (backward: K,V and dK,dV); allgather:
    all-gather of K,V forward and reduce-scatter of dK,dV backward; Ulysses: all-to-all
    of q,k,v and of the output (and the reverse in backward); K,V have ``g_cp`` heads (``g``,
    or ``a`` when the GQA broadcast is not right before the attention op); each cumulative sum
    along the sequence (``n_cs``, on the first pp rank) all-gathers its chunk totals;
  * TP loss: a vocab-parallel cross-entropy (3 fp32 all-reduces per token), or, when the
    logits reach the loss through other ops (``gathered_logits``), one all-gather of them;
  * PP: the boundary activation (sequence-sharded by SP and CP) per send, and the loss
    all-reduced over pp once per step so that every stage returns it;
  * DP / ZeRO: gradient all-reduce (ZeRO-0) or reduce-scatter (1: per step, 2-3: per
    micro-batch; 3: per gather unit and micro-batch) over the ranks holding copies (dp*cp
    for dense weights, dp*cp/ep for experts), the parameter all-gather after the step (1-2)
    or per unit and micro-batch forward and backward (3; units = the stage's layers + 1 for
    embedding and head, as ``passes/zero.py`` groups them; a MoE layer's experts are a unit of
    their own, so expert rows count ``l_e`` units).  ZeRO stages 0-2 run one call per gradient
    bucket (``bucket_bytes``; buckets.py, ``autopar.plan_space.pack_buckets``): with the
    tensors' local bytes ``x_j`` in backward's order packed greedily into runs ``B_k``
    (``B_k`` closes before ``x_j`` when ``|B_k| + x_j > bucket_bytes``), the scored rank's
    buckets are ``n_bd = #{k : B_k holds a dense tensor of the rank}`` (``n_be`` for the
    routed experts, packed apart), and ZeRO-2 under pp cuts them at chunk borders,
    ``n_ud = sum_k #{chunks of the rank's tensors in B_k}`` (``n_ue``); so per step
        all-reduces        (1 - z_1) n_b
        reduce-scatters    z_1 (1 + (m - 1) z_2) [z_3 u + (1 - z_3) U],   U = n_b + z_2 (1 - z_3)(n_u - n_b)
        after-step gathers z_1 (1 - z_3) U
    (``n_b = n_u = n`` without pp), each row's bytes spread evenly over its calls.  The step
    time (time.py, model.py) prices their bytes in full but one latency per collective of the
    step (per chunk under ZeRO-2 with pp), not one per bucket: the model was calibrated so;
    Gradients partial over tp are summed once per step, on the dp*cp shard under ZeRO-2/3;
  * full recompute (passes/recompute.py): backward runs each layer's forward collectives
    again but the trailing one (after down_proj or the MoE block), with phase ``bwd``: with
    SP the all-gathers before q/k/v and gate/up and the reduce-scatter after o_proj, without
    SP the all-reduce after o_proj; ZeRO-3 re-gathers a unit once in backward as without
    recompute.  Selective recompute's regions hold no collective but a CP attention's: under
    either mode the recomputed CP attention sends its forward collectives again in backward
    (ring K,V hops, the K,V all-gather, Ulysses' two all-to-alls).  Recomputed MoE all-to-alls
    are not modelled (the runtime refuses recompute on rewritten MoE blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .symbols import (CPAG, CPRING, CPUL, E, FIRST, NOFF, TIED, Vt, LAST, NBD, NBE, NRECV, NSEND, NUD, NUE, RFULL,
                      RSEL, SP, Z1, Z2, Z3, Pe, Ph, a, en, b, ccs, cp, d, dp, dv, ep, g, gc, h, hb, k, ld, le, lg, m,
                      mla, ncs, nn, pp, qb, qkn, fq, rho, s, tp, aux, vpp, w, wgc, wp)
from .flops import KV_REPLICATED, kv_weights
from .params import local_param_elems

__all__ = ["CommRow", "RowSpec", "TOKEN_ROWS", "row_specs", "routed_row_formulas", "routed_all_to_all_rows",
           "activation_bytes", "local_param_elems", "zero3_units"]



@dataclass(frozen=True)
class CommRow:
    """One collective of ``Cost.comm_table()`` (see the cost contract for each field)."""

    phase: str
    dimension: str
    collective: str
    axis: str
    group_size: int
    bytes_sent: float
    bytes_recv: float
    count: int
    what: str

    @property
    def total_sent(self) -> float:
        return self.bytes_sent * self.count


@dataclass(frozen=True)
class RowSpec:
    phase: str
    dimension: str
    collective: str
    axis: str          # an axis of autopar.plan_space.GROUP_AXES, or "pp_embed" (priced as pp links)
    group: sympy.Expr
    sent: sympy.Expr
    recv: sympy.Expr
    count: sympy.Expr     # calls per micro-batch if per_mb, else per optimizer step
    per_mb: bool
    what: str
    routed: bool = False  # MoE token all-to-all: exact from a run's counts (routed_all_to_all_rows)
    # Calls whose latency the step time prices (None: every call).  The gradient buckets' rows
    # price one latency per collective of the step, as the calibrated model did before it counted
    # buckets (model.py ``_model_outputs``; see _data_parallel_rows).
    latency: sympy.Expr | None = None

    @property
    def passes(self) -> int:
        """Ring passes for the latency term (an all-reduce is reduce-scatter + all-gather)."""
        return 2 if self.collective == "all_reduce" else 1


def activation_bytes():
    """One micro-batch's ``[b, S/cp, H]`` activation on this rank (the contract's ``A``)."""
    return b * (s / cp) * h * w


# Rows a rank sends to / receives from the other ep ranks in one MoE dispatch (a (token,
# slot) pair is one row of h elements); combine moves them back.
N_OUT = sympy.Symbol("n_out", nonnegative=True)
N_IN = sympy.Symbol("n_in", nonnegative=True)
TOKEN_ROWS = {
    ("fwd", "dispatch"): "MoE dispatch: token rows to the expert owners",
    ("fwd", "combine"): "MoE combine: expert outputs back to the token owners",
    ("bwd", "dispatch"): "MoE dispatch backward: row gradients back to the token owners",
    ("bwd", "combine"): "MoE combine backward: output gradients to the expert owners",
}


def routed_row_formulas():
    """(phase, call, sent, received) of the token all-to-alls of one MoE call, in rows n_out/n_in."""
    out_b, in_b = N_OUT * h * w, N_IN * h * w
    return [("fwd", "dispatch", out_b, in_b), ("fwd", "combine", in_b, out_b),
            ("bwd", "dispatch", in_b, out_b), ("bwd", "combine", out_b, in_b)]


def routed_all_to_all_rows(expert_counts, *, ep_rank: int, hidden: int, dtype_bytes: int) -> list[CommRow]:
    """The token all-to-all rows of the realised routing, exactly (``Cost.comm_table(expert_counts=)``).

    ``expert_counts``: per MoE call, ``(sent per expert [E], received [source rank][local expert])``
    as recorded in ``comm_stats()['counts']``; ``n_out`` = the rows sent to experts of other
    ranks, ``n_in`` = the rows received from other ranks.
    """
    rows = []
    for sent_per_expert, received in expert_counts:
        ep_size = len(received)
        num_local = len(sent_per_expert) // ep_size
        mine = sent_per_expert[ep_rank * num_local:(ep_rank + 1) * num_local]
        values = {N_OUT: sum(sent_per_expert) - sum(mine),
                  N_IN: sum(sum(r) for src, r in enumerate(received) if src != ep_rank), h: hidden, w: dtype_bytes}
        for phase, call, sent, recv in routed_row_formulas():
            rows.append(CommRow(phase, "ep", "all_to_all", "ep", ep_size, float(sent.subs(values)),
                                float(recv.subs(values)), 1, TOKEN_ROWS[(phase, call)]))
    return rows


def zero3_units():
    """ZeRO-3 gather units on the scored pp rank: its layers, plus the embedding's and the head's
    (passes/zero.py: one each, the head's released after its backward)."""
    return ld + le + FIRST + LAST


def row_specs() -> list[RowSpec]:
    """All collective kinds; rows whose count or group evaluates to 0 / 1 are dropped later."""
    return (_tensor_parallel_rows() + _context_parallel_rows() + _expert_parallel_rows()
            + _pipeline_parallel_rows() + _data_parallel_rows() + _loss_rows())


def _ar(F, n):
    """Bytes a rank sends (= receives) in a ring all-reduce of ``F`` bytes over ``n`` ranks."""
    return 2 * (n - 1) / n * F


def _rs(F, n):
    """Bytes a rank sends in a ring reduce-scatter of ``F`` bytes over ``n`` ranks."""
    return (n - 1) / n * F


def _ag(shard, n):
    """Bytes a rank receives in an all-gather of ``shard``-byte shards over ``n`` ranks."""
    return (n - 1) * shard


def _a2a(buf, n):
    """Bytes a rank sends in an all-to-all of a ``buf``-byte buffer over ``n`` ranks."""
    return (n - 1) / n * buf


def _tokens():
    """Tokens of one micro-batch on this rank (``T = b*S/cp``)."""
    return b * s / cp


def _row_collector():
    """An empty RowSpec list and the ``add`` that appends to it (``recv`` defaults to ``sent``)."""
    rows: list[RowSpec] = []

    def add(phase, dim, coll, axis, group, sent, count, per_mb, what, recv=None, routed=False, latency=None):
        rows.append(RowSpec(phase, dim, coll, axis, group, sent, sent if recv is None else recv,
                            count, per_mb, what, routed, latency))

    return rows, add


def _fused_kv_rows(add) -> None:
    """A fused QKV under KV-head replication sums its KV rows' weight (and bias) gradient in backward,
    one call per tensor and micro-batch (autopar/ops/whole_rows.py), not in the step's buckets."""
    add("bwd", "tp", "all_reduce", "tp", tp, _ar(kv_weights() * w, tp), fq * KV_REPLICATED * (ld + le), True,
        "all-reduce of the KV rows of a fused QKV weight's gradient (KV-head replication), [2 g d, h]")
    add("bwd", "tp", "all_reduce", "tp", tp, _ar(2 * g * d * w, tp), fq * qb * (1 - mla) * KV_REPLICATED * (ld + le),
        True, "all-reduce of the KV rows of a fused QKV bias's gradient (KV-head replication), [2 g d]")


def _tensor_parallel_rows() -> list[RowSpec]:
    """Rows on the tp group: TP, SP, the SP-partial gradient sum and the vocab-parallel loss."""
    A = activation_bytes()
    T = _tokens()
    nsp = 1 - SP
    rows, add = _row_collector()
    add("fwd", "tp", "all_reduce", "tp", tp, _ar(A, tp), nsp * (2 * ld + le + FIRST), True,
        "all-reduce after o_proj / down_proj and the vocab-parallel embedding, [b, s, h]")
    add("bwd", "tp", "all_reduce", "tp", tp, _ar(A, tp), nsp * (2 * ld + le + LAST), True,
        "all-reduce of input grads at the q/k/v, gate/up and LM-head entries, [b, s, h]")
    add("fwd", "tp", "all_gather", "tp", tp, _ag(A / tp, tp), nsp * le, True,
        "all-gather of the MoE block output from token slices, shard [b, s/tp, h]")
    add("bwd", "tp", "all_gather", "tp", tp, _ag(A / tp, tp), nsp * le, True,
        "all-gather of the MoE block input grads from token slices, shard [b, s/tp, h]")
    add("fwd", "sp", "all_gather", "tp", tp, _ag(A / tp, tp), SP * (2 * ld + le + LAST), True,
        "all-gather before q/k/v, gate/up and the LM head, shard [b, s/tp, h]")
    add("fwd", "sp", "reduce_scatter", "tp", tp, _rs(A, tp), SP * (2 * ld + le + FIRST), True,
        "reduce-scatter after o_proj / down_proj and the embedding, [b, s, h]")
    add("bwd", "sp", "reduce_scatter", "tp", tp, _rs(A, tp), SP * (2 * ld + le + LAST), True,
        "reduce-scatter of grads, dual of the forward all-gathers, [b, s, h]")
    add("bwd", "sp", "all_gather", "tp", tp, _ag(A / tp, tp), SP * (2 * ld + le + FIRST), True,
        "all-gather of grads, dual of the forward reduce-scatters, shard [b, s/tp, h]")
    # The GEMMs after each forward all-gather saved its shard (autopar/ops/regather.py); inside a
    # fully recomputed layer they save the recomputed gather instead.
    add("bwd", "sp", "all_gather", "tp", tp, _ag(A / tp, tp), SP * ((1 - RFULL) * (2 * ld + le) + LAST), True,
        "re-gather of the saved sequence shard for the q/k/v, gate/up and LM-head weight gradients, "
        "shard [b, s/tp, h]")
    # Full recompute runs each layer's forward again in backward, but for its trailing collective
    # (after down_proj or the MoE block), which passes/recompute.py leaves outside the region.
    add("bwd", "tp", "all_reduce", "tp", tp, _ar(A, tp), RFULL * nsp * (ld + le), True,
        "recomputed forward (full recompute): all-reduce after o_proj, [b, s, h]")
    add("bwd", "sp", "all_gather", "tp", tp, _ag(A / tp, tp), RFULL * SP * (2 * ld + le), True,
        "recomputed forward (full recompute): all-gather before q/k/v and gate/up, shard [b, s/tp, h]")
    add("bwd", "sp", "reduce_scatter", "tp", tp, _rs(A, tp), RFULL * SP * (ld + le), True,
        "recomputed forward (full recompute): reduce-scatter after o_proj, [b, s, h]")
    _, _, partial = local_param_elems()
    # Under ZeRO-2/3 the rank holds only its dp*cp shard of these gradients when it sums them.
    add("grad", "sp", "all_reduce", "tp", tp, _ar(partial * wgc * (1 - Z2 + Z2 / (dp * cp)), tp), 1, False,
        "gradients of tp-replicated weights used on token shards or head slices (norms under SP, MoE routers, "
        "k/v projections under KV-head replication)")
    _fused_kv_rows(add)
    # A norm over a q or k projection's whole (tp-sharded) width sums its fp32 statistics per token
    # across ranks, and in backward the statistics' gradient (passes/reduction_rules.py _reduce_across_ranks).
    add("fwd", "tp", "all_reduce", "tp", tp, _ar(T * 4, tp), 2 * qkn * (ld + le), True,
        "all-reduce of the q/k norms' per-token statistics over the sharded width (OLMo 2), fp32")
    add("bwd", "tp", "all_reduce", "tp", tp, _ar(T * 4, tp), 2 * qkn * (ld + le) * (1 + RFULL), True,
        "all-reduce of the gradient of the q/k norms' statistics (and their recomputation), fp32")
    # The load-balancing loss's statistics on sequence shards: each MoE layer's expert counts and
    # summed router probabilities are summed across ranks at once (their gradient needs nothing).
    add("fwd", "tp", "all_reduce", "tp", tp, _ar(E * 4, tp), 2 * aux * le * SP, True,
        "all-reduce of each MoE layer's load-balancing statistics (expert counts, router probability sums), fp32 [E]")
    add("fwd", "loss_parallel", "all_reduce", "tp", tp, _ar(T * 4, tp), 3 * LAST * (1 - lg), True,
        "vocab-parallel cross-entropy: fp32 max, sum of exp, target logit per token")
    # Logits that reach the loss through other ops (a soft cap) are gathered whole instead; every rank
    # then computes the same loss, so backward keeps this rank's slice of the gradient (no collective).
    add("fwd", "tp", "all_gather", "tp", tp, _ag(T * Vt * w, tp), LAST * lg, True,
        "all-gather of the vocabulary-sharded logits for a loss after other ops, shard [b, s, V/tp]")
    return rows


def _context_parallel_rows() -> list[RowSpec]:
    """Rows on the cp group: the ring K,V passes, all-gather K,V and the Ulysses all-to-alls."""
    T = _tokens()
    kv2 = T * (gc / tp) * (d + dv) * w          # K and V on this rank (MLA's V is narrower than K)
    q = T * (a / tp) * d * w
    o = T * (a / tp) * dv * w                   # the attention output (and dO) has V's head dim
    n_attn = ld + le
    rows, add = _row_collector()
    # Backward: K,V hop cp-1 times again and the dK,dV accumulators hop cp-1 times (each starts
    # one rank after its home and ends there), as separate messages: twice the forward calls.
    for phase, what in (("fwd", "K,V (packed) to the next rank of the ring"),
                        ("bwd", "K,V and, separately, the dK,dV accumulators around the ring")):
        mult = 1 if phase == "fwd" else 2
        add(phase, "cp", "send", "cp", cp, kv2, mult * CPRING * (cp - 1) * n_attn, True, what,
            recv=0)
        add(phase, "cp", "recv", "cp", cp, 0, mult * CPRING * (cp - 1) * n_attn, True, what,
            recv=kv2)
    # Recompute (selective or full) runs the CP attention's forward collectives again in backward.
    again = RSEL + RFULL
    add("bwd", "cp", "send", "cp", cp, kv2, again * CPRING * (cp - 1) * n_attn, True,
        "recomputed attention: K,V (packed) around the ring again", recv=0)
    add("bwd", "cp", "recv", "cp", cp, 0, again * CPRING * (cp - 1) * n_attn, True,
        "recomputed attention: K,V (packed) around the ring again", recv=kv2)
    add("bwd", "cp", "all_gather", "cp", cp, _ag(kv2, cp), again * CPAG * n_attn, True,
        "recomputed attention: all-gather of K,V again")
    add("bwd", "cp", "all_to_all", "cp", cp, _a2a(q + kv2, cp), again * CPUL * n_attn, True,
        "recomputed attention: Ulysses all-to-all of q,k,v again")
    add("bwd", "cp", "all_to_all", "cp", cp, _a2a(o, cp), again * CPUL * n_attn, True,
        "recomputed attention: Ulysses all-to-all of the output again")
    add("fwd", "cp", "all_gather", "cp", cp, _ag(kv2, cp), CPAG * n_attn, True,
        "all-gather of K,V, shard [b, s/cp, 2 g/tp, d]")
    add("bwd", "cp", "reduce_scatter", "cp", cp, _rs(kv2 * cp, cp), CPAG * n_attn, True,
        "reduce-scatter of dK,dV over the full sequence")
    add("fwd", "cp", "all_to_all", "cp", cp, _a2a(q + kv2, cp), CPUL * n_attn, True,
        "Ulysses all-to-all of q,k,v: sequence shards -> head shards")
    # A cumulative sum along the sequence (mask-derived positions) made global: every rank's two
    # chunk totals, c_cs bytes per sample each (autopar/ops/cp_attention.py cp_cumsum).
    add("fwd", "cp", "all_gather", "cp", cp, _ag(2 * b * ccs, cp), FIRST * ncs, True,
        "all-gather of the chunk totals of each cumulative sum along the sequence, shard [2, b]")
    add("fwd", "cp", "all_to_all", "cp", cp, _a2a(o, cp), CPUL * n_attn, True,
        "Ulysses all-to-all of the attention output: head shards -> sequence shards")
    add("bwd", "cp", "all_to_all", "cp", cp, _a2a(o, cp), CPUL * n_attn, True,
        "Ulysses all-to-all of dO")
    add("bwd", "cp", "all_to_all", "cp", cp, _a2a(q + kv2, cp), CPUL * n_attn, True,
        "Ulysses all-to-all of dq,dk,dv")
    return rows


def _expert_parallel_rows() -> list[RowSpec]:
    """Rows on the ep group: the expected MoE token all-to-alls and the token-count exchange."""
    # Expected routed rows n_out = n_in = (T/tp) k rho (ep-1)/ep
    routed = _a2a((_tokens() / tp) * k * rho, ep)
    rows, add = _row_collector()
    for phase, coll, sent, recv in routed_row_formulas():
        add(phase, "ep", "all_to_all", "ep", ep, sent.subs({N_OUT: routed, N_IN: routed}), le, True,
            TOKEN_ROWS[(phase, coll)], recv=recv.subs({N_OUT: routed, N_IN: routed}), routed=True)
    add("fwd", "ep", "all_to_all", "ep", ep, _a2a(ep * sympy.ceiling(E / ep) * 8, ep), le, True,
        "MoE dispatch: exchange of the int64 token counts per expert")
    return rows


def _pipeline_parallel_rows() -> list[RowSpec]:
    """Rows on the pp group: boundary activation sends / receives and the tied-embedding gradient."""
    boundary = _tokens() * h * w * ((1 - SP) + SP / tp)
    rows, add = _row_collector()
    add("fwd", "pp", "send", "pp", pp, boundary, NSEND, True, "activation to the next stage", recv=0)
    add("fwd", "pp", "recv", "pp", pp, 0, NRECV, True, "activation from the previous stage",
        recv=boundary)
    add("bwd", "pp", "send", "pp", pp, boundary, NRECV, True, "input grad to the previous stage",
        recv=0)
    add("bwd", "pp", "recv", "pp", pp, 0, NSEND, True, "output grad from the next stage",
        recv=boundary)
    add("grad", "pp", "all_reduce", "pp_embed", 2, _ar(Vt * h * wgc, 2),
        TIED * (FIRST + LAST - 2 * FIRST * LAST), False,
        "tied embedding / LM-head gradient between the first and last pp rank")
    return rows


def _data_parallel_rows() -> list[RowSpec]:
    """Rows over the weight replicas: DP gradient all-reduce, ZeRO reduce-scatters and all-gathers."""
    dense, expert, _ = local_param_elems()
    # ZeRO-3 gathers (and reduce-scatters) per unit: one per layer, plus one for the rest of
    # the stage (embedding, final norm, head); rows give the average bytes per call.
    units = zero3_units()
    rows, add = _row_collector()
    # Experts are whole on every TP rank (Megatron-Core's expert-tensor-parallel size 1), so an
    # expert's replicas are the tp * dp*cp/ep ranks of a stage that hold the same expert index.
    # Backward re-gathers every unit but a first pp rank's embedding unit (the lookup's backward
    # reads only the indices).  (An embedding norm's backward reads its weight, so then the unit is
    # re-gathered; so does a tied head on the same stage: its backward reads the table.)
    emb_only = FIRST * (1 - en) * (1 - TIED * LAST)
    # Nor is the head's unit where it is the final norm (and the head's bias) alone, the table being
    # the embedding's, and that norm's backward reads 1 + weight, never the weight (Gemma).
    head_unread = FIRST * LAST * TIED * NOFF * (1 - sympy.Min(Ph, 1, evaluate=False))
    not_regathered = emb_only * (Vt * h + Pe) + head_unread * (h * nn + hb * Vt)
    for label, P, axis, n, u, P_bwd, u_bwd, nb, nu in (
            ("dense", dense, "dp_cp", dp * cp, units, dense - not_regathered, units - emb_only - head_unread,
             NBD, NUD),
            ("expert", expert, "edp", tp * dp * cp / ep, sympy.Max(le, 1, evaluate=False), expert, le, NBE, NUE)):
        # ZeRO stages 0-2 call once per gradient bucket (buckets.py); ZeRO-1/2's units are the buckets,
        # cut at chunk borders under ZeRO-2 with pp (each chunk's gradients are scattered after its
        # backward).  ZeRO-3 reduce-scatters per gather unit.
        zunits = nb + Z2 * (1 - Z3) * (nu - nb)
        per_mb = Z3 * u + (1 - Z3) * zunits  # reduce-scatters per micro-batch (2-3) or per step (1)
        # The step time prices one latency per collective of the step, not per bucket: once per
        # step, per chunk under ZeRO-2 with pp (the calibration, cost/calibration.py, was fitted so).
        held = sympy.Min(nb, 1, evaluate=False)  # 0 where the rank holds no such gradient
        chunks = 1 + Z2 * (1 - Z3) * (vpp - 1)
        add("grad", "dp", "all_reduce", axis, n, _ar(P * wgc, n) / sympy.Max(nb, 1, evaluate=False), (1 - Z1) * nb,
            False, f"all-reduce of the {label} gradients (once per step, one call per bucket)",
            latency=(1 - Z1) * held)
        add("grad", "dp", "reduce_scatter", axis, n, _rs(P * wgc, n) / sympy.Max(per_mb, 1, evaluate=False),
            Z1 * (1 + (m - 1) * Z2) * per_mb,
            False, f"ZeRO reduce-scatter of the {label} gradients (per bucket and step for 1, per bucket and "
                   "micro-batch for 2, per unit and micro-batch for 3)",
            latency=Z1 * (1 + (m - 1) * Z2) * (Z3 * u + (1 - Z3) * chunks * held))
        add("step", "zero", "all_gather", axis, n, _ag(P * wp / n, n) / sympy.Max(zunits, 1, evaluate=False),
            Z1 * (1 - Z3) * zunits, False, f"ZeRO all-gather of the updated {label} parameters (per bucket)",
            latency=Z1 * (1 - Z3) * chunks * held)
        add("fwd", "zero", "all_gather", axis, n, _ag(P * wp / n, n) / u, Z3 * u, True,
            f"ZeRO-3 all-gather of the {label} parameters before use (forward, per unit)")
        add("bwd", "zero", "all_gather", axis, n, _ag(P_bwd * wp / n, n) / u_bwd, Z3 * u_bwd, True,
            f"ZeRO-3 all-gather of the {label} parameters again (backward, per unit)")
    return rows


def _loss_rows() -> list[RowSpec]:
    """Per-step fp32 loss reductions: the mean over dp*cp replicas and the broadcast over pp; the
    load-balancing loss's two statistics (token fractions, mean router probabilities, summed
    over the layers) averaged over each axis that splits the tokens, and the gradient of the
    probabilities in backward (passes/batch_propagation.py, pointwise_rules._on_data_axis)."""
    rows, add = _row_collector()
    for axis, n in (("dp", dp), ("cp", cp)):
        add("fwd", axis, "all_reduce", axis, n, _ar(E * 4, n), 2 * aux, True,
            "average of the load-balancing statistics over the ranks holding other tokens, fp32 [E]")
        add("bwd", axis, "all_reduce", axis, n, _ar(E * 4, n), aux, True,
            "average of the gradient of the mean router probabilities, fp32 [E]")
    add("loss", "dp", "all_reduce", "dp_cp", dp * cp, _ar(4, dp * cp), LAST, False,
        "mean of the fp32 loss over data-parallel replicas")
    add("loss", "pp", "all_reduce", "pp", pp, _ar(4, pp), 1, False,
        "the fp32 loss from the last pp rank to every pipeline rank (the others add 0)")
    return rows
