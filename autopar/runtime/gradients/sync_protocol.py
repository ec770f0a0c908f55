"""The interface of a gradient-synchronisation strategy: :class:`GradientSynchronizer`.

Three strategies implement it: :class:`autopar.runtime.gradients.grad_sync.GradSync` (bucketed
all-reduce, then a plain optimizer step; ``zero=0``),
:class:`autopar.runtime.gradients.zero_optimizer.DistributedOptimizer` (ZeRO-1/2: the optimizer steps ``dp``
shards of the parameters' flat buffers) and :class:`autopar.runtime.gradients.zero_fsdp.FullyShardedSync`
(ZeRO-3: the parameters live as ``dp`` shards).  :class:`autopar.runtime.module.ParallelModule`
picks one from the plan and then calls only what this protocol lists, as do the executors
(:mod:`autopar.runtime.stepping.executors`, :mod:`autopar.runtime.stepping.pipelined`), the state dicts and
checkpoints (:mod:`autopar.runtime.weights.state`), gradient clipping (:mod:`autopar.runtime.gradients.clipping`)
and the memory meter (:mod:`autopar.runtime.stepping.memory`).

The order of calls in one training step: ``microbatch()`` around each micro-batch's forward
and backward (flat executor) or ``pipeline_step()`` around the whole schedule (pipelined
executor, whose stages call ``after_backward()`` after each backward action); then ``sync()``;
clipping reads ``grad_square_sum()`` and calls ``scale_grads()``; then ``step()``.  An
evaluation forward runs inside ``forward_only()``.  Outside a step, ``full_parameters()``,
``read_parameters()`` and ``write_parameter()`` read and write parameter values, and
``optimizer_state()`` / ``load_optimizer_state()`` the optimizer state, all as tp-local
tensors under graph parameter names, whatever the strategy shards over ``dp``.
"""
from __future__ import annotations

from typing import ContextManager, Iterable, Iterator, Protocol, runtime_checkable

import torch

__all__ = ["GradientSynchronizer"]


@runtime_checkable
class GradientSynchronizer(Protocol):
    """What :class:`autopar.runtime.module.ParallelModule` needs of a gradient-sync strategy."""

    optimizer: torch.optim.Optimizer
    """The user's optimizer, over what this strategy steps (parameters, fp32 masters or ZeRO shards)."""

    zero_stage: int
    """The ZeRO stage the strategy implements (0: none)."""

    def microbatch(self, last: bool = False) -> ContextManager[None]:
        """Context around one micro-batch's forward and backward in the flat executor; ``last``:
        the step's last micro-batch (whose backward may start the gradient reductions)."""
        ...

    def forward_only(self) -> ContextManager[None]:
        """Context around a forward without backward (evaluation): ZeRO-3 gathers its units there."""
        ...

    def pipeline_step(self) -> ContextManager[None]:
        """Context around one pipelined step (every schedule action of this rank)."""
        ...

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """After a backward: the flat micro-batch's (``chunk`` None), or the pipeline action
        ``kind`` (``full``, ``input``, ``weight`` or torch's ``inference``) of pipeline chunk
        ``chunk``.  Mixed precision folds bf16 gradients into fp32 main gradients here; ZeRO-2
        reduce-scatters a chunk's gradients, ZeRO-1 starts those of the units whose chunks ran
        their last backward, ZeRO-3 drops its re-gathered units."""
        ...

    def chunk_shards(self, chunk: int) -> list[torch.nn.Parameter]:
        """Parameters pipeline chunk ``chunk`` must own besides the module's (ZeRO-3's flat
        shards, which torch's split weight backward differentiates); empty otherwise."""
        ...

    def sync(self) -> None:
        """After the step's last backward: gradients reduced over their data-parallel and
        partial-sum axes into what the optimizer steps."""
        ...

    def step(self) -> None:
        """The optimizer step on the synchronised gradients, which are then dropped; the
        module's parameters hold the updated values afterwards (ZeRO-3: its shards)."""
        ...

    def grad_square_sum(self, weights: dict[str, float], device: torch.device) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: the sum of
        ``weights[name] * ||grad||^2`` over the gradient elements it holds (float64, on ``device``)."""
        ...

    def scale_grads(self, coef: float) -> None:
        """Multiply every gradient this strategy holds by ``coef`` (clipping, the mean over
        micro-batches under pp)."""
        ...

    def full_parameters(self, write_back: bool = False) -> ContextManager[dict[str, torch.Tensor]]:
        """Context yielding graph name -> the tp-local tensor holding the parameter's whole value
        (the fp32 master under mixed precision; gathered over ``dp`` under ZeRO-3); with
        ``write_back`` what was written into those tensors is stored back when the block ends
        (collective under ZeRO: every rank calls it)."""
        ...

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` to ``value`` (its tp-local shape) wherever the strategy
        keeps it (the parameter, its fp32 master, its piece of a ZeRO shard); not collective."""
        ...

    def read_parameters(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tp-local value)`` for each graph parameter of ``names``, one at a time
        (collective under ZeRO: every rank calls it with the same names)."""
        ...

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Graph parameter name -> {state key: tp-local tensor, whole over ``dp``} (collective
        under ZeRO)."""
        ...

    def load_optimizer_state(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`optimizer_state`: ``entries`` already cut to this rank's tp shard."""
        ...

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held outside the module's parameters, by kind: ``params``, ``master_params``,
        ``grads`` (for :class:`autopar.runtime.stepping.memory.MemoryMeter`)."""
        ...
