"""Context-parallel attention: the functions the CP pass puts in place of each attention op.

The sequence is sharded over the ``cp`` mesh axis with causal load balancing: the global
sequence is cut into ``2*cp`` chunks and rank ``i`` holds chunks ``i`` and ``2*cp-1-i``
(:func:`cp_positions`; :mod:`autopar.runtime.stepping.batching` slices the batch the same way).  Every
variant computes attention block by block over pairs (query chunk, key chunk) and skips
the pairs the causal mask hides entirely (and, under a sliding window, those out of every query's
window), so the work per rank is balanced
(the step counter ``cp_score_blocks`` counts the computed pairs).  Causality comes from *global* positions,
never from the local order, so gathered K/V need not be reordered.

Variants (``passes/context_parallel.py`` picks one per plan):

- :func:`ring_attention`: K,V travel around the ring by P2P (async isend/irecv overlapped
  with the block computation), merged with an online softmax (log-sum-exp).  The explicit
  backward uses the saved log-sum-exp and circulates the dK,dV accumulators with K,V.
- :func:`allgather_attention`: all-gather of packed K,V, local queries against the full
  K,V; the all-gather's backward reduce-scatters dK,dV (:mod:`autopar.ops.collectives`).
- :func:`ulysses_attention`: one all-to-all of packed q,k,v from sequence shards to head
  shards, full-sequence attention on ``heads/cp`` heads, one all-to-all back.

Besides attention, :func:`cp_cumsum` puts a cumulative sum along the sequence (positions that
a model derives from its attention mask) in global token order, and :func:`cp_gather_sequence`
gathers a value's whole sequence in global order (eager attention run whole).

K and V arrive with their own (GQA) head count; ``num_kv_groups`` query heads share one
K/V head, and the expansion happens after communication, so only the K/V heads travel.
Every collective records its bytes through :mod:`autopar.ops.collectives`.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.ops import collectives
from autopar.plan import ulysses_heads_ok
from autopar.ops.step import find_current

__all__ = [
    "cp_chunk_indices",
    "cp_table_rows",
    "cp_positions",
    "cp_cumsum",
    "cp_gather_sequence",
    "ring_attention",
    "allgather_attention",
    "ulysses_attention",
    "SCORE_BLOCKS",
]

SCORE_BLOCKS = "cp_score_blocks"  # the step counter of attention score blocks computed forward


def _count_block() -> None:
    step = find_current()  # the kernels also run outside a step (tests compare them with sdpa)
    if step is not None:
        step.counters[SCORE_BLOCKS] += 1


def cp_chunk_indices(seq_len: int, rank: int, size: int) -> torch.Tensor:
    """Global token indices held by ``rank`` of ``size``: chunks ``rank`` and ``2*size-1-rank``."""
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk)
    return torch.cat([first, second])


def _positions(local_len: int, rank: int, size: int, device=None) -> torch.Tensor:
    return cp_chunk_indices(local_len * size, rank, size).to(device)


def cp_positions(local_len: int, axis: str, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """This rank's global position ids (replaces ``arange(local_len)`` in the graph)."""
    pos = _positions(int(local_len), collectives.axis_rank(axis), collectives.axis_size(axis), device)
    return pos.to(dtype or torch.int64)


def cp_table_rows(table: torch.Tensor, dim: int, local_len: int, axis: str) -> torch.Tensor:
    """``table`` at this rank's global positions along ``dim`` (replaces ``table[..., :seq]``, a
    learned or registered position table sliced to the sequence length: BERT's ``position_ids``)."""
    positions = _positions(int(local_len), collectives.axis_rank(axis), collectives.axis_size(axis), table.device)
    return table.index_select(dim, positions)


def cp_gather_sequence(x: torch.Tensor, dim: int, axis: str, tag: str = "") -> torch.Tensor:
    """The whole sequence of ``x`` along ``dim``, in global order: this rank's chunks all-gathered
    over ``axis`` and put at their positions (eager attention run whole, ``passes/cp_cores.py``).
    Backward: the gradient at each rank's positions, summed over the ranks (a reduce-scatter)."""
    n, local_len = collectives.axis_size(axis), x.shape[dim]
    gathered = collectives.all_gather(x.contiguous(), dim, axis, tag)
    held = torch.cat([_positions(local_len, r, n) for r in range(n)])  # the gathered rows' positions
    return gathered.index_select(dim, torch.argsort(held).to(x.device))


def cp_cumsum(x: torch.Tensor, dim: int, axis: str, dtype: torch.dtype | None = None, tag: str = "") -> torch.Tensor:
    """``torch.cumsum(x, dim)`` of the global sequence, on this rank's two chunks along ``dim``.

    Each chunk's cumulative sum is offset by the total of every chunk before it in global
    order; the chunk totals (one slice each, the sequence dim summed away) are all-gathered.
    Autograd-correct: the all-gather's backward reduce-scatters the offsets' gradients."""
    n, r = collectives.axis_size(axis), collectives.axis_rank(axis)
    if dtype is not None:
        x = x.to(dtype)
    elif not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.int64)  # torch.cumsum's promotion of integral and bool inputs
    first, second = x.chunk(2, dim=dim)  # global chunks r and 2n-1-r
    totals = torch.stack([first.sum(dim), second.sum(dim)])
    gathered = collectives.all_gather(totals, 0, axis, tag or "cp cumsum chunk totals")  # rank j: chunks j, 2n-1-j
    order = [2 * c if c < n else 2 * (2 * n - 1 - c) + 1 for c in range(2 * n)]
    ordered = gathered[torch.tensor(order, device=x.device)]
    before = torch.cat([torch.zeros_like(ordered[:1]), ordered.cumsum(0)[:-1]])  # exclusive prefix
    return torch.cat([first.cumsum(dim) + before[r].unsqueeze(dim),
                      second.cumsum(dim) + before[2 * n - 1 - r].unsqueeze(dim)], dim=dim)


# --- blockwise attention with a log-sum-exp merge (no communication) ---------------------


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax statistics in at least fp32 (bf16/fp16 inputs), in fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.view(b, h // groups, groups, s, d).sum(2)


def _allowed(qp, kp, window):
    """Causal (a key at or before its query), within ``window`` keys of it when a window is given."""
    allowed = qp[:, None] >= kp[None, :]
    return allowed if window is None else allowed & (qp[:, None] - kp[None, :] < window)


def _pairs(q_pos, k_pos, chunk, causal, window=None, device=None):
    """(query slice, key slice, mask or None) for every chunk pair not hidden by the mask: causal,
    and with ``window`` (a sliding window, causal only) each query sees its last ``window`` keys.

    The positions are host tensors (:func:`_positions` without a device): which blocks run is
    decided on the host, with no device synchronisation and on the meta device too (the scale
    simulation, whose tensors have no values); a partial block's mask is made on ``device``."""
    out = []
    for i in range(q_pos.numel() // chunk):
        qs = slice(i * chunk, (i + 1) * chunk)
        for j in range(k_pos.numel() // chunk):
            ks = slice(j * chunk, (j + 1) * chunk)
            if not causal:
                out.append((qs, ks, None))
                continue
            qp, kp = q_pos[qs], k_pos[ks]
            q_lo, q_hi, k_lo, k_hi = int(qp.min()), int(qp.max()), int(kp.min()), int(kp.max())
            if q_hi < k_lo or (window is not None and q_lo - k_hi >= window):
                continue  # every key lies after every query, or out of every query's window: skipped
            whole = q_lo >= k_hi and (window is None or q_hi - k_lo < window)
            out.append((qs, ks, None if whole else _allowed(qp.to(device), kp.to(device), window)))
    return out


def _sdpa_layout(bshd: torch.Tensor) -> torch.Tensor:
    """``[b, s, heads, d]`` memory seen as ``[b, heads, s, d]``: the layout SDPA's fused kernels give
    their output, which models rely on (``out.transpose(1, 2).view(b, s, -1)``, AFMoE's attention)."""
    return bshd.transpose(1, 2)


def _attend(q, k, v, q_pos, k_pos, scale, causal, groups, chunk, out=None, lse=None, window=None):
    """Merge attention of ``q`` over (``k``, ``v``) into ``(out, lse)``; returns them."""
    if out is None:
        b, heads, s_q, _ = q.shape  # V's head dim below (MLA's is narrower than K's)
        out = _sdpa_layout(q.new_zeros(b, s_q, heads, v.shape[-1]))
        lse = torch.full(q.shape[:-1], -math.inf, dtype=_acc(q), device=q.device)
    k, v = _expand(k, groups), _expand(v, groups)
    for qs, ks, mask in _pairs(q_pos, k_pos, chunk, causal, window, q.device):
        _count_block()
        # One score block at a time, updated in place (the same operations as out of place).
        s = (q[:, :, qs] @ k[:, :, ks].transpose(-1, -2)).to(_acc(q)).mul_(scale)
        if mask is not None:
            s.masked_fill_(~mask, -math.inf)
        blk_lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)
        blk_out = s.sub_(safe[..., None]).exp_().to(q.dtype) @ v[:, :, ks]
        del s
        old = lse[:, :, qs]
        new = torch.logaddexp(old, blk_lse)
        new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        w_old = (old - new_safe).exp()[..., None].to(q.dtype)
        w_blk = (blk_lse - new_safe).exp()[..., None].to(q.dtype)
        out[:, :, qs] = out[:, :, qs] * w_old + blk_out * w_blk
        lse[:, :, qs] = new
    return out, lse


def _attend_backward(q, k, v, out, dout, lse, q_pos, k_pos, scale, causal, groups, chunk,
                     dq=None, delta=None, window=None):
    """Gradients of the final attention output restricted to this (k, v) block, from the saved lse.

    Returns ``(dq, dk, dv)``; ``dq`` accumulates in place when given.
    """
    if dq is None:
        dq = torch.zeros_like(q)
    if delta is None:
        delta = (dout.to(_acc(q)) * out.to(_acc(q))).sum(-1)
    ke, ve = _expand(k, groups), _expand(v, groups)
    dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
    for qs, ks, mask in _pairs(q_pos, k_pos, chunk, causal, window, q.device):
        # Two score-sized blocks alive: the probabilities and dP, each made in place from its
        # product (the same operations as out of place: p * (dp - delta) * scale, commuted).
        p = (q[:, :, qs] @ ke[:, :, ks].transpose(-1, -2)).to(_acc(q)).mul_(scale)
        p.sub_(lse[:, :, qs][..., None]).exp_()
        if mask is not None:
            p.masked_fill_(~mask, 0.0)
        do = dout[:, :, qs]
        dv[:, :, ks] += p.to(q.dtype).transpose(-1, -2) @ do
        dp = (do @ ve[:, :, ks].transpose(-1, -2)).to(_acc(q))
        ds = dp.sub_(delta[:, :, qs][..., None]).mul_(p).mul_(scale).to(q.dtype)
        del p, dp
        dq[:, :, qs] += ds @ ke[:, :, ks]
        dk[:, :, ks] += ds.transpose(-1, -2) @ q[:, :, qs]
        del ds
    return dq, _fold(dk, groups), _fold(dv, groups)


class _LocalAttention(torch.autograd.Function):
    """Blockwise attention of local queries over given K,V with explicit positions."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, scale, causal, groups, chunk, window=None):
        out, lse = _attend(q, k, v, q_pos, k_pos, scale, causal, groups, chunk, window=window)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.args = (scale, causal, groups, chunk)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        dq, dk, dv = _attend_backward(q, k, v, out, dout.contiguous(), lse, q_pos, k_pos, *ctx.args,
                                      window=ctx.window)
        return dq, dk, dv, None, None, None, None, None, None, None


def _scale(q, scale):
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


# --- all-gather -----------------------------------------------------------------------


def allgather_attention(q, k, v, axis: str, scale=None, causal: bool = True, num_kv_groups: int = 1,
                        tag: str = "", window: int | None = None) -> torch.Tensor:
    """All-gather packed K,V over ``axis``; local queries against the full K,V (``window``: each
    query sees its last ``window`` keys, a causal sliding window)."""
    n, r = collectives.axis_size(axis), collectives.axis_rank(axis)
    local = q.shape[2]
    d_k = k.shape[-1]  # K and V packed along the head dim, which may differ (DeepSeek's MLA)
    kv = collectives.all_gather(torch.cat([k, v], dim=-1), 2, axis, tag or "cp all-gather K,V")
    k_full, v_full = kv[..., :d_k], kv[..., d_k:]
    q_pos = _positions(local, r, n)  # on the host: the blocks to run are decided there (_pairs)
    k_pos = torch.cat([_positions(local, j, n) for j in range(n)])
    return _LocalAttention.apply(q, k_full, v_full, q_pos, k_pos, _scale(q, scale), causal, num_kv_groups,
                                 max(1, local // 2), window)


# --- Ulysses ----------------------------------------------------------------------------


def _a2a(buf: torch.Tensor, axis: str, phase: str, tag: str) -> torch.Tensor:
    """All-to-all over dim 0 (one slice per rank of ``axis``)."""
    g = collectives._group(axis)
    buf = buf.contiguous()
    collectives.record("all_to_all", axis, buf, phase, tag)
    out = torch.empty_like(buf, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, buf, group=g.group)
    return out


def _unpack(got, shapes):
    """Split a packed all-to-all result ``[n, B, sum(numel_i)]`` into ``[n, B, *shape_i]`` parts."""
    sizes = [math.prod(shape) for shape in shapes]
    return [x.reshape(*got.shape[:2], *shape) for x, shape in zip(got.split(sizes, dim=2), shapes)]


def _seq_to_heads(parts, n, axis, phase, tag):
    """[B, H_i, S_l, d_i] per part -> [B, H_i/n, n*S_l, d_i] per part (one packed all-to-all;
    the parts may differ in head dim: DeepSeek's MLA has a wider K than V)."""
    b, _, s_l, _ = parts[0].shape
    shapes = [(p.shape[1] // n, s_l, p.shape[-1]) for p in parts]
    buf = torch.cat([p.reshape(b, n, -1) for p in parts], dim=2)
    got = _a2a(buf.movedim(1, 0), axis, phase, tag)  # [n (source), B, packed heads of every part]
    return [x.movedim(0, 2).reshape(b, h, n * s_l, d) for x, (h, _, d) in zip(_unpack(got, shapes), shapes)]


def _heads_to_seq(parts, n, axis, phase, tag):
    """Inverse of :func:`_seq_to_heads`: [B, h_i, n*S_l, d_i] -> [B, n*h_i, S_l, d_i]."""
    b, _, s, _ = parts[0].shape
    s_l = s // n
    shapes = [(p.shape[1], s_l, p.shape[-1]) for p in parts]
    buf = torch.cat([p.reshape(b, h, n, s_l, d).movedim(2, 0).reshape(n, b, -1)
                     for p, (h, _, d) in zip(parts, shapes)], dim=2)
    got = _a2a(buf, axis, phase, tag)  # [n (head group), B, packed sequence chunks of every part]
    return [x.movedim(0, 1).reshape(b, n * h, s_l, d) for x, (h, _, d) in zip(_unpack(got, shapes), shapes)]


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis, tag):
        ctx.axis, ctx.tag, ctx.n = axis, tag, collectives.axis_size(axis)
        return tuple(_seq_to_heads([q, k, v], ctx.n, axis, "fwd", tag))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        return (*_heads_to_seq([dq, dk, dv], ctx.n, ctx.axis, "bwd", ctx.tag), None, None)


class _ToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, axis, tag):
        ctx.axis, ctx.tag, ctx.n = axis, tag, collectives.axis_size(axis)
        return _heads_to_seq([o], ctx.n, axis, "fwd", tag)[0]

    @staticmethod
    def backward(ctx, do):
        return _seq_to_heads([do], ctx.n, ctx.axis, "bwd", ctx.tag)[0], None, None


def ulysses_attention(q, k, v, axis: str, scale=None, causal: bool = True, num_kv_groups: int = 1,
                      tag: str = "", window: int | None = None) -> torch.Tensor:
    """All-to-all sequence shards -> head shards, full-sequence attention (``window``: a causal
    sliding window), and back."""
    n = collectives.axis_size(axis)
    local = q.shape[2]
    for name, t in (("query", q), ("key/value", k)):
        if not ulysses_heads_ok(t.shape[1], 1, n):  # heads here are already local to a tp rank
            raise RuntimeError(f"autopar: Ulysses needs the {t.shape[1]} local {name} heads divisible by "
                               f"cp={n}; choose a cp degree that divides the heads per tp rank.")
    qh, kh, vh = _ToHeads.apply(q, k, v, axis, tag or "cp Ulysses q,k,v")
    pos = torch.cat([_positions(local, j, n) for j in range(n)])  # on the host (_pairs)
    oh = _LocalAttention.apply(qh, kh, vh, pos, pos, _scale(q, scale), causal, num_kv_groups, max(1, local // 2),
                               window)
    o = _ToSeq.apply(oh, axis, tag or "cp Ulysses output")
    return _sdpa_layout(o.transpose(1, 2).contiguous())  # the all-to-all's result is head-major


# --- ring -------------------------------------------------------------------------------


class _Exchange:
    """One ring hop: async send to the next rank and receive from the previous one."""

    def __init__(self, t: torch.Tensor, axis: str, phase: str, tag: str, channel: int = 0):
        g = collectives._group(axis)
        nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
        self.buf = torch.empty_like(t, memory_format=torch.contiguous_format)
        collectives.record_p2p("send", axis, t, phase, tag)
        collectives.record_p2p("recv", axis, self.buf, phase, tag)
        send = t.contiguous()
        self._keep = send
        # K,V and dK,dV hops between the same pair of ranks use distinct tags (channel).
        self.works = [dist.isend(send, dist.get_global_rank(g.group, nxt), group=g.group, tag=channel),
                      dist.irecv(self.buf, dist.get_global_rank(g.group, prv), group=g.group, tag=channel)]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.buf


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, axis, scale, causal, groups, tag, window=None):
        n, r = collectives.axis_size(axis), collectives.axis_rank(axis)
        local = q.shape[2]
        chunk = max(1, local // 2)
        d_k = k.shape[-1]  # K and V packed along the head dim (MLA's differ)
        q_pos = _positions(local, r, n)  # on the host (_pairs)
        kv = torch.cat([k, v], dim=-1).contiguous()
        out = lse = None
        for step in range(n):
            hop = _Exchange(kv, axis, "fwd", tag) if step < n - 1 else None  # overlaps the block below
            src = (r - step) % n
            out, lse = _attend(q, kv[..., :d_k], kv[..., d_k:], q_pos, _positions(local, src, n),
                               scale, causal, groups, chunk, out, lse, window)
            if hop is not None:
                kv = hop.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (axis, scale, causal, groups, tag)
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx, dout):
        # Rank r handles block (r-1-t) at step t, so each dK,dV accumulator starts one rank after
        # its home and ends there after cp-1 hops; K,V hop cp-1 times alongside (the last block is local).
        q, k, v, out, lse = ctx.saved_tensors
        axis, scale, causal, groups, tag = ctx.args
        n, r = collectives.axis_size(axis), collectives.axis_rank(axis)
        local = q.shape[2]
        chunk = max(1, local // 2)
        d_k = k.shape[-1]
        dout = dout.contiguous()
        q_pos = _positions(local, r, n)
        delta = (dout.to(_acc(q)) * out.to(_acc(q))).sum(-1)
        dq = torch.zeros_like(q)
        kv_local = torch.cat([k, v], dim=-1).contiguous()
        kv = _Exchange(kv_local, axis, "bwd", tag).wait() if n > 1 else kv_local
        dkv = None
        for step in range(n):
            src = (r - 1 - step) % n
            if step == n - 1:
                kv = kv_local
            hop = _Exchange(kv, axis, "bwd", tag) if step < n - 2 else None
            _, dk, dv = _attend_backward(q, kv[..., :d_k], kv[..., d_k:], out, dout, lse, q_pos,
                                         _positions(local, src, n), scale, causal, groups, chunk,
                                         dq=dq, delta=delta, window=ctx.window)
            blk = torch.cat([dk, dv], dim=-1)
            dkv = blk if dkv is None else dkv + blk
            if step < n - 1:
                dkv = _Exchange(dkv, axis, "bwd", tag, channel=1).wait()
            if hop is not None:
                kv = hop.wait()
        return dq, dkv[..., :d_k], dkv[..., d_k:], None, None, None, None, None, None


def ring_attention(q, k, v, axis: str, scale=None, causal: bool = True, num_kv_groups: int = 1,
                   tag: str = "", window: int | None = None) -> torch.Tensor:
    """Ring attention over ``axis``: K,V rotate by P2P, online-softmax merge, explicit backward
    (``window``: a causal sliding window; blocks out of every query's window are skipped)."""
    return _RingAttention.apply(q, k, v, axis, _scale(q, scale), causal, num_kv_groups,
                                tag or "cp ring K,V / dK,dV", window)
