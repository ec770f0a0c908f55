"""Cut the global batch into what one rank computes: its data-parallel slice, in micro-batches.

``train_step`` receives the *global* batch, identical on every rank.  Rank coordinates on
the mesh decide what this rank keeps: ``batch / dp`` samples for its ``dp`` coordinate,
split into ``mb`` micro-batches for gradient accumulation.  Sequence-level slicing for
context parallelism belongs here too (it is the same question: which tokens are mine).

Neighbours: :mod:`autopar.runtime` calls :func:`local_micro_batches`;
:mod:`autopar.grad_sync` reduces what the micro-batches produced.
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
    if plan.sp and inputs[0].dim() > 1 and inputs[0].shape[1] % plan.tp:
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


def local_micro_batches(inputs: tuple, target: Any, plan, coords: dict[str, int],
                        device: torch.device) -> list[tuple[tuple, Any]]:
    """This rank's micro-batches ``[(inputs, target), ...]``; ``coords`` maps axis -> rank on it."""
    check_batch(inputs, plan)
    batch = inputs[0].shape[0]
    count = plan.dp * plan.mb
    chunks = []
    for m in range(plan.mb):
        index = coords.get("dp", 0) * plan.mb + m
        chunks.append((tuple(_part(t, batch, index, count, device) for t in inputs),
                       _part(target, batch, index, count, device)))
    return chunks
