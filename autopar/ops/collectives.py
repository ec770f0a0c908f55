"""Autograd-correct collectives that the generated programs call, and their byte recorder.

The passes insert calls to the functions in this module as ``call_function`` nodes, so a
generated program reads like ordinary PyTorch: ``all_gather(x, 1, 'tp')``.  Every function
takes a *mesh axis name*; the process group behind it is looked up at run time from the
groups of the active step context (:mod:`autopar.ops.step`), so one graph serves
every rank of a stage and prints without a process group.

Each collective's backward is its dual (docs/architecture.md): all-gather <-> reduce-scatter, the TP
region's entry identity <-> all-reduce, all-reduce <-> identity.  Which dual is right depends on
the gradient's placement (docs/soundness.md): an all-gather whose result feeds sharded work gets
a partial gradient back (reduce-scatter it); one whose result feeds computation replicated on
every rank gets the same full gradient on every rank (keep this rank's slice:
:func:`gather_replicated`).  The collectives are small
``torch.autograd.Function``s around ``torch.distributed`` because the same code must run
under NCCL and gloo and must count the bytes of every call, forward and backward, which
the functional-collective ops do not report.  The groups behind the axis names and the
recorder belong to the active :class:`autopar.ops.step.StepContext`.

Every call appends a :class:`CommRecord` (bytes this rank sends and receives by the ring
convention of docs/architecture.md) to the active :class:`CommRecorder`.

Copy-free slices.  NCCL and gloo gather into, and reduce-scatter out of, a buffer whose ranks'
pieces follow each other in memory.  Along a dim with larger dims in front of it -- sequence
parallelism's sequence dim 1 of ``[batch, seq, hidden]`` at micro-batch 2 and more -- a rank's
piece of the result is not one block but one per slice in front (per sample), so laying the pieces
out needs a copy of the result (or, reduce-scattering, of the input).  Instead the collective runs on the slices in
front (:func:`_sliced`): slice ``p`` of the contiguous input is exactly the rank's piece of slice
``p`` of the contiguous result, so one coalesced call over the slices copies nothing.  Past
:data:`MAX_PARTS` slices (a gather along the last dim of every token), and for the collectives a
backend coalesces slowly (:data:`SLICED_OPS`: gloo's reduce-scatter), the pieces are stacked in front
instead: one copy whose runs are whole rows of the pieces (the result's, gathering; the input's,
reduce-scattering).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.ops.step import AxisGroup, CommRecord, CommRecorder, current, find_current

__all__ = ["AxisGroup", "CommRecord", "CommRecorder", "find_group", "axis_size", "axis_rank", "recorder", "ring_bytes",
           "all_gather", "gather_replicated", "reduce_scatter", "all_reduce", "region_entry", "token_all_reduce",
           "local_shard", "vocab_parallel_embedding", "vocab_parallel_cross_entropy", "record", "loss_all_reduce",
           "record_p2p"]


def _group(axis: str) -> AxisGroup:
    return current().group(axis)


def find_group(axis: str) -> AxisGroup | None:
    """The group installed for ``axis``, or None outside a step or when the plan has none."""
    step = find_current()
    return None if step is None else step.groups.get(axis)


def recorder() -> CommRecorder:
    """The active step's recorder."""
    return current().recorder


def axis_size(axis: str) -> int:
    return _group(axis).size


def axis_rank(axis: str) -> int:
    return _group(axis).rank


def ring_bytes(op: str, nbytes: float, n: int) -> tuple[float, float]:
    """(sent, received) by this rank for one collective, the ring convention of docs/architecture.md.

    ``nbytes`` is the shard for all_gather, the full buffer for reduce_scatter and
    all_reduce, the local buffer for all_to_all (even split).  Point-to-point transfers are
    recorded by :func:`record_p2p` (a send sends its buffer, a recv receives it).
    """
    if op == "all_gather":
        return (n - 1) * nbytes, (n - 1) * nbytes
    if op == "reduce_scatter":
        return (n - 1) * nbytes / n, (n - 1) * nbytes / n
    if op == "all_reduce":
        return 2 * (n - 1) * nbytes / n, 2 * (n - 1) * nbytes / n
    if op == "all_to_all":
        return (n - 1) * nbytes / n, (n - 1) * nbytes / n
    raise ValueError(f"unknown collective {op!r}")


def _phase_tag(phase: str, tag: str) -> tuple[str, str]:
    """A forward collective re-run while backward recomputes a region (autopar/ops/recompute.py)
    is backward traffic: recorded with phase ``bwd``, as the cost model counts it."""
    if phase == "fwd" and current().recomputing:
        return "bwd", f"recomputed: {tag}"
    return phase, tag


def record(op: str, axis: str, t: torch.Tensor, phase: str, tag: str, nbytes: float | None = None) -> None:
    g = _group(axis)
    size = t.numel() * t.element_size() if nbytes is None else nbytes
    sent, recv = ring_bytes(op, size, g.size)
    phase, tag = _phase_tag(phase, tag)
    current().recorder.records.append(
        CommRecord(op, axis, g.size, sent, recv, phase, tuple(t.shape), str(t.dtype).replace("torch.", ""), tag)
    )


def record_p2p(op: str, axis: str, t: torch.Tensor, phase: str, tag: str) -> None:
    """Record one point-to-point transfer: a ``send`` sends the buffer, a ``recv`` receives it."""
    g = _group(axis)
    size = t.numel() * t.element_size()
    sent, recv = (float(size), 0.0) if op == "send" else (0.0, float(size))
    phase, tag = _phase_tag(phase, tag)
    current().recorder.records.append(
        CommRecord(op, axis, g.size, sent, recv, phase, tuple(t.shape), str(t.dtype).replace("torch.", ""), tag)
    )


# Above this many slices in front of the dim, the pieces are stacked (copied) rather than sliced: a
# coalesced call's cost grows with its number of tensors.
MAX_PARTS = 64
# Backend -> the collectives that run sliced on it; a backend not listed slices both.  Measured
# (benchmarks/sp_slices.py, docs/performance.md): NCCL groups the slices' calls into one launch and
# copies nothing; gloo's coalesced all-gather beats moving the dim, but its coalesced
# reduce-scatter pays a fixed cost per slice, twice one call plus the two copies at 8 slices.
SLICED_OPS: dict[str, frozenset] = {"gloo": frozenset({"all_gather"})}
_BOTH = frozenset({"all_gather", "reduce_scatter"})


def _num_parts(x: torch.Tensor, dim: int, op: str, g: AxisGroup) -> int | None:
    """How many slices collective ``op`` along ``dim`` of ``x`` runs on: one per slice in front of
    ``dim`` (1 where the dims in front are all 1), or None where the pieces are stacked instead (past
    :data:`MAX_PARTS` slices, or ``op`` not in the backend's :data:`SLICED_OPS`)."""
    num_slices = max(1, math.prod(x.shape[:dim]))
    if num_slices == 1:
        return 1
    if num_slices > MAX_PARTS or op not in SLICED_OPS.get(dist.get_backend(g.group), _BOTH):
        return None
    return num_slices


def _sliced(op: str, out: torch.Tensor, src: torch.Tensor, parts: int, g: AxisGroup) -> None:
    """All-gather (``op`` "all_gather") into, or reduce-scatter out of, each of the ``parts`` slices of
    contiguous ``out`` from those of ``src``: one collective, coalesced (NCCL groups the slices into
    one launch, gloo into one work item), no copy on either side."""
    group = g.group if g.group is not None else dist.distributed_c10d._get_default_group()
    outs, srcs = list(out.view(parts, -1).unbind(0)), list(src.view(parts, -1).unbind(0))
    single = dist.all_gather_single if op == "all_gather" else dist.reduce_scatter_single
    if parts == 1 or out.device.type == "meta":
        # On meta (the scale simulation's fake group has no meta kernel for the coalesced
        # operators) nothing moves, so one call per slice says the same.
        for o, i in zip(outs, srcs):
            single(o, i, group=group)
    elif op == "all_gather":
        group.allgather_into_tensor_coalesced(outs, srcs).wait()
    else:
        group.reduce_scatter_tensor_coalesced(outs, srcs).wait()


def _gather(x: torch.Tensor, dim: int, axis: str, phase: str, tag: str) -> torch.Tensor:
    g = _group(axis)
    parts = _num_parts(x, dim, "all_gather", g)
    record("all_gather", axis, x, phase, tag)
    if parts is not None:
        shape = list(x.shape)
        shape[dim] *= g.size
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        _sliced("all_gather", out, x.contiguous(), parts, g)
        return out
    # The ranks' pieces stacked in front ([n, *x.shape], gathered with no copy of the input), then
    # laid along ``dim`` by one copy whose runs are whole rows of the pieces (moving ``dim`` to the
    # front and back instead copies twice, element by element when ``dim`` is the last).
    src = x.contiguous()
    stacked = torch.empty((g.size,) + tuple(src.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_single(stacked.flatten(0, 1), src, group=g.group)  # gloo takes the concatenated form
    shape = list(x.shape)
    shape[dim] *= g.size
    return stacked.movedim(0, dim % x.dim()).reshape(shape)  # contiguous: user code may .view() it


def _scatter(x: torch.Tensor, dim: int, axis: str, phase: str, tag: str) -> torch.Tensor:
    g = _group(axis)
    if x.shape[dim] % g.size:
        raise RuntimeError(
            f"autopar: reduce-scatter over '{axis}' needs dim {dim} of shape {tuple(x.shape)} divisible by "
            f"{g.size}; choose a sequence length divisible by the tp degree."
        )
    parts = _num_parts(x, dim, "reduce_scatter", g)
    record("reduce_scatter", axis, x, phase, tag)
    if parts is not None:
        shape = list(x.shape)
        shape[dim] //= g.size
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        _sliced("reduce_scatter", out, x.contiguous(), parts, g)
        return out
    # The input's ``n`` pieces along ``dim`` stacked in front by one copy of whole rows; the rank's
    # reduced piece then comes out laid as the input, with no copy of the result.
    d = dim % x.dim()
    shape = list(x.shape)
    pieces = x.contiguous().view(shape[:d] + [g.size, shape[d] // g.size] + shape[d + 1:])
    src = pieces.movedim(d, 0).contiguous()
    out = torch.empty(src.shape[1:], dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, src.flatten(0, 1), group=g.group)  # gloo takes the concatenated form
    return out


def _reduce(x: torch.Tensor, axis: str, phase: str, tag: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    g = _group(axis)
    record("all_reduce", axis, x, phase, tag)
    out = x.contiguous().clone()
    dist.all_reduce(out, op=op, group=g.group)
    return out


class _GatherScatter(torch.autograd.Function):
    """An all-gather (``gather``) or a reduce-scatter along ``dim``; backward is the other one, its dual."""

    @staticmethod
    def forward(ctx, x, dim, axis, tag, gather):
        ctx.dim, ctx.axis, ctx.tag, ctx.gather = dim, axis, tag, gather
        return (_gather if gather else _scatter)(x, dim, axis, "fwd", tag)

    @staticmethod
    def backward(ctx, grad):
        dual = _scatter if ctx.gather else _gather
        return dual(grad, ctx.dim, ctx.axis, "bwd", ctx.tag), None, None, None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis, tag):
        ctx.dim, ctx.axis = dim, axis
        return _gather(x, dim, axis, "fwd", tag)

    @staticmethod
    def backward(ctx, grad):
        g = _group(ctx.axis)
        return grad.chunk(g.size, dim=ctx.dim)[g.rank].contiguous(), None, None, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, tag):
        return _reduce(x, axis, "fwd", tag)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _RegionEntry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, tag):
        ctx.axis, ctx.tag = axis, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad, ctx.axis, "bwd", ctx.tag), None, None


def all_gather(x: torch.Tensor, dim: int, axis: str, tag: str = "", regather: bool = False) -> torch.Tensor:
    """Concatenate the shards of ``x`` along ``dim`` over ``axis``; backward reduce-scatters.

    ``regather`` (sequence parallelism's gathers): where backward needs the result (a GEMM's
    saved input), keep ``x`` instead and all-gather it again then (:mod:`autopar.ops.regather`)."""
    out = _GatherScatter.apply(x, dim, axis, tag, True)
    if regather and out.requires_grad:
        step = current()
        if step.regather is not None and not step.recomputing:
            step.regather.register(out, x, dim, axis, tag)
    return out


def gather_again(x: torch.Tensor, dim: int, axis: str, tag: str) -> torch.Tensor:
    """The backward re-gather of an SP all-gather's shard (recorded as a ``bwd`` all-gather)."""
    return _gather(x, dim, axis, "bwd", tag)


def gather_replicated(x: torch.Tensor, dim: int, axis: str, tag: str = "") -> torch.Tensor:
    """Concatenate the shards of ``x`` along ``dim`` over ``axis`` for computation that every rank
    then repeats identically; backward keeps this rank's slice of the (replicated) gradient,
    with no communication (an all-gather's reduce-scatter would sum ``axis``-size copies)."""
    return _GatherReplicated.apply(x, dim, axis, tag)


def reduce_scatter(x: torch.Tensor, dim: int, axis: str, tag: str = "") -> torch.Tensor:
    """Sum partial ``x`` over ``axis`` and keep this rank's shard of ``dim``; backward all-gathers."""
    return _GatherScatter.apply(x, dim, axis, tag, False)


def all_reduce(x: torch.Tensor, axis: str, tag: str = "") -> torch.Tensor:
    """Sum partial ``x`` over ``axis``; backward is the identity."""
    return _AllReduce.apply(x, axis, tag)


def loss_all_reduce(x: torch.Tensor, axis: str, tag: str) -> torch.Tensor:
    """Sum a detached scalar (the step's loss) over ``axis``, recorded with phase ``loss``."""
    return _reduce(x.detach(), axis, "loss", tag)


def region_entry(x: torch.Tensor, axis: str, tag: str = "") -> torch.Tensor:
    """Identity into a tensor-parallel region; backward all-reduces the input gradient."""
    return _RegionEntry.apply(x, axis, tag)


class _TokenAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, op, tag):
        ctx.axis, ctx.op, ctx.tag = axis, op, tag
        return _token_reduce(x, axis, op, "fwd", tag)

    @staticmethod
    def backward(ctx, grad):
        return _token_reduce(grad, ctx.axis, ctx.op, "bwd", ctx.tag), None, None, None


def _token_reduce(x: torch.Tensor, axis: str, op: str, phase: str, tag: str) -> torch.Tensor:
    out = _reduce(x, axis, phase, tag)
    return out / _group(axis).size if op == "avg" else out  # gloo has no ReduceOp.AVG


def token_all_reduce(x: torch.Tensor, axis: str, op: str, tag: str = "") -> torch.Tensor:
    """Sum (``op="sum"``) or average (``"avg"``) a statistic of this rank's tokens over a
    data-sharded ``axis`` (dp, cp), so every rank holds the whole batch's value; backward is the
    same all-reduce.  That is the exact adjoint because gradients are averaged over the axis:
    the batch's objective is the mean of the ranks' losses, each of which uses the reduced value
    (docs/soundness.md, "Statistics over the batch")."""
    return _TokenAllReduce.apply(x, axis, op, tag)


class _LocalShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, axis):
        g = _group(axis)
        ctx.dim, ctx.size, ctx.rank, ctx.full = dim, g.size, g.rank, x.shape[dim]
        return x.chunk(g.size, dim=dim)[g.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        # The other ranks' slices get zeros here: the replicated input's gradient is a
        # partial sum over the axis (shard propagation marks it so; gradient sync sums it).
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        out = grad.new_zeros(shape)
        out.narrow(ctx.dim, ctx.rank * grad.shape[ctx.dim], grad.shape[ctx.dim]).copy_(grad)
        return out, None, None


def local_shard(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """This rank's slice of a replicated ``x`` along ``dim`` (no communication)."""
    return _LocalShard.apply(x, dim, axis)


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, axis: str, padding_idx: int = -1) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows of a vocabulary-sharded table; a partial sum over ``axis``.

    Rows this rank does not own contribute zeros; the caller all-reduces (or
    reduce-scatters, under SP) the result.
    """
    num_local = weight.shape[0]
    start = axis_rank(axis) * num_local
    outside = (ids < start) | (ids >= start + num_local)
    local_ids = (ids - start).masked_fill(outside, 0)
    local_pad = padding_idx - start if 0 <= padding_idx - start < num_local else None
    out = F.embedding(local_ids, weight, padding_idx=local_pad)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis, ignore_index, reduction, tag, vocab=None):
        num_local = logits.shape[-1]
        start = axis_rank(axis) * num_local
        x = logits.float()
        if vocab is not None and start + num_local > vocab:  # padded vocabulary: no probability on the padding
            x = x.masked_fill(torch.arange(start, start + num_local, device=x.device) >= vocab, float("-inf"))
        local_max = x.amax(dim=-1)
        global_max = _reduce(local_max, axis, "fwd", tag + " (max)", op=dist.ReduceOp.MAX)
        # One fp32 logits-sized tensor besides the logits: x - max, then its exp, in place (on x itself
        # where x is a copy of ours: bf16 logits upcast, or the padding masked).
        shifted = x.sub_(global_max.unsqueeze(-1)) if x is not logits else x - global_max.unsqueeze(-1)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < start + num_local)
        local_target = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp_()
        sum_exp = _reduce(exp.sum(dim=-1), axis, "fwd", tag + " (sum exp)")
        picked = _reduce(picked, axis, "fwd", tag + " (target logit)")
        per_token = (sum_exp.log() - picked) * valid
        num_valid = valid.sum()
        ctx.save_for_backward(exp, sum_exp, local_target, mine, valid, num_valid)
        ctx.reduction, ctx.in_dtype = reduction, logits.dtype
        if reduction == 0:
            return per_token.to(logits.dtype)
        total = per_token.sum()
        return (total / num_valid if reduction == 1 else total).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        # One logits-sized tensor: the softmax, made the gradient in place (the one-hot of this
        # rank's targets subtracted, ignored tokens and the loss's scale multiplied in), the same
        # operations in the same order as softmax - onehot, * valid, * scale, without their copies.
        exp, sum_exp, local_target, mine, valid, num_valid = ctx.saved_tensors
        g = exp / sum_exp.unsqueeze(-1)
        g.scatter_add_(-1, local_target.unsqueeze(-1), mine.unsqueeze(-1).to(g.dtype).neg())
        g.mul_(valid.unsqueeze(-1))
        if ctx.reduction == 0:
            g.mul_(grad.float().unsqueeze(-1))
        elif ctx.reduction == 1:
            g.mul_(grad.float() / num_valid)
        else:
            g.mul_(grad.float())
        return g.to(ctx.in_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    axis: str,
    ignore_index: int = -100,
    reduction: int = 1,
    tag: str = "",
    vocab: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of vocabulary-sharded logits, without gathering them.

    ``reduction`` follows aten: 0 none, 1 mean (over non-ignored targets), 2 sum.  Three
    all-reduces of one fp32 value per token (max, sum of exp, target logit) run forward;
    backward needs no communication.  ``vocab``: the real vocabulary size where tp does not divide it
    (the logits' last shards are padding columns, left out of the softmax: -inf).
    """
    return _VocabParallelCrossEntropy.apply(logits, target, axis, ignore_index, reduction, tag, vocab)
