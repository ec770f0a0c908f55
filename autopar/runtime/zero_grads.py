"""ZeRO-1/2: gradients reduce-scattered into the units' ``dp`` shards, on which the optimizer
steps; the updated shards are all-gathered back into the module's parameters.

:class:`ShardedGradients` is the part of :class:`autopar.runtime.zero.ZeroSync` that moves
gradients into shards (its units, layouts and collectives: :class:`autopar.runtime.zero_units.ZeroUnits`):

* ZeRO-1: after the last micro-batch, partial gradients are all-reduced over their axis on
  the full gradients (:meth:`ShardedGradients._all_reduce_partial_full`), each unit is
  reduce-scattered (phase ``grad``); under mixed precision each micro-batch's bf16 gradients
  are first folded into fp32 main gradients (:meth:`ShardedGradients._fold_main_grads`);
* ZeRO-2: each micro-batch's gradients are reduce-scattered during its backward (a unit's
  reduce-scatter starts from its gradients' hooks once all of them exist, and is waited for at
  the micro-batch's end) and the full gradients freed (accumulation happens in the shards);
  partial gradients are summed over their axis once per step on the ``B`` shards
  (:meth:`ShardedGradients._all_reduce_partial_shards`; sum and scatter commute);
* both: after the optimizer step the updated shards are all-gathered into the parameters
  (phase ``step``, :meth:`ShardedGradients._gather_into_params`).
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from autopar.ops import collectives
from autopar.runtime.zero_units import ZeroUnits

__all__ = ["ShardedGradients"]


class ShardedGradients(ZeroUnits):
    """Gradients into the units' shards, updated shards back into the parameters (ZeRO-1/2)."""

    def _init_sharded_gradients(self) -> None:
        self.main_grads: dict[str, torch.Tensor] = {}  # ZeRO-1, mixed: fp32 accumulated gradients
        # ZeRO-2 in a flat micro-batch: unit -> its parameters still without this backward's
        # gradient (None outside one), and unit -> its reduce-scatter started from their hooks.
        self._waiting: dict[int, int] | None = None
        self._started: dict[int, tuple] = {}

    def _hook_gradients(self, params: dict) -> None:
        """ZeRO-2: start a unit's reduce-scatter once backward has made all its gradients, so it
        runs while backward computes the units before it (as DDP's buckets do).  The hooks hold
        a weak reference: a strong one would close a cycle through the parameters' C++ autograd
        metadata that the garbage collector cannot see (autopar/runtime/grad_sync.py ``_Overlap``)."""
        me = weakref.ref(self)
        for unit, names in enumerate(self.units):
            for x in names:
                if params[x].requires_grad:
                    params[x].register_post_accumulate_grad_hook(functools.partial(_unit_grad_ready, me, unit))

    def _count_waiting(self) -> None:
        """ZeRO-2, a flat micro-batch begins: every unit waits for all its parameters' gradients."""
        self._waiting = {u: sum(self.gm.get_parameter(x).requires_grad for x in names)
                         for u, names in enumerate(self.units)}

    def _unit_grad_ready(self, unit: int) -> None:
        """A gradient of ``unit`` was accumulated (ZeRO-2 hook); the last one starts its reduce-scatter."""
        if self._waiting is None:  # outside a flat micro-batch (pipelined: after_backward scatters)
            return
        self._waiting[unit] -= 1
        if self._waiting[unit] == 0:
            lay = self.layouts[unit]
            grads = {x: self._grad(x, self.gm.get_parameter(x)) for x in lay.names}
            self._started[unit] = self._start_reduce_scatter(unit, lay.flatten(grads), async_op=True)

    def _drop_started(self) -> None:
        """A micro-batch that failed: wait for its reduce-scatters in flight and drop them."""
        for pending in self._started.values():
            if pending[2] is not None:
                pending[2].wait()
        self._started.clear()

    def _scatter_param_grads(self, unit: int) -> None:
        """The unit's gradients (the module's, or the fp32 main gradients) reduce-scattered into its
        shard's gradient, and dropped."""
        lay = self.layouts[unit]
        params = {x: self.gm.get_parameter(x) for x in lay.names}
        pending = self._started.pop(unit, None)
        if pending is not None:  # started in backward (ZeRO-2): its gradients were final then
            shard_grad = self._finish_reduce_scatter(pending)
        else:
            grads = {x: self._grad(x, p) for x, p in params.items()}
            shard_grad = self._reduce_scatter(unit, lay.flatten(grads))
        self._add_shard_grad(unit, shard_grad)
        for x, p in params.items():
            p.grad = None
            self.main_grads.pop(x, None)

    def _fold_main_grads(self) -> None:
        """ZeRO-1 with mixed precision: this backward's bf16 gradients into the fp32 main gradients."""
        for x, p in self.gm.named_parameters():
            if p.grad is not None:
                held = self.main_grads.get(x)
                self.main_grads[x] = p.grad.float() if held is None else held.add_(p.grad)
                p.grad = None

    def _grad(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The gradient held for ``name``: the fp32 main gradient (ZeRO-1, mixed) or ``p.grad``."""
        main = self.mixed and self.zero_stage == 1
        g = self.main_grads.get(name) if main else p.grad
        return g if g is not None else torch.zeros_like(p, dtype=torch.float32 if main else p.dtype)

    def _all_reduce_partial_full(self) -> None:
        """ZeRO-1: sum partial gradients over their axes on the full gradients (as GradSync)."""
        for bucket in self.buckets:
            if bucket.axis in self.unit_axes:
                continue
            params = [self.gm.get_parameter(x) for x in bucket.params]
            grads = [self._grad(x, p) for x, p in zip(bucket.params, params)]
            flat = torch.cat([g.reshape(-1) for g in grads])
            collectives.record("all_reduce", bucket.axis, flat, "grad",
                               f"partial gradient bucket ({len(params)} tensors)")
            dist.all_reduce(flat, group=self.groups[bucket.axis].group)
            offset = 0
            for x, p, g in zip(bucket.params, params, grads):
                reduced = flat[offset:offset + g.numel()].view_as(g)
                if self.mixed:
                    self.main_grads[x] = reduced
                else:
                    p.grad = reduced
                offset += g.numel()

    def _all_reduce_partial_shards(self) -> None:
        """ZeRO-2/3: sum the ``B`` shards (partial gradients) over their axes, one call per axis."""
        parts = [(s, lay) for s, lay in zip(self.shards, self.layouts) if lay.sb and s.grad is not None]
        if not parts:
            return
        flat = torch.cat([s.grad[lay.sa:] for s, lay in parts])
        for axis in self.partial_axes:
            if self.groups[axis].size == 1:
                continue
            collectives.record("all_reduce", axis, flat, "grad", f"partial gradient shards ({len(parts)} units)")
            dist.all_reduce(flat, group=self.groups[axis].group)
        offset = 0
        for s, lay in parts:
            s.grad[lay.sa:] = flat[offset:offset + lay.sb]
            offset += lay.sb

    def _gather_into_params(self) -> None:
        """ZeRO-1/2 after the step: the updated shards all-gathered into the module's parameters."""
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                flat = self._all_gather(unit, self.shards[unit], "step")
                for x, v in lay.views(flat).items():
                    self.gm.get_parameter(x).copy_(v)


def _unit_grad_ready(sync: "weakref.ref[ShardedGradients]", unit: int, param: torch.Tensor) -> None:
    live = sync()
    if live is not None:  # a freed program leaves an inert hook on a parameter kept elsewhere
        live._unit_grad_ready(unit)
