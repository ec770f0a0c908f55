"""ZeRO-1/2's gradients: where backward's gradients go, and how they reach this rank's shard.

Two policies with one interface, of which :class:`autopar.runtime.gradients.zero_optimizer.DistributedOptimizer`
holds one (``zero=1`` or ``zero=2``); the units and their segments are
:class:`autopar.runtime.gradients.zero_layout.ZeroLayout`'s, the reduce-scatter :func:`autopar.runtime.gradients.zero_layout.scatter_unit`.

* :class:`KeptGrads` (ZeRO-1): each unit's gradients live whole until the step, in one flat buffer
  laid out as the reduce-scatter wants it (:class:`autopar.runtime.gradients.flat_layout.FlatSegment`), made
  when the unit's first gradient of the step arrives (its ``post_accumulate_grad_hook`` adds that
  one in) and dropped after the step: the parameters' ``.grad`` are views of it, so backward
  accumulates into it in place over the micro-batches (under mixed precision the bf16 gradients
  are added into it, fp32, by the hooks, and dropped).  In the last micro-batch's backward a
  unit's reduce-scatter starts in place, asynchronously, once all its gradients exist (under pp
  once every chunk holding the unit has run its last backward); the reduced shard is then this
  rank's piece of the same buffer, which the optimizer's shard reads as its gradient.  Units with
  a gradient first summed over another axis (partial over tp under SP, the tied embedding over pp)
  wait for that all-reduce in ``sync()``.  As Megatron's distributed optimizer: no copy of the
  gradients per step.
* :class:`ScatteredGrads` (ZeRO-2): no whole gradient outlives its unit's reduce-scatter.  Each
  parameter's gradient is copied by its hook into its unit's flat buffer, made when the unit's
  first gradient arrives, and dropped; once the unit's last one has arrived its reduce-scatter
  starts (in place), and once it is done the shard is added to the shard's gradient and the
  buffer freed.
  Gradient accumulation: every micro-batch's gradients are reduce-scattered (the cost model's
  ``dp`` reduce-scatter per micro-batch) and summed in the shards.  Partial gradients (their own
  segment) are summed over their axis once per step, on the shards.

Where a unit is one parameter whose gradient autograd made laid out as the buffer would be (a
matrix past the bucket cap: at scale, most units), that gradient *is* the buffer (:func:`_adopted`):
nothing is made or copied.

Both start at most :data:`autopar.plan_space.ZERO_SCATTERS_IN_FLIGHT` reduce-scatters before waiting
for the oldest: ZeRO-2's backward then holds at most that many units' buffers beyond the one being
filled, and a backend that copies a collective's buffer (gloo does, for every reduce-scatter it has
been handed) at most that many copies.

Event recording (for tests, off by default): set the strategy's ``events`` to a list and it gets
``(kind, unit)`` as reduce-scatters start (``reduce_scatter``).
"""
from __future__ import annotations

import collections
import functools
import weakref

import torch

from autopar.plan_space import ZERO_SCATTERS_IN_FLIGHT
from autopar.runtime.gradients.zero_layout import ZeroLayout, ZeroUnit, all_reduce_grads, scatter_unit

__all__ = ["KeptGrads", "ScatteredGrads"]


def _hook(policy: "weakref.ref", unit: ZeroUnit, name: str, param: torch.Tensor) -> None:
    live = policy()
    if live is not None:  # a freed program leaves an inert hook on a parameter kept elsewhere
        live.grad_ready(unit, name, param)


def _register_hooks(policy, layout: ZeroLayout, params: dict) -> None:
    """A ``post_accumulate_grad_hook`` per parameter of every unit.  It holds the policy weakly: a
    strong reference would close a cycle through the parameters' C++ autograd metadata that the
    garbage collector cannot see (autopar/runtime/gradients/grad_sync.py ``_Overlap``)."""
    me = weakref.ref(policy)
    for unit in layout.units:
        for x in unit.names:
            if params[x].requires_grad:
                params[x].register_post_accumulate_grad_hook(functools.partial(_hook, me, unit, x))


def _adopted(unit: ZeroUnit, grad: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """The unit's buffers made of autograd's own gradient, where the unit is that one parameter and
    the gradient is laid out as its buffer would be (contiguous, unpadded, of the buffer's dtype):
    a matrix past the bucket cap is such a unit, so at scale most are.  Then nothing is copied."""
    seg = unit.segments[0]
    if (grad is None or len(unit.segments) > 1 or len(seg.names) > 1 or seg.padded_numel != seg.numel
            or grad.dtype != dtype or not grad.is_contiguous() or grad.storage_offset() != 0
            or grad.untyped_storage().nbytes() != grad.numel() * grad.element_size()):
        return None
    return [grad.view(-1)]


def _finish(unit: ZeroUnit, outs: list[torch.Tensor], work) -> list[torch.Tensor]:
    """Wait for a unit's reduce-scatter and average its shards in place."""
    if work is not None:
        work.wait()
    if unit.divisor > 1:
        for out in outs:
            out.div_(unit.divisor)
    return outs


class KeptGrads:
    """ZeRO-1's gradients: whole until the step, in flat per-unit buffers (see the module docstring)."""

    def __init__(self, layout: ZeroLayout, params: dict, pieces: list[list[torch.Tensor]], *, mixed: bool,
                 buckets, pipeline, num_microbatches: int, events):
        self.layout, self.params, self.pieces, self.mixed, self.events = layout, params, pieces, mixed, events
        self.bufs: list[list[torch.Tensor] | None] = [None] * len(layout.units)
        self.views: dict[str, torch.Tensor] = {}  # name -> its view of its unit's buffer, while it exists
        # Buckets summed over another axis first (tp partial sums, the tied embedding over pp).
        self.other_buckets = [b for b in buckets if b.axis not in {u.axis for u in layout.units}]
        summed_first = {x for b in self.other_buckets for x in b.params}
        self.early = [u for u in layout.units if not summed_first.intersection(u.names)]
        owner = pipeline.param_chunk() if pipeline is not None else {}
        self._chunks = {u.index: {owner.get(x) for x in u.names} for u in layout.units}
        self._num_microbatches = num_microbatches
        self._backwards: collections.Counter = collections.Counter()
        self._waiting: dict[int, int] | None = None
        self._started: dict[int, tuple] = {}
        self._scattered: set[int] = set()
        _register_hooks(self, layout, params)

    def _buffers(self, unit: ZeroUnit) -> list[torch.Tensor]:
        """The unit's gradient buffers, made (zeroed) at its first gradient of the step: until then
        backward's activations have the memory (the cost model prices the unit's buffer beside the
        LM head's gradient when backward begins).  Without mixed precision the parameters' ``.grad``
        become views of it, into which autograd then accumulates in place."""
        bufs = self.bufs[unit.index]
        if bufs is None:
            device = self.params[unit.names[0]].device
            dtype = torch.float32 if self.mixed else unit.dtype  # mixed precision: fp32 main gradients
            bufs = _adopted(unit, self.params[unit.names[0]].grad, dtype)
            if bufs is not None:  # the parameter's gradient is the buffer
                self.bufs[unit.index] = bufs
                self.views[unit.names[0]] = self.params[unit.names[0]].grad
                return bufs
            bufs = self.bufs[unit.index] = [seg.new_buffer(dtype, device, zero=True) for seg in unit.segments]
            for seg, b in zip(unit.segments, bufs):
                for x, view in seg.views(b).items():
                    self.views[x] = view
                    p = self.params[x]
                    if p.grad is not None:  # the gradient that triggered it, or one assigned past the hooks
                        view.add_(p.grad)
                    if not self.mixed:
                        p.grad = view
        return bufs

    # --- backward -------------------------------------------------------------------------

    def arm(self, last: bool) -> None:
        """A flat micro-batch begins; in the ``last`` one a unit's reduce-scatter starts from the
        hooks once backward has made all its gradients."""
        self._waiting = ({u.index: sum(self.params[x].requires_grad for x in u.names) for u in self.early}
                         if last else None)

    def disarm(self) -> None:
        self._waiting = None

    def grad_ready(self, unit: ZeroUnit, name: str, param: torch.Tensor) -> None:
        if self.bufs[unit.index] is None:
            self._buffers(unit)  # folds this gradient in
        else:
            self._fold(name, param)
        if self.mixed:
            param.grad = None
        if self._waiting is not None and unit.index in self._waiting:
            self._waiting[unit.index] -= 1
            if self._waiting[unit.index] == 0:
                self._start(unit)

    def _fold(self, name: str, param: torch.Tensor) -> None:
        """A gradient that is not the buffer's view (mixed precision's bf16 one, or one assigned anew) added in."""
        view = self.views[name]
        if param.grad is not None and param.grad is not view:
            view.add_(param.grad)  # in fp32 under mixed precision: the bf16 operand is widened exactly
            param.grad = None if self.mixed else view

    def after_backward(self, chunk: int | None, kind: str) -> None:
        """After a backward (``chunk`` None: a flat micro-batch's): gradients assigned past the hooks
        (a tied copy's, torch's split weight backward) are folded; under pp, once every chunk holding
        an early unit has run all its micro-batches' backward, the unit's reduce-scatter starts."""
        for unit in self.layout.units:
            if any(self.params[x].grad is not None and self.params[x].grad is not self.views.get(x)
                   for x in unit.names):
                if self.bufs[unit.index] is None:
                    self._buffers(unit)
                for x in unit.names:
                    self._fold(x, self.params[x])
        if chunk is None or kind == "input":
            return
        self._backwards[chunk] += 1
        if self._backwards[chunk] != self._num_microbatches:
            return
        done = {c for c, k in self._backwards.items() if k >= self._num_microbatches}
        for unit in self.early:
            if unit.index not in self._started and unit.index not in self._scattered and self._chunks[unit.index] <= done:
                self._start(unit)

    def _start(self, unit: ZeroUnit) -> None:
        bufs = self._buffers(unit)  # a unit without gradients reduces zeros
        outs = [seg.rank_piece(b, unit.rank) for seg, b in zip(unit.segments, bufs)]
        if self.events is not None:
            self.events.append(("reduce_scatter", unit.index))
        self._started[unit.index] = (outs, scatter_unit(unit, outs, bufs, async_op=True))
        while len(self._started) > ZERO_SCATTERS_IN_FLIGHT:  # the oldest first (dicts keep insertion order)
            oldest = next(iter(self._started))
            _finish(self.layout.units[oldest], *self._started.pop(oldest))
            self._scattered.add(oldest)

    def in_flight(self) -> int:
        return len(self._started)

    def _finish_started(self) -> None:
        for index, (outs, work) in list(self._started.items()):
            _finish(self.layout.units[index], outs, work)
            self._scattered.add(index)
        self._started.clear()

    def reset(self) -> None:
        """Drop the step's gradients (a failed micro-batch, a V-shaped schedule's evaluation)."""
        for _, work in self._started.values():
            if work is not None:
                work.wait()
        self._started.clear()
        self.after_step()

    # --- the step ---------------------------------------------------------------------------

    def sync(self) -> None:
        """Partial gradients summed over their axes (whole), then every unit reduce-scattered (those
        started in backward waited for); the shards' gradients are views of the reduced pieces."""
        for unit in self.layout.units:
            self._buffers(unit)
        for bucket in self.other_buckets:
            all_reduce_grads([self.views[x] for x in bucket.params], bucket.axis, self.layout.groups)
        self._finish_started()
        for unit in self.layout.units:
            if unit.index not in self._scattered:
                self._start(unit)
        self._finish_started()
        for unit, bufs, pieces in zip(self.layout.units, self.bufs, self.pieces):
            for seg, b, piece in zip(unit.segments, bufs, pieces):
                piece.grad = seg.rank_piece(b, unit.rank)

    def scale(self, coef: float) -> None:
        """Every gradient held, reduced or not (the reduced shards are views of the buffers)."""
        self._finish_started()
        for bufs in self.bufs:
            for b in bufs or ():
                b.mul_(coef)

    def after_step(self) -> None:
        """The buffers dropped (with the parameters' views of them): made again by the next backward."""
        for unit in self.layout.units:
            if self.bufs[unit.index] is not None and not self.mixed:
                for x in unit.names:
                    self.params[x].grad = None
        self.bufs = [None] * len(self.layout.units)
        self.views.clear()
        self._scattered.clear()
        self._backwards.clear()

    def memory_tensors(self) -> list[torch.Tensor]:
        """Gradients held beyond the parameters' ``.grad`` (under mixed precision the fp32 buffers)."""
        return [b for bufs in self.bufs if bufs is not None for b in bufs] if self.mixed else []


class ScatteredGrads:
    """ZeRO-2's gradients: per-unit buffers only while their reduce-scatter runs (see the module docstring)."""

    def __init__(self, layout: ZeroLayout, params: dict, pieces: list[list[torch.Tensor]], *, mixed: bool, events):
        self.layout, self.params, self.pieces, self.mixed, self.events = layout, params, pieces, mixed, events
        self._filling: dict[int, tuple[list, dict, int]] = {}  # unit -> (buffers, views, gradients to come)
        self._in_flight: collections.deque = collections.deque()  # (unit, outs, buffers, work)
        self._started: set[int] = set()  # units scattered in this backward
        _register_hooks(self, layout, params)

    def grad_ready(self, unit: ZeroUnit, name: str, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if unit.index not in self._filling:
            adopted = _adopted(unit, param.grad, torch.float32 if self.mixed else unit.dtype)
            if adopted is not None:  # the parameter's gradient is the unit's buffer: scattered as it is
                param.grad = None
                self._filling[unit.index] = (adopted, {}, 0)
                self._start(unit)
                return
        bufs, views, left = self._filling.get(unit.index) or self._new_buffers(unit)
        views[name].copy_(param.grad)
        param.grad = None
        self._filling[unit.index] = (bufs, views, left - 1)
        if left - 1 == 0:
            self._start(unit)

    def _new_buffers(self, unit: ZeroUnit) -> tuple[list, dict, int]:
        dtype = torch.float32 if self.mixed else unit.dtype  # mixed precision reduces in fp32
        device = self.params[unit.names[0]].device
        bufs = [seg.new_buffer(dtype, device, zero=True) for seg in unit.segments]
        views = {x: v for seg, b in zip(unit.segments, bufs) for x, v in seg.views(b).items()}
        return bufs, views, sum(self.params[x].requires_grad for x in unit.names)

    def _start(self, unit: ZeroUnit) -> None:
        bufs, _, _ = self._filling.pop(unit.index, None) or self._new_buffers(unit)
        outs = [seg.rank_piece(b, unit.rank) for seg, b in zip(unit.segments, bufs)]
        if self.events is not None:
            self.events.append(("reduce_scatter", unit.index))
        self._started.add(unit.index)
        self._in_flight.append((unit, outs, bufs, scatter_unit(unit, outs, bufs, async_op=True)))
        while len(self._in_flight) > ZERO_SCATTERS_IN_FLIGHT:
            self._finish(*self._in_flight.popleft())

    def in_flight(self) -> int:
        return len(self._in_flight)

    def _finish(self, unit: ZeroUnit, outs: list, bufs: list, work) -> None:
        """The reduced shards added to the shards' gradients; the unit's buffers are then freed."""
        for piece, out in zip(self.pieces[unit.index], _finish(unit, outs, work)):
            if piece.grad is None:
                piece.grad = out.clone()
            else:
                piece.grad.add_(out)

    def flush(self, units) -> None:
        """The end of a backward over ``units``: each unit not yet scattered in it is (with zeros for
        the gradients it did not get), and every reduce-scatter in flight is waited for."""
        for unit in units:
            if unit.index not in self._started:
                self._start(unit)
            self._started.discard(unit.index)
        while self._in_flight:
            self._finish(*self._in_flight.popleft())

    def after_backward(self, chunk: int | None, kind: str) -> None:
        """A flat micro-batch's backward (``chunk`` None) or a pipeline chunk's that made weight gradients."""
        if kind == "input":
            return
        units = self.layout.units if chunk is None else self.layout.chunk_units(chunk)
        for unit in units:  # gradients assigned past the hooks: torch's split weight backward (zbv) sets .grad
            for x in unit.names:
                p = self.params[x]
                if p.grad is not None and unit.index not in self._started:
                    self.grad_ready(unit, x, p)
        self.flush(units)

    def reset(self) -> None:
        while self._in_flight:
            _, _, _, work = self._in_flight.popleft()
            if work is not None:
                work.wait()
        self._filling.clear()
        self._started.clear()
        for pieces in self.pieces:
            for piece in pieces:
                piece.grad = None

    def sync(self) -> None:
        """Partial gradients (their own segments) summed over their axes on the shards, one call per axis."""
        self.flush([])
        parts = [piece for u, pieces in zip(self.layout.units, self.pieces)
                 for seg, piece in zip(u.segments, pieces) if seg.partial and piece.grad is not None]
        for axis in self.layout.partial_axes:
            if parts and self.layout.groups[axis].size > 1:
                all_reduce_grads([p.grad for p in parts], axis, self.layout.groups, "partial gradient shards")

    def scale(self, coef: float) -> None:
        self.flush([])
        for pieces in self.pieces:
            for piece in pieces:
                if piece.grad is not None:
                    piece.grad.mul_(coef)

    def after_step(self) -> None:
        """The shards' gradients are dropped with the optimizer's ``zero_grad``."""

    def memory_tensors(self) -> list[torch.Tensor]:
        return ([p.grad for pieces in self.pieces for p in pieces if p.grad is not None]
                + [b for bufs, _, _ in self._filling.values() for b in bufs])
