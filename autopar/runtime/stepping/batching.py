"""Cut a batch into what one rank computes: its data-parallel rows and context-parallel
positions, in micro-batches.

One set of rules, two entry points:

* :func:`local_microbatches` takes the *global* batch (``train_step(inputs, target)``,
  identical on every rank) and keeps this rank's part: the contiguous ``batch / dp`` rows
  of its ``dp`` coordinate (:func:`rank_rows`) and, under context parallelism, its two
  load-balanced sequence chunks (:func:`rank_positions`, from
  :func:`autopar.ops.cp_attention.cp_chunk_indices`);
* :func:`split_microbatches` takes a batch that is already this rank's part
  (``train_step(..., local=True)``, cut by :meth:`autopar.runtime.stepping.data.BatchSlice.take`)
  and only splits it.

Both then split the rows into ``mb`` micro-batches (:func:`micro_rows`) for gradient
accumulation, with the same cutting helpers, so the two give identical micro-batches.
Which batch and sequence sizes a plan accepts is :meth:`autopar.plan.Plan.validate`'s rule.

Neighbours: :meth:`autopar.runtime.module.ParallelModule.microbatches` calls the entry
points; :mod:`autopar.runtime.stepping.data` builds the user-facing ``BatchSlice`` and sampler on
:func:`rank_rows` / :func:`rank_positions`; :mod:`autopar.runtime.gradients.grad_sync` reduces what
the micro-batches produced.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.errors import AutoparError

__all__ = ["local_microbatches", "split_microbatches", "check_batch", "rank_rows", "rank_positions",
           "micro_rows", "cut_rows", "cut_positions", "global_sizes"]


def global_sizes(inputs: tuple, plan, *, local: bool = False) -> tuple[int, int | None]:
    """``(batch, seq)`` of the global batch that ``inputs`` is (or, ``local``, this rank's part of)."""
    ids = inputs[0]
    seq = ids.shape[1] if ids.dim() > 1 else None
    if not local:
        return ids.shape[0], seq
    return ids.shape[0] * plan.dp, (seq * plan.cp if seq is not None else None)


def check_batch(inputs: tuple, plan, *, local: bool = False) -> None:
    """Raise an ``autopar:`` error if the batch cannot be split as the plan needs (the rule
    of :meth:`~autopar.plan.Plan.validate`; ``local``: ``inputs`` are this rank's part)."""
    batch, seq = global_sizes(inputs, plan, local=local)
    try:
        plan.validate(global_batch=batch, seq_len=seq)
    except AutoparError as exc:
        if not local:
            raise
        given = f"{inputs[0].shape[0]} rows" + (f" of {inputs[0].shape[1]} tokens" if seq is not None else "")
        raise AutoparError(f"{exc} (with local=True this rank was given {given}: the global batch is "
                           f"rows*dp = {batch}" + (f", the sequence tokens*cp = {seq}" if plan.cp > 1 else "")
                           + ")") from None


def rank_rows(batch: int, plan, dp_rank: int) -> range:
    """The rows of a global batch of ``batch`` that data-parallel rank ``dp_rank`` computes."""
    plan.validate(global_batch=batch)
    size = batch // plan.dp
    return range(dp_rank * size, (dp_rank + 1) * size)


def rank_positions(seq: int, plan, cp_rank: int) -> torch.Tensor | None:
    """The global token positions context-parallel rank ``cp_rank`` computes (None without cp):
    chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of ``2*cp`` (causal load balancing)."""
    if plan.cp == 1:
        return None
    plan.validate(seq_len=seq)
    from autopar.ops.cp_attention import cp_chunk_indices

    return cp_chunk_indices(seq, cp_rank, plan.cp)


def micro_rows(rows: range, num_microbatches: int) -> list[range]:
    """``rows`` in ``num_microbatches`` contiguous equal parts (the micro-batches, in order)."""
    size = len(rows) // num_microbatches
    return [range(rows.start + m * size, rows.start + (m + 1) * size) for m in range(num_microbatches)]


def cut_rows(t: Any, batch: int, rows: range, device: torch.device | None = None) -> Any:
    """Rows ``rows`` of a tensor with ``batch`` rows (moved to ``device``); anything else as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.dim() > 0 and t.shape[0] == batch:
        t = t[rows.start:rows.stop]
    return t.to(device) if device is not None else t  # every tensor of the step on the rank's device


def cut_positions(t: Any, seq: int | None, positions: torch.Tensor | None) -> Any:
    """Positions ``positions`` of dim 1 of a tensor with ``seq`` there; anything else as it is."""
    if positions is not None and isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[1] == seq:
        return t.index_select(1, positions.to(t.device))
    return t


def _split(inputs: tuple, target: Any, rows: range, positions: torch.Tensor | None,
           plan, device: torch.device) -> list[tuple[tuple, Any]]:
    batch = inputs[0].shape[0]
    seq = inputs[0].shape[1] if inputs[0].dim() > 1 else None

    def cut(t: Any, part: range) -> Any:
        return cut_positions(cut_rows(t, batch, part, device), seq, positions)

    return [(tuple(cut(t, part) for t in inputs), cut(target, part)) for part in micro_rows(rows, plan.mb)]


def local_microbatches(inputs: tuple, target: Any, plan, coords: dict[str, int],
                        device: torch.device) -> list[tuple[tuple, Any]]:
    """This rank's micro-batches ``[(inputs, target), ...]`` of the global batch; ``coords``
    maps axis -> rank on it."""
    check_batch(inputs, plan)
    batch, seq = global_sizes(inputs, plan)
    rows = rank_rows(batch, plan, coords.get("dp", 0))
    positions = rank_positions(seq, plan, coords.get("cp", 0)) if seq is not None else None
    return _split(inputs, target, rows, positions, plan, device)


def split_microbatches(inputs: tuple, target: Any, plan, device: torch.device) -> list[tuple[tuple, Any]]:
    """The micro-batches ``[(inputs, target), ...]`` of a batch that is already this rank's part
    (its rows and, under cp, its positions): only the split into ``mb``, nothing cut."""
    check_batch(inputs, plan, local=True)
    return _split(inputs, target, range(inputs[0].shape[0]), None, plan, device)
