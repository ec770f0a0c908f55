"""ZeRO-1/2: gradients reduce-scattered into the units' ``dp`` shards, on which the optimizer
steps; the updated shards are all-gathered back into the module's parameters.

:class:`ShardedGradients` is the part of :class:`autopar.runtime.zero.ZeroSync` that moves
gradients into shards (its units, layouts and collectives: :class:`autopar.runtime.zero_units.ZeroUnits`):

* ZeRO-1: gradients accumulate whole over the micro-batches; in the last micro-batch's
  backward a unit's reduce-scatter (phase ``grad``) starts, asynchronously, once all its
  gradients exist (the hooks of ZeRO-2 below, armed in that backward only; under pp once every
  chunk holding the unit has run its last backward action, :meth:`ShardedGradients._chunk_backward_done`),
  and ``sync()`` waits for it.  A unit with a gradient that is first summed over another axis
  (partial over ``tp`` under SP, the tied embedding over ``pp``) waits for that all-reduce
  (:meth:`ShardedGradients._all_reduce_partial_full`) and is reduce-scattered in ``sync()``;
  under mixed precision each micro-batch's bf16 gradients are first folded into fp32 main
  gradients (:meth:`ShardedGradients._fold_main_grads`);
* ZeRO-2: each micro-batch's gradients are reduce-scattered during its backward (a unit's
  reduce-scatter starts from its gradients' hooks once all of them exist, and is waited for at
  the micro-batch's end) and the full gradients freed (accumulation happens in the shards);
  partial gradients are summed over their axis once per step on the ``B`` shards
  (:meth:`ShardedGradients._all_reduce_partial_shards`; sum and scatter commute);
* both: after the optimizer step the updated shards' all-gathers (phase ``step``) start,
  asynchronously, one per unit (:meth:`ShardedGradients._gather_into_params`); each is waited
  for, and copied into the module's parameters, when the next forward first reads one of the
  unit's parameters (:meth:`ShardedGradients.first_use`), or before anything else reads or
  writes parameters (:meth:`ShardedGradients.await_parameters`).

Why the wait at first use is found at run time, not by a node in the graph as ZeRO-3's
``zero_gather``: ZeRO-1/2 programs are ZeRO-0's graph (no pass rewrites them; their views, byte
predictions and the compiled program stay those of plain dp), and the same Parameter objects
are read by the flat graph, by torch's pipeline stages and by a compiled copy of the graph.
So a torch-function mode (:class:`_FirstUse`), active only while gathers are in flight, looks
at each call's tensor arguments and waits for the unit of a parameter it meets, before the
call runs: the first op reading a unit (its layer's first matmul, the embedding lookup) waits
for exactly that unit, while the later units' gathers keep running.  Whatever is still in
flight when the micro-batch (or pipelined step) ends is waited for then.

Event recording (for tests, off by default): set ``events`` to a list and the strategy appends
``(kind, unit)`` as it starts reduce-scatters (``reduce_scatter``), ends a micro-batch's
backward (``backward_end``, unit None), starts all-gathers (``all_gather``), begins a
micro-batch with gathers in flight (``forward_begin``, unit: how many) and waits for one
(``all_gather_wait``).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from autopar.ops import collectives
from autopar.runtime.zero_units import ZeroUnits

__all__ = ["ShardedGradients"]


class ShardedGradients(ZeroUnits):
    """Gradients into the units' shards, updated shards back into the parameters (ZeRO-1/2)."""

    def _init_sharded_gradients(self, microbatches: int) -> None:
        self.main_grads: dict[str, torch.Tensor] = {}  # ZeRO-1, mixed: fp32 accumulated gradients
        # ZeRO-2 in a flat micro-batch, ZeRO-1 in the last one: unit -> its parameters still
        # without this backward's gradient (None outside one), and unit -> its reduce-scatter
        # started from their hooks (or, under pp, after its chunks' last backward).
        self._waiting: dict[int, int] | None = None
        self._started: dict[int, tuple] = {}
        # ZeRO-1: the units whose reduce-scatter may start in backward: none of their gradients is
        # first all-reduced over another axis (the buckets ``_all_reduce_partial_full`` runs).
        summed_first = {x for b in self.buckets if b.axis not in self.unit_axes for x in b.params}
        self._early = [u for u, names in enumerate(self.units) if not summed_first.intersection(names)]
        # ZeRO-1 under pp: each unit's chunks, and the backward actions each chunk ran this step.
        owner = self.pipeline.param_chunk() if self.pipeline is not None else {}
        self._unit_chunk_sets = [{owner.get(x) for x in names} for names in self.units]
        self._backwards: collections.Counter = collections.Counter()
        self._microbatches = microbatches
        # ZeRO-1/2 after the step: unit -> its all-gather in flight (buffer, work, source), and
        # id(parameter) -> its unit while that runs (what the first-use mode looks for).
        self._gathering: dict[int, tuple] = {}
        self._gathering_params: dict[int, int] = {}
        self.events: list | None = None  # tests: see the module docstring

    def _hook_gradients(self, params: dict) -> None:
        """ZeRO-1/2: start a unit's reduce-scatter once backward has made all its gradients, so it
        runs while backward computes the units before it (as DDP's buckets do; armed by
        :meth:`_count_waiting` in the backwards that start them).  The hooks hold
        a weak reference: a strong one would close a cycle through the parameters' C++ autograd
        metadata that the garbage collector cannot see (autopar/runtime/grad_sync.py ``_Overlap``)."""
        me = weakref.ref(self)
        for unit, names in enumerate(self.units):
            for x in names:
                if params[x].requires_grad:
                    params[x].register_post_accumulate_grad_hook(functools.partial(_unit_grad_ready, me, unit))

    def _count_waiting(self) -> None:
        """A flat micro-batch begins whose backward starts reduce-scatters (every one under ZeRO-2,
        the last one under ZeRO-1): each unit waits for all its parameters' gradients."""
        units = range(len(self.units)) if self.zero_stage == 2 else self._early
        self._waiting = {u: sum(self.gm.get_parameter(x).requires_grad for x in self.units[u]) for u in units}

    def _unit_grad_ready(self, unit: int) -> None:
        """A gradient of ``unit`` was accumulated (hook); the last one starts its reduce-scatter."""
        if self._waiting is None or unit not in self._waiting:  # not armed (pipelined: after_backward)
            return
        self._waiting[unit] -= 1
        if self._waiting[unit] == 0:
            self._start_unit_scatter(unit)

    def _start_unit_scatter(self, unit: int) -> None:
        """Start the unit's reduce-scatter of its final gradients (waited for by ``_scatter_param_grads``)."""
        lay = self.layouts[unit]
        if self.mixed and self.zero_stage == 1:  # this backward's bf16 gradients into the fp32 ones first
            self._fold_main_grads(lay.names)
        grads = {x: self._grad(x, self.gm.get_parameter(x)) for x in lay.names}
        self._event("reduce_scatter", unit)
        self._started[unit] = self._start_reduce_scatter(unit, lay.flatten(grads), async_op=True)

    def _chunk_backward_done(self, chunk: int) -> None:
        """ZeRO-1 under pp: a backward action of ``chunk`` that made weight gradients ran; once every
        chunk holding a unit has run all its micro-batches' (the last one's gradients are final),
        the unit's reduce-scatter starts, while the rank's other chunks still run backward."""
        self._backwards[chunk] += 1
        if self._backwards[chunk] != self._microbatches:
            return
        done = {c for c, k in self._backwards.items() if k >= self._microbatches}
        for unit in self._early:
            if unit not in self._started and self._unit_chunk_sets[unit] <= done:
                self._start_unit_scatter(unit)

    def _finish_started(self) -> None:
        """Wait for every reduce-scatter started in backward; their results into the shards' gradients."""
        for unit in list(self._started):
            self._scatter_param_grads(unit)

    def _event(self, kind: str, unit: int | None = None) -> None:
        if self.events is not None:
            self.events.append((kind, unit))

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

    def _fold_main_grads(self, names=None) -> None:
        """ZeRO-1 with mixed precision: this backward's bf16 gradients (of ``names``, or all) into
        the fp32 main gradients."""
        for x in names if names is not None else [x for x, _ in self.gm.named_parameters()]:
            p = self.gm.get_parameter(x)
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
        """ZeRO-1/2 after the step: the updated shards' all-gathers started, one per unit (a unit of
        one rank, or on the meta device, is copied now); each lands in the module's parameters
        when it is waited for (:meth:`_await_unit`)."""
        self.await_parameters()  # (none in flight: a step follows a forward, which waited)
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                shard = self.shards[unit]
                if lay.n == 1 or shard.is_meta:
                    self._copy_into_params(unit, self._all_gather(unit, shard, "step"))
                    continue
                self._event("all_gather", unit)
                self._gathering[unit] = self._start_gather(unit, shard, "step", async_op=True)
                for x in lay.names:
                    self._gathering_params[id(self.gm.get_parameter(x))] = unit

    def _copy_into_params(self, unit: int, flat: torch.Tensor) -> None:
        for x, v in self.layouts[unit].views(flat).items():
            self.gm.get_parameter(x).copy_(v)

    def _await_unit(self, unit: int) -> None:
        """Wait for the unit's after-step all-gather and copy it into the module's parameters."""
        buf, work, _src = self._gathering.pop(unit)
        for x in self.layouts[unit].names:
            self._gathering_params.pop(id(self.gm.get_parameter(x)), None)
        work.wait()
        self._event("all_gather_wait", unit)
        with torch.no_grad():
            self._copy_into_params(unit, self.layouts[unit].from_rank_major(buf))

    def await_parameters(self) -> None:
        """Wait for every after-step all-gather still in flight: called by each path that reads or
        writes the module's parameters other than the next forward (state dicts, checkpoints,
        exports, evaluation, ``full_parameters``, ``read_parameters``, ``write_parameter``)."""
        for unit in sorted(self._gathering):
            self._await_unit(unit)

    @contextlib.contextmanager
    def first_use(self) -> Iterator[None]:
        """Around a training micro-batch (or pipelined step): the after-step gathers in flight are
        each waited for when a call first reads one of their unit's parameters (:class:`_FirstUse`),
        and those never read by the time the block ends, then."""
        if not self._gathering:
            yield
            return
        self._event("forward_begin", len(self._gathering))
        try:
            with _FirstUse(self):
                yield
        finally:
            self.await_parameters()


# Tensor attributes and methods that read no values (the strategy's own hooks and counts use
# them): a call to them does not wait.  Any other call does, ``.data`` included -- waiting early
# only costs overlap, a missed wait would read the previous step's values.
_METADATA = frozenset({"requires_grad", "grad", "shape", "dtype", "device", "is_meta", "is_leaf", "grad_fn",
                       "ndim", "dim", "size", "numel", "register_post_accumulate_grad_hook", "register_hook"})


def _reads_values(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: named by its descriptor
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name not in _METADATA


class _FirstUse(TorchFunctionMode):
    """While the block runs, a torch call with a parameter whose unit's after-step all-gather is in
    flight among its arguments (or in a list of them) first waits for that unit.  Only the first
    calls pay: once no gather is left the check is one empty-dict test."""

    def __init__(self, sync: ShardedGradients):
        super().__init__()
        self.sync = sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        pending = self.sync._gathering_params
        if pending and _reads_values(func):
            for arg in (*args, *(kwargs or {}).values()):
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    unit = pending.get(id(t)) if isinstance(t, torch.Tensor) else None
                    if unit is not None:
                        self.sync._await_unit(unit)
        return func(*args, **(kwargs or {}))


def _unit_grad_ready(sync: "weakref.ref[ShardedGradients]", unit: int, param: torch.Tensor) -> None:
    live = sync()
    if live is not None:  # a freed program leaves an inert hook on a parameter kept elsewhere
        live._unit_grad_ready(unit)
