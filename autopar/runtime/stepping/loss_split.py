""":class:`LossSplit`: one loss over the global batch, computed in pieces on many ranks.

A step's batch is cut into ``dp × cp × mb`` pieces (data ranks, context ranks, micro-batches);
each piece's program returns its own mean loss.  The mean of those means is the global mean
only when every piece holds as many valid targets; with padding (``ignore_index``) each piece
is weighed by its share of the global count of valid targets:

    weight(piece) = n_piece · pieces / n_global,      global loss = mean over pieces of weight · loss

so the mean over pieces is the global token mean.  :meth:`count_valid_targets` finds
``n_global`` at the start of a step (a 16-byte all-reduce when each rank holds only its part of
the batch), :meth:`weight` is what the executors multiply each piece's loss by, and
:meth:`global_loss` averages this rank's loss over the data ranks and shares it over pp.  How a
loss function reduces over tokens is read from the traced graph
(:mod:`autopar.frontend.loss`, ``structure.loss_reduction``); a loss that cannot be split
exactly over a batch with ignored targets is refused by name.

Neighbours: the executors that call :meth:`weight` (:mod:`autopar.runtime.stepping.executors`,
``pipelined``), the step in :class:`autopar.runtime.module.ParallelModule`.
"""
from __future__ import annotations

from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.plan_space import data_axis

__all__ = ["LossSplit"]

# ``num_valid`` for a summed loss: every piece weighs the number of pieces.
_SUMMED = -1


class LossSplit:
    """The loss of plan ``plan``'s pieces (see the module docstring); ``reduction``: the traced
    loss's ``LossReduction`` (None: unknown, treated as a plain mean)."""

    def __init__(self, plan, reduction, device: torch.device):
        self.plan, self.reduction, self.device = plan, reduction, device
        self.num_valid: int | None = None  # this step's global count of valid targets

    @property
    def num_pieces(self) -> int:
        return self.plan.dp * self.plan.cp * self.plan.mb

    def count_valid_targets(self, target: Any, local: bool) -> None:
        """This step's global count of targets the loss averages over, for :meth:`weight`
        (``local``: each rank was given only its part of the batch); refuses a batch whose
        ignored targets a loss of unknown reduction would average wrongly."""
        self.num_valid = None
        reduction = self.reduction
        ignore = reduction.cross_entropy_ignore if reduction is not None else None
        if ignore is None or not torch.is_tensor(target) or target.is_meta or self.num_pieces == 1:
            return  # (a meta-device scale simulation has no values to count)
        counts = torch.stack([(target != ignore).sum(), (target == ignore).any().long()]).to(torch.int64)
        num_data = self.plan.dp * self.plan.cp
        if local and num_data > 1:  # each rank holds only its part: sum the counts (16 bytes)
            counts = collectives.loss_all_reduce(counts.to(self.device), data_axis(self.plan.cp),
                                                 "valid-target count of the global batch")
        num_valid, any_ignored = (int(v) for v in counts.cpu())
        if reduction.kind == "token_sum":
            self.num_valid = _SUMMED
            return
        if not reduction.token_mean:
            if any_ignored:
                raise AutoparError(
                    f"autopar: the targets of this batch contain ignore_index={ignore}, and the loss cannot be "
                    f"split over ranks exactly ({reduction.reason}): each of the {self.num_pieces} pieces of the "
                    "batch (dp x cp x mb) would divide by its own count of valid targets. Return "
                    "F.cross_entropy(logits.flatten(0, 1), target.flatten()) (mean over valid targets) from "
                    "loss_fn alone, or use a plan with dp = cp = mb = 1; see docs/troubleshooting.md.")
            return
        self.num_valid = num_valid

    def weight(self, target: Any) -> float:
        """The factor on one piece's mean loss (a micro-batch of this rank) that makes the mean
        over pieces the global mean over valid targets: ``n_piece * pieces / n_global``; 1.0
        when every piece holds the same number of valid targets (an unpadded batch)."""
        if self.num_valid == _SUMMED:  # a summed loss: the mean over pieces of pieces * sum is the sum
            return float(self.num_pieces)
        if self.num_valid is None or not self.num_valid or not torch.is_tensor(target):
            return 1.0
        ignore = self.reduction.ignore_index
        return int((target != ignore).sum()) * self.num_pieces / self.num_valid

    def global_loss(self, local: torch.Tensor | None) -> torch.Tensor:
        """The mean over data-parallel ranks of the ranks computing the loss, then shared over pp."""
        plan = self.plan
        total = local if local is not None else torch.zeros((), device=self.device)
        num_data = plan.dp * plan.cp
        if local is not None and num_data > 1:
            axis = data_axis(plan.cp)
            total = collectives.loss_all_reduce(total, axis, f"loss over {axis}") / num_data
        if plan.pp > 1:  # pp ranks without the loss contribute 0
            total = collectives.loss_all_reduce(total, "pp", "loss over pp")
        return total
