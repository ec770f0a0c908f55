"""Cut the global batch into what one rank computes: its data-parallel slice, in micro-batches.

``train_step`` receives the *global* batch, identical on every rank.  Rank coordinates on
the mesh decide what this rank keeps: ``batch / dp`` samples for its ``dp`` coordinate,
split into ``mb`` micro-batches for gradient accumulation, and under context parallelism
its load-balanced sequence chunks (:func:`autopar.ops.cp_attention.cp_chunk_indices`).

Neighbours: :mod:`autopar.runtime` calls :func:`local_micro_batches`;
:mod:`autopar.runtime.grad_sync` reduces what the micro-batches produced.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.errors import AutoparError

__all__ = ["local_micro_batches", "check_batch"]


def check_batch(inputs: tuple, plan) -> None:
    """Raise an ``autopar:`` error if the global batch cannot be split as the plan needs."""
    batch = inputs[0].shape[0]
    parts = plan.dp * plan.mb
    if batch % parts:
        raise AutoparError(
            f"autopar: the global batch of {batch} does not split into dp*mb = {plan.dp}*{plan.mb} "
            f"parts; use a batch that is a multiple of {parts}.")
    if plan.cp > 1 and inputs[0].dim() > 1 and inputs[0].shape[1] % (2 * plan.cp):
        seq = inputs[0].shape[1]
        raise AutoparError(
            f"autopar: context parallelism cuts the sequence of {seq} tokens into 2*cp = {2 * plan.cp} "
            f"load-balanced chunks; use a sequence length that is a multiple of {2 * plan.cp} (e.g. "
            f"{(seq // (2 * plan.cp) + 1) * 2 * plan.cp}) or a smaller cp.")
    if plan.sp and inputs[0].dim() > 1 and (inputs[0].shape[1] // plan.cp) % plan.tp:
        seq = inputs[0].shape[1]
        raise AutoparError(
            f"autopar: sequence parallelism splits the sequence of {seq} tokens over tp={plan.tp} "
            f"ranks; use a sequence length that is a multiple of {plan.tp} (e.g. "
            f"{(seq // plan.tp + 1) * plan.tp}) or drop 'sp'.")


def _part(t: Any, batch: int, index: int, count: int, device: torch.device) -> Any:
    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
        size = batch // count
        return t[index * size:(index + 1) * size].to(device)
    return t


def _cp_part(t: Any, seq: int, rank: int, size: int) -> Any:
    """Causal load balancing: ``2*size`` chunks of the sequence, this rank keeps ``rank`` and ``2*size-1-rank``."""
    if size > 1 and isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[1] == seq:
        from autopar.ops.cp_attention import cp_chunk_indices

        return t.index_select(1, cp_chunk_indices(seq, rank, size).to(t.device))
    return t


def local_micro_batches(inputs: tuple, target: Any, plan, coords: dict[str, int],
                        device: torch.device) -> list[tuple[tuple, Any]]:
    """This rank's micro-batches ``[(inputs, target), ...]``; ``coords`` maps axis -> rank on it."""
    check_batch(inputs, plan)
    batch = inputs[0].shape[0]
    count = plan.dp * plan.mb
    seq = inputs[0].shape[1] if inputs[0].dim() > 1 else None
    cp_rank = coords.get("cp", 0)
    chunks = []
    for m in range(plan.mb):
        index = coords.get("dp", 0) * plan.mb + m
        chunks.append((tuple(_cp_part(_part(t, batch, index, count, device), seq, cp_rank, plan.cp) for t in inputs),
                       _cp_part(_part(target, batch, index, count, device), seq, cp_rank, plan.cp)))
    return chunks
