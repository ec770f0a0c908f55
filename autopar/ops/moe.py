"""Expert-parallel MoE at run time: token dispatch, the local experts, and combine.

The EP pass (``passes/expert_parallel.py``) replaces each recognised experts region
(:mod:`autopar.frontend.analyze_moe`) by three calls that the generated program makes:

- ``moe_dispatch(x, idx, num_experts, 'ep')``: sort the (token, slot) pairs by expert,
  exchange the per-expert token counts with an all-to-all, then all-to-all the token rows
  (uneven split sizes) to the ranks that own their experts, grouped by local expert;
- ``moe_experts(rows, routing, bodies, params, style)``: run the user's own expert code
  (cut out of the traced graph) on the rows of each local expert;
- ``moe_combine(out, w, routing, 'ep')``: the reverse all-to-all, then the weighted sum
  over the top-k slots in the original token order.

The token all-to-alls are autograd functions whose backward is the reverse all-to-all
(the duals of docs/architecture.md).  Without an ``ep`` group (ep=1) the same code runs locally.  Every
all-to-all is recorded with the realised per-expert counts (``CommRecord.counts``), from
which the cost model predicts its bytes exactly (``autopar.cost.comm.routed_all_to_all_rows``).

Experts are stored with rank ``r`` of the ``ep`` axis owning experts ``[r n, (r + 1) n)``,
``n = ceil(E / ep)`` (:func:`autopar.plan_space.local_experts`): stacked ``[E, ...]`` parameters are
sharded along dim 0 (where ep does not divide E, zero-padded to ``n * ep`` rows: the padding experts
get no rows), a ModuleList expert's parameters live whole on their owner (``ParamShard.owner``).

On the meta device (the scale simulation of ``benchmarks/scale_simulation.py``) routing has
no values: dispatch then routes every rank's pairs evenly over the experts
(:func:`balanced_counts`), and the records carry those counts.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.plan_space import local_experts

__all__ = ["Routing", "capacity_keep", "checked_expert_ids", "moe_dispatch", "moe_experts", "moe_combine"]


@dataclasses.dataclass
class Routing:
    """What dispatch learned; combine and both backwards reuse it (no tensors need grads)."""

    order: torch.Tensor  # the kept (token, slot) pairs, sorted by expert
    num_tokens: int
    top_k: int
    local_counts: list[int]  # rows per local expert after regrouping
    send_splits: list[int] | None = None  # rows to each ep rank
    recv_splits: list[int] | None = None  # rows from each ep rank
    regroup: torch.Tensor | None = None  # received rows (source-major) -> local-expert-major
    counts: tuple | None = None  # (sent per expert [E], received [ep][E/ep]) for the recorder


def _ep_group(axis: str):
    g = collectives.find_group(axis)
    return g if g is not None and g.size > 1 else None


def _record_a2a(axis: str, t: torch.Tensor, send: list[int], recv: list[int], phase: str, tag: str,
                counts: tuple | None) -> None:
    g = collectives.find_group(axis)
    row = math.prod(t.shape[1:]) * t.element_size()  # one row; t may have none
    mine = g.rank
    sent = float(row * (sum(send) - send[mine]))
    received = float(row * (sum(recv) - recv[mine]))
    collectives.recorder().records.append(collectives.CommRecord(
        "all_to_all", axis, g.size, sent, received, phase, tuple(t.shape), str(t.dtype).replace("torch.", ""), tag, counts))


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], axis: str, phase: str, tag: str,
                counts: tuple | None) -> torch.Tensor:
    g = collectives.find_group(axis)
    _record_a2a(axis, x, send, recv, phase, tag, counts)
    x = x.contiguous()
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=g.group)
    return out


class _TokenAllToAll(torch.autograd.Function):
    """Rows to their destination ranks; backward sends the row gradients back (the dual)."""

    @staticmethod
    def forward(ctx, x, send, recv, axis, tag, counts):
        ctx.send, ctx.recv, ctx.axis, ctx.tag, ctx.counts = send, recv, axis, tag, counts
        return _all_to_all(x, send, recv, axis, "fwd", tag, counts)

    @staticmethod
    def backward(ctx, grad):
        return (_all_to_all(grad, ctx.recv, ctx.send, ctx.axis, "bwd", ctx.tag + " (backward)", ctx.counts),
                None, None, None, None, None)


def capacity_keep(sorted_experts: torch.Tensor, counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Mask of the pairs (sorted by expert, then token order) within their expert's capacity."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(sorted_experts.numel(), device=counts.device) - starts[sorted_experts]
    return position < capacity


def _check_expert_ids(ids: torch.Tensor, num_experts: int, who: str, advice: str) -> None:
    """Refuse (an ``autopar:`` error) any id of ``ids`` outside ``[0, num_experts - 1]``."""
    if ids.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(ids.reshape(-1))).tolist()
    if lo < 0 or hi >= num_experts:
        raise AutoparError(f"autopar: {who} met expert id {lo if lo < 0 else hi} but the block has "
                           f"{num_experts} experts; the expert ids the block sorts by must lie in "
                           f"[0, {num_experts - 1}]. {advice}")


def checked_expert_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``ids`` itself, once every id lies in ``[0, num_experts - 1]``; an ``autopar:`` error otherwise.

    Inserted by ``passes/expert_parallel.py`` where an MoE block's experts run as traced on the
    rank's tokens and the graph does not bound the ids they sort by (hash routing: a table lookup,
    ``tid2eid[input_ids]``, whose buffer is loaded with the checkpoint).  The checked ids are then
    proven in range (``passes/token_order.py``: ``key_range``), which the counts of the experts' rows
    need: an id below 0 would shift every expert's rows by a count of this rank's tokens.  Every
    rank checks its own tokens, so the ranks pass together exactly when one device's ids would.
    Nothing is checked on the meta device (the scale simulation routes without values)."""
    if ids.is_meta or isinstance(ids, FakeTensor):
        return ids
    _check_expert_ids(ids, num_experts, "MoE routing",
                      "The graph does not bound these ids (a hash router's table of expert ids, loaded "
                      "with the checkpoint), so every forward checks them; load a table whose values are "
                      "expert ids.")
    return ids


def moe_dispatch(x: torch.Tensor, idx: torch.Tensor, num_experts: int, axis: str,
                 capacity_factor: float | None = None) -> tuple:
    """Token rows for this rank's experts, grouped by local expert, and the :class:`Routing`.

    With ``capacity_factor`` F each expert takes at most ``ceil(F * T * k / E)`` of this rank's
    T tokens (earlier tokens first); the others are dropped: their expert output is zero and
    the token continues on the residual stream only (a semantic change; default dropless).
    """
    num_tokens, top_k = idx.shape
    if x.is_meta:
        return _balanced_dispatch(x, idx, num_experts, axis, capacity_factor)
    flat = idx.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    # ids a block computed (LongCat's fold) or read from a table (hash routing) outside its experts
    advice = "Use a plan with ep=1 and tp=1 for this model, or (ids read from a table) load a table of expert ids."
    try:
        counts = torch.bincount(flat, minlength=num_experts)
    except RuntimeError:  # bincount refuses a negative id
        _check_expert_ids(flat, num_experts, "MoE dispatch", advice)
        raise
    if counts.numel() != num_experts:
        _check_expert_ids(flat, num_experts, "MoE dispatch", advice)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * num_tokens * top_k / num_experts)
        keep = capacity_keep(sorted_experts, counts, capacity)
        order, counts = order[keep], counts.clamp(max=capacity)
    rows = x[order // top_k]
    g = _ep_group(axis)
    if g is None:
        return rows, Routing(order, num_tokens, top_k, counts.tolist())
    ep, num_local = g.size, local_experts(num_experts, g.size)
    send_counts = torch.nn.functional.pad(counts, (0, ep * num_local - num_experts)).view(ep, num_local)
    recv_counts = _all_to_all(send_counts, [1] * ep, [1] * ep, axis, "fwd",
                              "MoE dispatch: token counts per expert", None)
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    table = recv_counts.tolist()  # [source rank][local expert]
    info = (tuple(send_counts.reshape(-1).tolist()), tuple(tuple(r) for r in table))  # padded to ep * n
    tokens = _TokenAllToAll.apply(rows, send_splits, recv_splits, axis, "MoE dispatch: tokens to expert owners",
                                  info)
    # Received rows come source-major; a stable sort by local expert makes them expert-major.
    expert_of_row = torch.arange(num_local, device=x.device).repeat(ep).repeat_interleave(recv_counts.reshape(-1))
    regroup_t = torch.sort(expert_of_row, stable=True).indices
    local_counts = recv_counts.sum(0).tolist()
    routing = Routing(order, num_tokens, top_k, local_counts, send_splits, recv_splits, regroup_t, info)
    return tokens[regroup_t], routing


def balanced_counts(num_pairs: int, num_experts: int, capacity: int | None = None) -> list[int]:
    """Balanced routing: ``num_pairs`` (token, slot) pairs spread evenly over the experts
    (the first ``num_pairs % E`` experts take one more), each capped at ``capacity``."""
    base, extra = divmod(num_pairs, num_experts)
    counts = [base + (e < extra) for e in range(num_experts)]
    return [min(c, capacity) for c in counts] if capacity is not None else counts


def _balanced_dispatch(x: torch.Tensor, idx: torch.Tensor, num_experts: int, axis: str,
                       capacity_factor: float | None) -> tuple:
    """``moe_dispatch`` on the meta device (scale simulation), where routing has no values:
    every rank routes its pairs evenly (:func:`balanced_counts`), so the counts every rank
    sends and receives are known without the data; the collectives still run and record."""
    num_tokens, top_k = idx.shape
    pairs = num_tokens * top_k
    capacity = math.ceil(capacity_factor * pairs / num_experts) if capacity_factor is not None else None
    counts = balanced_counts(pairs, num_experts, capacity)
    kept = sum(counts)
    order = torch.empty(kept, dtype=torch.long, device=x.device)
    rows = x[order // top_k]  # as the real dispatch gathers them: backward reaches x
    g = _ep_group(axis)
    if g is None:
        return rows, Routing(order, num_tokens, top_k, counts)
    ep, num_local = g.size, local_experts(num_experts, g.size)
    counts = counts + [0] * (ep * num_local - num_experts)  # the padding experts' (none routed)
    send_counts = torch.empty(ep, num_local, dtype=torch.long, device=x.device)
    _all_to_all(send_counts, [1] * ep, [1] * ep, axis, "fwd", "MoE dispatch: token counts per expert", None)
    mine = counts[g.rank * num_local:(g.rank + 1) * num_local]
    table = [list(mine) for _ in range(ep)]  # [source rank][local expert]: every rank routes alike
    send_splits = [sum(counts[j * num_local:(j + 1) * num_local]) for j in range(ep)]
    recv_splits = [sum(r) for r in table]
    info = (tuple(counts), tuple(tuple(r) for r in table))
    tokens = _TokenAllToAll.apply(rows, send_splits, recv_splits, axis, "MoE dispatch: tokens to expert owners",
                                  info)
    regroup_t = torch.empty(sum(recv_splits), dtype=torch.long, device=x.device)
    local_counts = [sum(col) for col in zip(*table)]
    routing = Routing(order, num_tokens, top_k, local_counts, send_splits, recv_splits, regroup_t, info)
    return tokens[regroup_t], routing


def moe_experts(rows: torch.Tensor, routing: Routing, bodies, params: list, style: str, axis: str,
                expert_ids: bool = False) -> torch.Tensor:
    """The user's experts on the rows of this rank's experts (``bodies`` cut from the traced graph).

    A stacked body with ``expert_ids`` also takes each row's expert among this rank's experts
    (its per-expert parameters, biases, are this rank's rows of the ``[E, ...]`` tables)."""
    g = _ep_group(axis)
    rank = g.rank if g is not None else 0
    num_local = len(routing.local_counts)
    if style == "stacked":
        offsets = torch.tensor(routing.local_counts, device=rows.device).cumsum(0).to(torch.int32)
        if not expert_ids:
            return bodies[0](rows, offsets, *params)
        return bodies[0](rows, offsets, local_expert_ids(routing.local_counts, rows.device), *params)
    per_expert = len(params) // len(bodies)
    outs = []
    for j, chunk in enumerate(torch.split(rows, routing.local_counts)):
        e = rank * num_local + j
        if e < len(bodies):  # past the experts: a padding slot, routed no rows
            outs.append(bodies[e](chunk, *params[e * per_expert:(e + 1) * per_expert]))
    return torch.cat(outs) if outs else rows


def local_expert_ids(local_counts: list[int], device) -> torch.Tensor:
    """The local expert of each row grouped by local expert: ``j`` repeated ``local_counts[j]`` times."""
    ids = torch.repeat_interleave(torch.arange(len(local_counts)), torch.tensor(local_counts, dtype=torch.long))
    return ids.to(device)


def moe_combine(out: torch.Tensor, weights: torch.Tensor, routing: Routing, axis: str) -> torch.Tensor:
    """Expert outputs back to their tokens' ranks, weighted and summed over the top-k slots."""
    if routing.regroup is not None:
        back = torch.empty_like(routing.regroup)
        back[routing.regroup] = torch.arange(routing.regroup.numel(), device=back.device)
        out = _TokenAllToAll.apply(out[back], routing.recv_splits, routing.send_splits, axis,
                                   "MoE combine: expert outputs to token owners", routing.counts)
    weighted = out * weights.reshape(-1)[routing.order].unsqueeze(-1)
    slots = routing.num_tokens * routing.top_k
    if routing.order.numel() == slots:  # dropless: every (token, slot) pair has a row
        inverse = torch.empty_like(routing.order)
        inverse[routing.order] = torch.arange(slots, device=inverse.device)
        per_slot = weighted[inverse]
    else:  # dropped pairs contribute zero: the token keeps only its residual
        per_slot = weighted.new_zeros((slots,) + tuple(weighted.shape[1:])).index_copy(0, routing.order, weighted)
    return per_slot.view(routing.num_tokens, routing.top_k, -1).sum(dim=1)
