"""ZeRO-1/2/3 over the ``dp`` axis (``dp*cp`` under cp): the gradient-sync strategy that shards state.

:class:`ZeroSync` replaces :class:`autopar.runtime.grad_sync.GradSync` when ``plan.zero > 0``;
both implement :class:`autopar.runtime.sync_protocol.GradientSynchronizer`, the only interface
the runtime calls: ``microbatch()`` around each micro-batch's forward and backward, ``sync()``
and ``step()`` once per step, ``full_parameters()`` around reading or writing whole
parameters, and so on.

The strategy is split by concern over four modules:

* :mod:`autopar.runtime.zero_units`: the units (the parameters flattened together), their
  flat ``[A | B]`` layouts (:mod:`autopar.runtime.flat_layout`), the fp32 ``dp`` shards the
  optimizer steps, and the all-gather / reduce-scatter of one unit;
* :mod:`autopar.runtime.zero_grads`: ZeRO-1/2, gradients reduce-scattered into the shards and
  the updated shards gathered back into the parameters;
* :mod:`autopar.runtime.zero_params`: ZeRO-3, parameters gathered per unit while the program
  runs (prefetched), never kept for backward, re-gathered there;
* this module: :class:`ZeroSync`, the protocol's entry points, whole-parameter access and the
  optimizer state per parameter.

Padding is zero when every segment's element count is divisible by ``dp`` (true for every
test model), and then the bytes equal the cost model's ``P*w/dp`` terms exactly; otherwise
each call moves the padded size.  Bytes are recorded by
:func:`autopar.ops.collectives.record`, with the cost model's phases.

Overlap, as Megatron's distributed optimizer (the cost model's ``zero_overlap``, on by default):
ZeRO-2 starts a unit's reduce-scatter from its gradients' hooks during every micro-batch's
backward, ZeRO-1 during the last one's (under pp once the unit's chunks have run their last
backward), ZeRO-3 from the unit's gather's backward; ZeRO-1's are waited for in ``sync()``.
ZeRO-1/2's after-step all-gathers start asynchronously at the end of ``step()``, one per unit, and
each is waited for right before the next forward first reads one of its unit's parameters (a
torch-function mode that watches the calls' arguments while gathers are in flight; why not a
graph node as ZeRO-3's: :mod:`autopar.runtime.zero_grads`).  Every other reader or writer of the
parameters -- ``full_parameters`` (state dicts, checkpoints, loads), ``read_parameters``
(exports), ``write_parameter``, ``forward_only`` (evaluation) -- first waits for all of them
(:meth:`ShardedGradients.await_parameters`), and the end of the micro-batch or pipelined step
waits for any its forward did not read.  Code that reads ``pm.gm``'s parameters directly, outside
these, between two steps must call :meth:`ShardedGradients.await_parameters` first.

Under pp, ZeRO-1's reduce-scatters start from ``after_backward``, which the pipelined executor
calls when it moves gradients itself (mixed precision, a tied copy; runtime/pipelined.py
``_fold``); in fp32 without a tied copy torch's schedule divides ``.grad`` by the micro-batch
count after its last action, so the reduce-scatters run in ``sync()``, after it.

Mixed precision (:mod:`autopar.runtime.precision`): the shards are cut from the user's fp32
tensors and are the master weights; the module's parameters (ZeRO-1/2) and every
gathered unit are bf16 (gathers move 2 B per element), gradients are widened to fp32
before they are reduce-scattered (4 B), and ZeRO-1 folds each micro-batch's bf16
gradients into fp32 main gradients, so accumulation is fp32 under every ZeRO stage.

Why not FSDP2 or ``ZeroRedundancyOptimizer``: ``fully_shard`` wraps ``nn.Module``s and
their parameters as DTensors on a mesh, while our program is one flattened FX graph whose
parameters are plain local tensors already cut by the TP pass, and whose every collective
must be recorded with its bytes; ``ZeroRedundancyOptimizer`` shards whole parameters
(uneven per rank, so bytes never match ``P/dp``) and broadcasts instead of all-gathering.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from autopar.ops.step import activate, current
from autopar.runtime import fused_step
from autopar.runtime.flat_layout import FlatLayout
from autopar.runtime.zero_grads import ShardedGradients
from autopar.runtime.zero_params import ShardedParameters

__all__ = ["ZeroSync", "FlatLayout"]  # FlatLayout: autopar.runtime.flat_layout


class ZeroSync(ShardedParameters, ShardedGradients):
    """ZeRO stage ``zero_stage`` (1, 2 or 3) on the ``dp`` axis (see the module docstring); a
    :class:`autopar.runtime.sync_protocol.GradientSynchronizer`."""

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer, zero_stage: int,
                 originals: dict[str, torch.Tensor] | None = None):
        super().__init__(gm, program, buckets, groups, make_optimizer, zero_stage, originals)
        self._init_sharded_gradients(program.plan.mb)
        self._init_sharded_parameters()
        self._scattered_early: set[int] = set()  # ZeRO-1 under pp: units scaled before sync() (scale_grads)
        if zero_stage in (1, 2):
            self._hook_gradients(dict(gm.named_parameters()))
        if zero_stage == 3:
            self._free_parameters()

    # --- runtime entry points ---------------------------------------------------------

    @contextlib.contextmanager
    def microbatch(self, last: bool = False, defer_scatter: bool = True) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward (``last``: the step's last, whose backward
        starts ZeRO-1's reduce-scatters).  ``defer_scatter``: ZeRO-3 overlaps each unit's
        reduce-scatter with backward (:meth:`scatter_in_backward`).  ZeRO-1/2: the previous
        step's all-gathers are waited for at their units' first use (:meth:`first_use`)."""
        if self.zero_stage < 3:
            with self.first_use(), self._scattering_microbatch(last):
                yield
            return
        self._defer_scatter = defer_scatter
        try:
            with activate(current(), zero=self), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._finish_deferred()
            self._defer_scatter = False
            self._live.clear()
            self._regathered.clear()
            self._drain_prefetched()

    @contextlib.contextmanager
    def _scattering_microbatch(self, last: bool) -> Iterator[None]:
        """ZeRO-1/2's micro-batch: reduce-scatters started from the gradients' hooks in its backward
        (ZeRO-2: every micro-batch's, waited for after it; ZeRO-1: the last one's, waited for in
        :meth:`sync`)."""
        if self.zero_stage == 2 or last:
            self._count_waiting()
        try:
            yield
        except BaseException:
            self._drop_started()
            raise
        finally:
            self._waiting = None
        self._event("backward_end")
        self.after_backward()
        if self.zero_stage == 2:
            for unit in range(len(self.units)):
                self._scatter_param_grads(unit)

    @contextlib.contextmanager
    def pipeline_step(self) -> Iterator[None]:
        """Wrap a pipelined step (every action of this rank's chunks): ZeRO-3 gathers inside it;
        ZeRO-1/2 wait for the previous step's all-gathers at first use (:meth:`first_use`)."""
        if self.zero_stage < 3:
            # A V-shaped schedule's evaluation runs a whole step and drops its gradients: what its
            # backward started is dropped here, before this step's backward starts anew.
            self._drop_started()
            self._scattered_early.clear()
            self._backwards.clear()
            with self.first_use():
                yield
            return
        with self.microbatch(defer_scatter=False):
            yield

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """After a backward: the flat micro-batch's (``chunk`` None), or the pipeline action
        ``kind`` of pipeline chunk ``chunk`` (``full``, ``input``, ``weight`` or torch's ``inference``).

        ZeRO-1 with mixed precision folds the bf16 gradients into fp32 main gradients; under
        pp ZeRO-1 starts the reduce-scatters of the units whose chunks have all run their last
        backward (:meth:`_chunk_backward_done`), ZeRO-2 reduce-scatters the chunk's units once its
        weight gradients exist, and
        ZeRO-3 drops the chunk's re-gathered units once its weight gradients exist (an input-only
        backward keeps them for the weight half, which reads some of them again)."""
        if kind == "inference":  # torch's first-step shape inference: no parameter gradient made
            self._regathered.clear()
            return
        if chunk is not None and self.zero_stage == 2 and kind != "input":
            for unit in self._chunk_units(chunk):
                self._scatter_param_grads(unit)
        if chunk is not None and self.zero_stage == 3 and kind != "input":
            # The weight half of a split backward re-reads what its input half re-gathered.
            for unit in self._chunk_units(chunk):
                self._regathered.pop(unit, None)
        if self.mixed and self.zero_stage == 1:
            self._fold_main_grads()
        if chunk is not None and self.zero_stage == 1 and kind != "input":
            self._chunk_backward_done(chunk)

    def sync(self) -> None:
        """Gradients into their reduced ``dp`` shards (partial sums summed over their axes); ZeRO-1
        waits for the reduce-scatters its last backward started and runs the others."""
        if self.zero_stage == 1:
            self._all_reduce_partial_full()
            for unit in range(len(self.units)):
                if unit not in self._scattered_early:
                    self._scatter_param_grads(unit)
            self._scattered_early.clear()
        else:
            self._all_reduce_partial_shards()

    def step(self) -> None:
        """The optimizer step on the shards; ZeRO-1/2 gather the updated parameters back."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.zero_stage < 3:
            self._gather_into_params()

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """An evaluation forward: ZeRO-3 gathers its units, nothing is scattered or kept; ZeRO-1/2
        wait for the after-step all-gathers first."""
        if self.zero_stage < 3:
            self.await_parameters()
            yield
            return
        try:
            with activate(current(), zero=self):
                yield
        finally:
            self._live.clear()
            self._drain_prefetched()

    def grad_square_sum(self, weights: dict[str, float], device: torch.device) -> torch.Tensor:
        """Sum of ``weights[name] * dp * grad^2`` over the elements of this rank's shards: each
        rank's shard is a distinct ``1/dp`` of the unit (padding is zero)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for unit, (shard, lay) in enumerate(zip(self.shards, self.layouts)):
            if shard.grad is None:
                continue
            grad = shard.grad.detach().double()
            for name, start, stop in lay.shard_segments(self._rank(unit)):
                total += weights[name] * lay.n * grad[start:stop].square().sum()
        return total

    def scale_grads(self, coef: float) -> None:
        """Every gradient held: the shards', and ZeRO-1's not yet scattered ones (the module's, or
        the fp32 main gradients).  ZeRO-1's reduce-scatters in flight (under pp this runs before
        :meth:`sync`) are waited for first: their sources were cut before the scaling."""
        if self.zero_stage == 1 and self._started:
            self._scattered_early.update(self._started)
            self._finish_started()
        held = [p.grad for p in self.gm.parameters()] + list(self.main_grads.values())
        for grad in [s.grad for s in self.shards] + held:
            if grad is not None:
                grad.mul_(coef)

    # --- whole parameters -----------------------------------------------------------------

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Graph name -> the whole (tp-local) parameter while the block runs: the module's
        parameters, or under mixed precision the fp32 masters gathered from the shards;
        ``write_back`` re-cuts the shards from them (and refreshes the bf16 parameters)."""
        self.await_parameters()
        if self.mixed:
            yield from self._full_masters(write_back)
            return
        if self.zero_stage == 3:
            with torch.no_grad():
                for unit, lay in enumerate(self.layouts):
                    flat = self._all_gather(unit, self.shards[unit].detach(), None)
                    for x, v in lay.views(flat).items():
                        self.gm.get_parameter(x).data = v.clone()
        values = {x: self.gm.get_parameter(x) for u in self.units for x in u}
        try:
            yield values
        finally:
            if write_back:
                self._recut_shards(values)
            if self.zero_stage == 3:
                self._free_parameters()

    def _full_masters(self, write_back: bool):
        values = {}
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                flat = self._all_gather(unit, self.shards[unit].detach(), None, dtype=torch.float32)
                values.update({x: v.clone() for x, v in lay.views(flat).items()})
        yield values
        if write_back:
            self._recut_shards(values)
            if self.zero_stage < 3:
                with torch.no_grad():
                    for x, v in values.items():
                        self.gm.get_parameter(x).copy_(v)

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` to ``value`` (its tp-local shape): this rank's piece of it in
        its unit's shard (the master under mixed precision) and, under ZeRO-1/2, the module's
        parameter; nothing is gathered (loading weights one tensor at a time)."""
        self.await_parameters()  # a gather still in flight would overwrite the value later
        unit = self._unit_of.get(name)
        with torch.no_grad():
            if unit is None or self.zero_stage < 3:  # a parameter outside every unit (frozen), or held whole
                self.gm.get_parameter(name).copy_(value)
            if unit is None:
                return
            flat = value.reshape(-1)
            shard = self.shards[unit]
            for x, start, stop, offset in self.layouts[unit].shard_pieces(self._rank(unit)):
                if x == name:
                    shard[start:stop].copy_(flat[offset:offset + stop - start])

    def read_parameters(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, value)`` for each graph parameter of ``names`` (its tp-local shape; the fp32
        master under mixed precision).  A unit's shards are all-gathered (collective: every rank
        of the unit's axis calls it with the same names) once for its names that follow each
        other, and dropped before the next unit's: at most one unit is held whole."""
        self.await_parameters()
        held: tuple[int, dict] | None = None
        for name in names:
            unit = self._unit_of.get(name)
            if unit is None or (self.zero_stage < 3 and not self.mixed):
                yield name, self.gm.get_parameter(name).detach()
                continue
            if held is None or held[0] != unit:
                held = None
                with torch.no_grad():
                    dtype = torch.float32 if self.mixed else None
                    flat = self._all_gather(unit, self.shards[unit].detach(), None, dtype=dtype)
                    held = (unit, self.layouts[unit].views(flat))
            yield name, held[1][name]

    # --- what checkpoints and the memory meter read ------------------------------------

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Graph parameter name -> {state key: tp-local tensor}: each unit's shards gathered over dp."""
        out: dict[str, dict] = {}
        for unit, (shard, lay) in enumerate(zip(self.shards, self.layouts)):
            for key, value in self.optimizer.state.get(shard, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    for x in lay.names:
                        out.setdefault(x, {})[key] = value
                    continue
                buf = value.detach().contiguous()
                if lay.n > 1:
                    full = torch.empty(lay.n * lay.shard_numel, dtype=buf.dtype, device=buf.device)
                    dist.all_gather_single(full, buf, group=self.groups[self.unit_axes[unit]].group)
                    buf = full
                for x, v in lay.views(lay.from_rank_major(buf)).items():
                    out.setdefault(x, {})[key] = v.clone()
        return out

    def load_optimizer_state(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`optimizer_state`: cut this rank's dp shard of every unit's state."""
        for unit, (shard, lay) in enumerate(zip(self.shards, self.layouts)):
            per_name = {x: entries.get(x, {}) for x in lay.names}
            keys = set.intersection(*(set(e) for e in per_name.values()))
            new = {}
            for key in sorted(keys):
                first = per_name[lay.names[0]][key]
                if first.dim() == 0:
                    new[key] = first.clone()
                    continue
                flat = lay.rank_major(lay.flatten({x: per_name[x][key].to(shard.device) for x in lay.names}))
                new[key] = flat.view(lay.n, -1)[self._rank(unit)].clone().to(shard.dtype)
            if new:  # the scalar step on the shard's device where the optimizer is fused
                self.optimizer.state[shard] = fused_step.place_state(self.optimizer, shard, new)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat fp32 shards: parameters under ZeRO-3, master copies under ZeRO-1/2 and
        under mixed precision (whose ZeRO-3 shards are masters and parameter shards at once)."""
        masters = self.mixed or self.zero_stage in (1, 2)
        return {"params": list(self.shards) if not masters else [],
                "master_params": list(self.shards) if masters else [],
                "grads": [s.grad for s in self.shards if s.grad is not None] + list(self.main_grads.values())}
