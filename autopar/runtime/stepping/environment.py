""":class:`StepEnvironment`: what an executor is given of the program, instead of the ``ParallelModule``.

An executor (:mod:`autopar.runtime.stepping.executors`, ``pipelined``, ``simulated``) runs this
rank's micro-batches; it needs the rank's device, groups and parameters, the gradient-sync
strategy's hooks, the memory meter, how the batch given to the step splits into micro-batches, and
each piece's loss weight -- nothing else.  The environment is built once by
:class:`autopar.runtime.module.ParallelModule`; ``local_batch`` is set at each step (whether the
step was given this rank's part of the batch or the whole of it).

:class:`StepRecord` keeps a step's measured throughput beside the cost model's prediction for the
same plan (``pm.last_step_stats``, ``pm.predicted_cost``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autopar.runtime.stepping.batching import global_sizes, local_microbatches, split_microbatches

__all__ = ["StepEnvironment", "StepRecord"]


@dataclasses.dataclass(eq=False)
class StepEnvironment:
    """One rank's step environment (see the module docstring).

    ``params``: :class:`autopar.runtime.weights.parameters.RankParameters`; ``grad_sync``: the
    :class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`; ``memory``: the
    :class:`autopar.runtime.stepping.memory.MemoryMeter`; ``loss``: the
    :class:`autopar.runtime.stepping.loss_split.LossSplit`; ``size_symbols``: the graph's symbolic
    batch and sequence."""

    plan: Any
    device: torch.device
    params: Any
    grad_sync: Any
    memory: Any
    loss: Any
    mixed_precision: bool
    size_symbols: tuple
    local_batch: bool = False

    @property
    def groups(self) -> dict:
        return self.params.groups

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.params.gm

    def coords(self) -> dict[str, tuple[int, int]]:
        return self.params.coords()

    def holds(self, name: str) -> bool:
        return self.params.holds(name)

    def microbatches(self, inputs: tuple, target: Any, coords: dict[str, int]) -> list[tuple[tuple, Any]]:
        """This rank's micro-batches ``[(inputs, target), ...]`` of the batch given to the step
        (the global batch, or with ``local_batch`` this rank's part of it)."""
        if self.local_batch:
            return split_microbatches(inputs, target, self.plan, self.device)
        return local_microbatches(inputs, target, self.plan, coords, self.device)

    def loss_weight(self, target: Any) -> float:
        """The factor on one piece's mean loss (:meth:`LossSplit.weight`)."""
        return self.loss.weight(target)


class StepRecord:
    """A step's tokens and seconds, and the cost model's step time, MFU and tokens/s for the plan
    (``predict(plan, batch, seq)``: made once, at the first step, from its batch's sizes)."""

    def __init__(self, plan, predict):
        self.plan, self._predict = plan, predict
        self.predicted_cost = None  # autopar.cost.Cost, or None without hardware figures
        self._prediction: dict[str, float] | None = None
        self.last: dict[str, Any] = {}

    def record(self, inputs: tuple, seconds: float, local: bool) -> dict[str, Any]:
        tokens = int(inputs[0].numel()) if torch.is_tensor(inputs[0]) else 0
        if local and tokens:  # the global batch's tokens, as in the global mode
            tokens *= self.plan.dp * (self.plan.cp if inputs[0].dim() > 1 else 1)
        if self._prediction is None:
            batch, seq = global_sizes(inputs, self.plan, local=local)
            self.predicted_cost, self._prediction = self._predict(int(batch), seq or 1)
        self.last = {"tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"), **self._prediction}
        return self.last
