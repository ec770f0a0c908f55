"""Measured memory of one rank during ``train_step``: parameters, gradients, optimizer state, activations.

:class:`MemoryMeter` is owned by :class:`autopar.runtime.module.ParallelModule`, which calls it
around each micro-batch and around the optimizer step; ``ParallelModule.memory_report()``
returns :meth:`MemoryMeter.report` for the last step.  Definitions (bytes on this rank):

  * ``params``: the parameters the program holds (under ZeRO-3 only the ``dp`` shards);
  * ``master_params``: the fp32 master weights the optimizer steps on under mixed precision
    (plain tensors, or the ZeRO shards at any ZeRO stage), which the cost model's 12 B optimizer
    term includes -- so they are also counted in ``optimizer``; none in fp32 training (ZeRO-1/2
    step this rank's piece of the parameters' own flat buffer, ZeRO-3's shards are the parameters);
  * ``grads``: gradients held when backward of the last micro-batch has finished, before
    the gradient sync (full without ZeRO and under ZeRO-1, the ``dp`` shards under ZeRO-2/3);
  * ``optimizer``: the optimizer's state tensors after the step (scalar ``step`` counters
    excluded), plus the master weights under mixed precision;
  * ``activations`` (absent under pp, whose micro-batches torch's schedule runs): the peak
    over micro-batches of the bytes saved for backward when the micro-batch's forward has
    finished (distinct storages; parameters, buffers and gathered
    ZeRO-3 parameters excluded), which is when saved activations peak; under activation
    recompute, plus the largest *working set* of a recomputed region (what one region's
    recomputation saves in backward, beyond its inputs: a decoder layer's activations under
    ``recompute=full``), the cost model's ``recompute_buffer``.

Saved tensors are seen by a ``saved_tensors_hooks`` pack hook; under ZeRO-3 the inner hooks
of :mod:`autopar.runtime.gradients.zero_fsdp` forward every non-parameter tensor to :func:`autopar.ops.step.observe_saved`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from autopar.ops.step import activate, current

__all__ = ["MemoryMeter"]


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class MemoryMeter:
    """Per-step memory measurements of one rank (see the module docstring)."""

    def __init__(self, *, masters_in_optimizer: bool = False) -> None:
        self._masters_in_optimizer = masters_in_optimizer
        self._excluded: set[int] = set()
        self._seen: dict[int, int] = {}
        self._seen_total = 0  # sum(self._seen.values()), kept as tensors are seen
        self._held: tuple = (None, [])  # (module, its parameters and buffers): listed once per module
        self._peak = 0
        self._metered = False  # a pipelined step runs its micro-batches inside torch's schedule, unmetered
        self._report: dict[str, int] = {}
        # Activation recompute (autopar/ops/recompute.py): what the region being recomputed saves.
        self._working: dict[int, int] | None = None
        self._working_inputs: set[int] = set()
        self._working_peak = 0

    @contextlib.contextmanager
    def microbatch(self, gm: torch.nn.Module) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward (activations are counted at pack time)."""
        self._excluded = {t.untyped_storage().data_ptr() for t in self._tensors(gm) if t.numel()}
        self._seen, self._seen_total = {}, 0
        self._metered = True
        try:
            with activate(current(), memory=self), torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._seen, self._seen_total = {}, 0

    def begin_step(self) -> None:
        self._peak = 0
        self._working_peak = 0
        self._metered = False

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[set[int]]:
        """While backward recomputes one region: what it saves is its working set, not forward's
        saved activations.  Yields the set of storages to leave out (the caller adds the region's
        inputs: counted in forward, or parameters re-gathered by ZeRO-3)."""
        self._working, self._working_inputs = {}, set()
        try:
            yield self._working_inputs
        finally:
            self._working_peak = max(self._working_peak, sum(self._working.values()))
            self._working, self._working_inputs = None, set()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.observe(t)
        return t.detach()  # never ``t``: see autopar/ops/regather.py SavedGathers.pack

    def observe(self, t: torch.Tensor) -> None:
        """Count ``t`` as saved for backward (once per storage; parameters excluded)."""
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if self._working is not None:  # a recomputed region's tensor
            if ptr not in self._excluded and ptr not in self._working_inputs:
                self._working[ptr] = storage.nbytes()
            return
        if ptr in self._excluded or ptr in self._seen:
            return
        self._seen[ptr] = storage.nbytes()
        self._seen_total += self._seen[ptr]
        self._peak = max(self._peak, self._seen_total)

    def _tensors(self, gm: torch.nn.Module) -> list[torch.Tensor]:
        """``gm``'s parameters and buffers: the module's tensor objects stay (their storage may
        change, ZeRO's ``.data``), so walking the module tree once, not per micro-batch, suffices."""
        if self._held[0] is not gm:
            self._held = (gm, list(gm.parameters()) + list(gm.buffers()))
        return self._held[1]

    def before_sync(self, gm: torch.nn.Module, sync) -> None:
        """After the last backward: parameters and gradients as held now."""
        held = sync.memory_tensors()
        module = list(gm.parameters())  # once a step
        self._report = {
            "params": _nbytes(module) + _nbytes(held["params"]),
            "master_params": _nbytes(held["master_params"]),
            "grads": _nbytes([p.grad for p in module] + held["grads"]),
        }

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
        self._report["optimizer"] = _nbytes(state) + (self._report.get("master_params", 0)
                                                      if self._masters_in_optimizer else 0)
        if self._metered:
            self._report["activations"] = self._peak + self._working_peak

    def report(self) -> dict[str, int]:
        return dict(self._report)
