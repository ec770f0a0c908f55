"""ZeRO stages 1-3 over the ``dp`` axis (``dp*cp`` under cp): the gradient-sync strategy that shards state.

:class:`ZeroSync` replaces :class:`autopar.runtime.grad_sync.GradSync` when ``plan.zero > 0``; the
runtime (:mod:`autopar.runtime`) calls the same three entry points on either strategy:
``micro_batch()`` around each micro-batch's forward and backward, ``sync()`` and ``step()``
once per step, and ``full_parameters()`` around reading or writing whole parameters.

Layout.  The parameters of one unit (a ``dp`` gradient bucket of the data-parallel pass for
stages 1-2; one decoder layer, or the rest of the model, for stage 3, as grouped by
``passes/zero.py``) are flattened into one buffer with two segments: ``A``, the ordinary
parameters, and ``B``, those whose gradients are partial sums over another axis (norm
weights under SP, axis ``tp``).  Each segment is zero-padded to a multiple of ``dp`` and
rank ``r`` owns ``[A_r, B_r]``, so a reduce-scatter / all-gather of the rank-major buffer
``[A_0 B_0 | A_1 B_1 | ...]`` moves exactly the padded sizes.  The optimizer (the user's
factory) gets one flat fp32 shard parameter per unit.  Padding is zero when every segment's
element count is divisible by ``dp`` (true for every test model), and then the bytes equal
the cost model's ``P*w/dp`` terms exactly; otherwise each call moves the padded size.

Stages (bytes recorded by :func:`autopar.ops.collectives.record`, phases as in the cost model):
  * 1: after the last micro-batch, partial gradients are all-reduced over their axis, each
    bucket is reduce-scattered (phase ``grad``), the optimizer steps on the shards and the
    updated shards are all-gathered into the parameters (phase ``step``);
  * 2: each micro-batch's gradients are reduce-scattered during its backward (a unit once
    all its gradients exist; waited for at its end) and the full gradients freed
    (accumulation happens in the shards); partial gradients are summed
    over their axis once per step on the ``B`` shards (sum and scatter commute);
  * 3: parameters live only as shards; the graph calls :func:`zero_gather` per unit, which
    all-gathers before first use (phase ``fwd``; the chunk's next unit is prefetched, its
    gather started then and waited for at its own first use); saved-tensor hooks keep no gathered
    parameter for backward but re-gather the unit when backward first needs it (phase
    ``bwd``; the re-gather of the unit backward reaches next is then started, prefetched like
    forward's) and drop it when the unit's gradient is reduce-scattered (phase ``grad``), once
    per unit and micro-batch; in a flat micro-batch that reduce-scatter runs while backward
    computes the next unit's gradients (:meth:`ZeroSync.scatter_in_backward`).  Stage 2 starts
    a unit's reduce-scatter from its gradients' hooks during backward; stage 1's reduce-scatters
    and stages 1-2's after-step all-gathers run blocking.

Mixed precision (:mod:`autopar.runtime.precision`): the shards are cut from the user's fp32
tensors and are the master weights; the module's parameters (stages 1-2) and every
gathered unit are bf16 (gathers move 2 B per element), gradients are widened to fp32
before they are reduce-scattered (4 B), and stage 1 folds each micro-batch's bf16
gradients into fp32 main gradients, so accumulation is fp32 under every stage.

Why not FSDP2 or ``ZeroRedundancyOptimizer``: ``fully_shard`` wraps ``nn.Module``s and
their parameters as DTensors on a mesh, while our program is one flattened FX graph whose
parameters are plain local tensors already cut by the TP pass, and whose every collective
must be recorded with its bytes; ``ZeroRedundancyOptimizer`` shards whole parameters
(uneven per rank, so bytes never match ``P/dp``) and broadcasts instead of all-gathering.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.compat import storage_key, tensor_base
from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops.step import activate, current, observe_saved
from autopar.ops.zero_gather import zero_gather
from autopar.passes.context import META_KEY
from autopar.runtime.flat_layout import FlatLayout

__all__ = ["ZeroSync", "FlatLayout"]  # FlatLayout: autopar.runtime.flat_layout
_HANDLE = object()  # marks a packed saved tensor that is a view of a gathered unit


class ZeroSync:
    """ZeRO stage 1, 2 or 3 on the ``dp`` axis (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer, stage: int,
                 originals: dict[str, torch.Tensor] | None = None):
        self.gm, self.groups, self.stage = gm, groups, stage
        self.mixed = originals is not None  # fp32 masters cut from ``originals``, bf16 parameters
        self.main_grads: dict[str, torch.Tensor] = {}  # stage 1, mixed: fp32 accumulated gradients
        self.buckets = list(buckets)
        ctx = program
        # The ranks holding copies of the dense weights: dp, or dp*cp under cp (Megatron's
        # distributed optimizer shards over the data- and context-parallel ranks alike).
        self.axis = "dp_cp" if "dp_cp" in groups else "dp"
        partial = {x for x, axes in ctx.grad_partial_axes.items() if axes}
        axis_sets = {frozenset(ctx.grad_partial_axes[x]) for x in partial}
        if len(axis_sets) > 1:
            raise AutoparError(f"autopar: ZeRO found gradients partial over different axis sets {sorted(map(sorted, axis_sets))}; "
                               "expected one set; use zero=0 for this plan.")
        self.partial_axes = sorted(next(iter(axis_sets))) if axis_sets else []
        self.partial = partial
        # Each unit is sharded over the ranks holding copies of its parameters: the dense axis, or
        # for experts split over ep the ``edp`` ranks (their gradients averaged by dp*cp all the same).
        self.pipeline = program.pipeline
        params = dict(gm.named_parameters())
        units = self._units(gm, params)
        self.units = [list(u) for u, _, _ in units]
        # Under pp: the chunk each unit belongs to (stage 2 reduce-scatters a chunk's units after
        # its backward); stage 3: the program's unit index -> this rank's (it holds its chunks' units).
        owner = self.pipeline.param_chunk() if self.pipeline is not None else {}
        self.unit_chunks = [owner.get(u[0]) for u in self.units]
        self._local = {g: i for i, g in enumerate(self._global_units)}
        self.unit_axes = [axis for _, axis, _ in units]
        self.unit_divisors = [div for _, _, div in units]
        self._unit_of = {x: unit for unit, names in enumerate(self.units) for x in names}
        self.layouts = [FlatLayout(u, {x: params[x].shape for x in u}, partial if axis == self.axis else set(),
                                   groups[axis].size if axis in groups else 1)
                        for u, axis, _ in units]
        self.shards: list[nn.Parameter] = []
        values = originals if self.mixed else {x: p.detach() for x, p in params.items()}
        for unit, (u, lay) in enumerate(zip(self.units, self.layouts)):
            flat = lay.rank_major(lay.flatten({x: values[x] for x in u}).float())
            shard = flat.view(lay.n, -1)[self._rank(unit)].clone()
            self.shards.append(nn.Parameter(shard, requires_grad=True))
        self.dtypes = [params[u[0]].dtype for u in self.units]
        self.optimizer = make_optimizer(self.shards)
        self._live: dict[tuple, tuple] = {}
        self._regathered: dict[int, torch.Tensor] = {}
        self._prefetched: dict[int, tuple] = {}  # unit -> its forward all-gather in flight
        self._prefetched_bwd: dict[int, tuple] = {}  # unit -> its backward re-gather in flight
        self._defer_scatter = False  # inside a flat micro-batch: reduce-scatters overlap backward
        self._deferred: tuple | None = None  # the reduce-scatter in flight (_start_reduce_scatter)
        # unit -> when forward last saved its parameters for backward (a counter): backward
        # re-gathers the units in the reverse of that order (a tied head's unit comes first).
        self._saved_at: dict[int, int] = {}
        self._clock = itertools.count(1)
        # Stage 2 in a flat micro-batch: unit -> its parameters still without this backward's
        # gradient (None outside one), and unit -> its reduce-scatter started from their hooks.
        self._waiting: dict[int, int] | None = None
        self._started: dict[int, tuple] = {}
        if stage == 2:
            self._hook_gradients(params)
        if stage == 3:
            self._free_parameters()

    def _hook_gradients(self, params: dict) -> None:
        """Stage 2: start a unit's reduce-scatter once backward has made all its gradients, so it
        runs while backward computes the units before it (as DDP's buckets do).  The hooks hold
        a weak reference: a strong one would close a cycle through the parameters' C++ autograd
        metadata that the garbage collector cannot see (autopar/runtime/grad_sync.py ``_Overlap``)."""
        me = weakref.ref(self)
        for unit, names in enumerate(self.units):
            for x in names:
                if params[x].requires_grad:
                    params[x].register_post_accumulate_grad_hook(functools.partial(_unit_grad_ready, me, unit))

    def _units(self, gm, params: dict) -> list[tuple[list[str], str, int | None]]:
        """(parameter names, mesh axis, gradient divisor) per unit, in gather order under stage 3."""
        self._global_units: list[int] = []
        if self.stage == 3:  # per decoder layer, a MoE layer's experts apart (passes/zero.py)
            held = [(g, u) for g, u in _ordered_units(gm) if u[0] in params]  # pp: this rank's chunks
            self._global_units = [g for g, _ in held]
            # Each unit shards over the ranks its gradient bucket reduces over: the dense axis,
            # or for experts split over ep (or tokens over tp) the edp ranks, averaged by dp*cp.
            bucket_of = {x: b for b in self.buckets if b.axis in (self.axis, "edp") for x in b.params}
            out = []
            for _, u in held:
                b = bucket_of.get(u[0])
                out.append((u, b.axis, b.divisor) if b is not None else (u, self.axis, None))
            return out
        units = [(list(b.params), b.axis, b.divisor) for b in self.buckets if b.axis in (self.axis, "edp")]
        if not units:  # dp=1: the data-parallel pass made no dp bucket; one unit, one shard
            units = [([x for x, p in params.items() if p.requires_grad], self.axis, None)]
        if self.stage == 2 and self.pipeline is not None:
            # Each chunk's gradients are scattered after its backward: units split at chunk borders.
            owner = self.pipeline.param_chunk()
            units = [(names, axis, div) for u, axis, div in units for names in _split_by(u, owner)]
        return units

    def chunk_shards(self, chunk: int) -> list[nn.Parameter]:
        """Stage 3 under pp: the flat shards of pipeline chunk ``chunk``'s units (the chunk's real
        parameters, which torch's split weight backward differentiates)."""
        return [self.shards[unit] for unit in self._chunk_units(chunk)] if self.stage == 3 else []

    def _chunk_units(self, chunk: int) -> list[int]:
        """This rank's units that belong to pipeline chunk ``chunk``."""
        return [unit for unit, c in enumerate(self.unit_chunks) if c == chunk]

    def local_unit(self, unit: int) -> int:
        """This rank's index of the program's ZeRO-3 unit ``unit`` (``zero_gather``'s argument)."""
        return self._local[unit]

    def _rank(self, unit: int) -> int:
        axis = self.unit_axes[unit]
        return self.groups[axis].rank if axis in self.groups else 0

    # --- runtime entry points ---------------------------------------------------------

    @contextlib.contextmanager
    def micro_batch(self, last: bool = False, defer_scatter: bool = True) -> Iterator[None]:
        """Wrap one micro-batch's forward and backward (``last``: the step's last; unused).
        ``defer_scatter``: stage 3 overlaps each unit's reduce-scatter with backward
        (:meth:`scatter_in_backward`)."""
        if self.stage < 3:
            if self.stage == 2:
                self._waiting = {u: sum(self.gm.get_parameter(x).requires_grad for x in names)
                                 for u, names in enumerate(self.units)}
            try:
                yield
            except BaseException:
                self._drop_started()
                raise
            finally:
                self._waiting = None
            self.after_backward()
            if self.stage == 2:
                for unit in range(len(self.units)):
                    self._scatter_param_grads(unit)
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
    def pipeline_step(self) -> Iterator[None]:
        """Wrap a pipelined step (every action of this rank's chunks): stage 3 gathers inside it."""
        if self.stage < 3:
            yield
            return
        with self.micro_batch(defer_scatter=False):
            yield

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """After a backward: the flat micro-batch's (``chunk`` None), or the pipeline action
        ``kind`` of chunk ``chunk`` (``full``, ``input``, ``weight`` or torch's ``inference``).

        Stage 1 with mixed precision folds the bf16 gradients into fp32 main gradients; under
        pp stage 2 reduce-scatters the chunk's units once its weight gradients exist, and
        stage 3 drops the chunk's re-gathered units once its weight gradients exist (an input-only
        backward keeps them for the weight half, which reads some of them again)."""
        if kind == "inference":  # torch's first-step shape inference: no parameter gradient made
            self._regathered.clear()
            return
        if chunk is not None and self.stage == 2 and kind != "input":
            for unit in self._chunk_units(chunk):
                self._scatter_param_grads(unit)
        if chunk is not None and self.stage == 3 and kind != "input":
            # The weight half of a split backward re-reads what its input half re-gathered.
            for unit in self._chunk_units(chunk):
                self._regathered.pop(unit, None)
        if not (self.mixed and self.stage == 1):
            return
        for x, p in self.gm.named_parameters():
            if p.grad is not None:
                held = self.main_grads.get(x)
                self.main_grads[x] = p.grad.float() if held is None else held.add_(p.grad)
                p.grad = None

    def sync(self) -> None:
        """Gradients into their reduced ``dp`` shards (partial sums summed over their axes)."""
        if self.stage == 1:
            self._all_reduce_partial_full()
            for unit in range(len(self.units)):
                self._scatter_param_grads(unit)
        else:
            self._all_reduce_partial_shards()

    def step(self) -> None:
        """The optimizer step on the shards; stages 1-2 gather the updated parameters back."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage < 3:
            self._gather_into_params()

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """An evaluation forward: ZeRO-3 gathers its units, nothing is scattered or kept."""
        if self.stage < 3:
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
        """Every gradient held: the shards', and stage 1's not yet scattered ones (the module's, or
        the fp32 main gradients)."""
        held = [p.grad for p in self.gm.parameters()] + list(self.main_grads.values())
        for grad in [s.grad for s in self.shards] + held:
            if grad is not None:
                grad.mul_(coef)

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Graph name -> the whole (tp-local) parameter while the block runs: the module's
        parameters, or under mixed precision the fp32 masters gathered from the shards;
        ``write_back`` re-cuts the shards from them (and refreshes the bf16 parameters)."""
        if self.mixed:
            yield from self._full_masters(write_back)
            return
        if self.stage == 3:
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
            if self.stage == 3:
                self._free_parameters()

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` to ``value`` (its tp-local shape): this rank's piece of it in
        its unit's shard (the master under mixed precision) and, under stages 1-2, the module's
        parameter; nothing is gathered (loading weights one tensor at a time)."""
        unit = self._unit_of.get(name)
        with torch.no_grad():
            if unit is None or self.stage < 3:  # a parameter outside every unit (frozen), or held whole
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
        held: tuple[int, dict] | None = None
        for name in names:
            unit = self._unit_of.get(name)
            if unit is None or (self.stage < 3 and not self.mixed):
                yield name, self.gm.get_parameter(name).detach()
                continue
            if held is None or held[0] != unit:
                held = None
                with torch.no_grad():
                    dtype = torch.float32 if self.mixed else None
                    flat = self._all_gather(unit, self.shards[unit].detach(), None, dtype=dtype)
                    held = (unit, self.layouts[unit].views(flat))
            yield name, held[1][name]

    def _full_masters(self, write_back: bool):
        values = {}
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                flat = self._all_gather(unit, self.shards[unit].detach(), None, dtype=torch.float32)
                values.update({x: v.clone() for x, v in lay.views(flat).items()})
        yield values
        if write_back:
            self._recut_shards(values)
            if self.stage < 3:
                with torch.no_grad():
                    for x, v in values.items():
                        self.gm.get_parameter(x).copy_(v)

    # --- what checkpoints and the memory meter read (interface of GradSync) -----------------

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
            if new:
                self.optimizer.state[shard] = new

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat fp32 shards: parameters under stage 3, master copies under stages 1-2 and
        under mixed precision (whose stage-3 shards are masters and parameter shards at once)."""
        masters = self.mixed or self.stage in (1, 2)
        return {"params": list(self.shards) if not masters else [],
                "master_params": list(self.shards) if masters else [],
                "grads": [s.grad for s in self.shards if s.grad is not None] + list(self.main_grads.values())}

    # --- the program's zero_gather (autopar/ops/zero_gather.py) --------------------------

    def gather_for_forward(self, unit: int, shard: torch.Tensor) -> torch.Tensor:
        """The unit's full flat buffer, gathered in forward and tracked for saved-tensor packing.

        The next unit of the same chunk is prefetched: its all-gather starts now and runs while
        this unit's layer computes (at most two gathered units live, the cost model's double
        buffer); the bytes and calls are the same, recorded when each gather starts."""
        flat = self._gathered(unit, self._prefetched, "fwd")
        nxt = unit + 1
        if (nxt < len(self.units) and self.unit_chunks[nxt] == self.unit_chunks[unit]
                and self.layouts[nxt].n > 1 and not shard.is_meta):
            self._prefetched[nxt] = self._start_gather(nxt, self.shards[nxt], "fwd", async_op=True)
        # A fresh tensor, not a view: saved-tensor packing finds gathered parameters by their base.
        return flat if tensor_base(flat) is flat else flat.clone()

    def unit_views(self, unit: int, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._live[storage_key(flat)] = (weakref.ref(flat), unit)
        views = self.layouts[unit].views(flat)
        return tuple(views[x] for x in self.layouts[unit].names)

    def scatter_in_backward(self, unit: int, grad: torch.Tensor) -> torch.Tensor | None:
        """The unit's gradient reduce-scattered into this rank's shard gradient.

        In a flat micro-batch the reduce-scatter runs while backward computes the next unit's
        gradients: it is started here and waited for when the next one starts (or the
        micro-batch ends), which adds the result to the shard's ``.grad`` (returning None: the
        shard has no gradient from autograd).  Under pp torch's stages differentiate the shards
        themselves (the split weight backward), so the gradient is returned, reduced."""
        self._regathered.pop(unit, None)  # every use of the unit in backward has run
        if not self._defer_scatter:
            return self._reduce_scatter(unit, grad)
        self._finish_deferred()
        self._deferred = self._start_reduce_scatter(unit, grad, async_op=True)
        return None

    def _finish_deferred(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and add it to its shard's gradient."""
        pending, self._deferred = self._deferred, None
        if pending is not None:
            self._add_shard_grad(pending[0], self._finish_reduce_scatter(pending))

    def _add_shard_grad(self, unit: int, grad: torch.Tensor) -> None:
        shard = self.shards[unit]
        shard.grad = grad if shard.grad is None else shard.grad + grad

    # --- collectives ------------------------------------------------------------------

    def _all_gather(self, unit: int, shard: torch.Tensor, phase: str | None, dtype=None) -> torch.Tensor:
        """The unit's ``[A | B]`` in the parameters' dtype (or ``dtype``); ``phase=None`` does not record."""
        lay = self.layouts[unit]
        if lay.n == 1:
            return lay.from_rank_major(shard.detach().to(dtype or self.dtypes[unit]).contiguous().clone())
        buf, _, _ = self._start_gather(unit, shard, phase, dtype=dtype)
        return lay.from_rank_major(buf)

    def _start_gather(self, unit: int, shard: torch.Tensor, phase: str | None, dtype=None, async_op=False):
        """Start (``async_op``) or run the all-gather of the unit's shards: ``(rank-major buffer,
        work or None, source)``; the source must stay alive until the work is waited for."""
        lay = self.layouts[unit]
        src = shard.detach().to(dtype or self.dtypes[unit]).contiguous()
        axis = self.unit_axes[unit]
        if phase is not None:
            C.record("all_gather", axis, src, phase, f"ZeRO unit {unit} ({len(lay.names)} tensors)")
        buf = torch.empty(lay.n * lay.shard_numel, dtype=src.dtype, device=src.device)
        work = dist.all_gather_single(buf, src, group=self.groups[axis].group, async_op=async_op)
        return buf, work, src

    def _gathered(self, unit: int, in_flight: dict, phase: str) -> torch.Tensor:
        """The unit's full flat buffer: its prefetched gather in ``in_flight`` waited for, else gathered now."""
        pending = in_flight.pop(unit, None)
        if pending is None:
            return self._all_gather(unit, self.shards[unit], phase)
        buf, work, _src = pending
        work.wait()
        return self.layouts[unit].from_rank_major(buf)

    def _drain_prefetched(self) -> None:
        """Wait for gathers started but not used (a forward that stopped early), and drop them."""
        for _, work, _ in list(self._prefetched.values()) + list(self._prefetched_bwd.values()):
            work.wait()
        self._prefetched.clear()
        self._prefetched_bwd.clear()

    def _reduce_scatter(self, unit: int, flat_grad: torch.Tensor) -> torch.Tensor:
        """Average the unit's full ``[A | B]`` gradient over dp; returns this rank's fp32 shard."""
        return self._finish_reduce_scatter(self._start_reduce_scatter(unit, flat_grad, async_op=False))

    def _start_reduce_scatter(self, unit: int, flat_grad: torch.Tensor, async_op: bool) -> tuple:
        """Start (``async_op``) or run the unit's reduce-scatter: ``(unit, result, work or None,
        source)``; the source must stay alive until the work is waited for."""
        lay = self.layouts[unit]
        # Mixed precision reduces in fp32 (the cost model's w_gc = 4 B).
        buf = lay.rank_major((flat_grad.float() if self.mixed else flat_grad).contiguous())
        if lay.n == 1:
            return unit, buf, None, buf
        axis = self.unit_axes[unit]
        C.record("reduce_scatter", axis, buf, "grad", f"ZeRO gradient unit {unit} ({len(lay.names)} tensors)")
        out = torch.empty(lay.shard_numel, dtype=buf.dtype, device=buf.device)
        work = dist.reduce_scatter_single(out, buf, group=self.groups[axis].group, async_op=async_op)
        return unit, out, work, buf

    def _finish_reduce_scatter(self, pending: tuple) -> torch.Tensor:
        """The shard gradient of a started reduce-scatter, averaged, fp32."""
        unit, out, work, _buf = pending
        if work is not None:
            work.wait()
        divisor = self.unit_divisors[unit] or self.layouts[unit].n
        return out.float() / divisor if divisor > 1 else out.float()

    def _unit_grad_ready(self, unit: int) -> None:
        """A gradient of ``unit`` was accumulated (stage 2 hook); the last one starts its reduce-scatter."""
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
        lay = self.layouts[unit]
        params = {x: self.gm.get_parameter(x) for x in lay.names}
        pending = self._started.pop(unit, None)
        if pending is not None:  # started in backward (stage 2): its gradients were final then
            shard_grad = self._finish_reduce_scatter(pending)
        else:
            grads = {x: self._grad(x, p) for x, p in params.items()}
            shard_grad = self._reduce_scatter(unit, lay.flatten(grads))
        self._add_shard_grad(unit, shard_grad)
        for x, p in params.items():
            p.grad = None
            self.main_grads.pop(x, None)

    def _grad(self, name: str, p: torch.Tensor) -> torch.Tensor:
        """The gradient held for ``name``: the fp32 main gradient (stage 1, mixed) or ``p.grad``."""
        main = self.mixed and self.stage == 1
        g = self.main_grads.get(name) if main else p.grad
        return g if g is not None else torch.zeros_like(p, dtype=torch.float32 if main else p.dtype)

    def _all_reduce_partial_full(self) -> None:
        """Stage 1: sum partial gradients over their axes on the full gradients (as GradSync)."""
        for bucket in self.buckets:
            if bucket.axis in self.unit_axes:
                continue
            params = [self.gm.get_parameter(x) for x in bucket.params]
            grads = [self._grad(x, p) for x, p in zip(bucket.params, params)]
            flat = torch.cat([g.reshape(-1) for g in grads])
            C.record("all_reduce", bucket.axis, flat, "grad", f"partial gradient bucket ({len(params)} tensors)")
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
        """Stages 2-3: sum the ``B`` shards (partial gradients) over their axes, one call per axis."""
        parts = [(s, lay) for s, lay in zip(self.shards, self.layouts) if lay.sb and s.grad is not None]
        if not parts:
            return
        flat = torch.cat([s.grad[lay.sa:] for s, lay in parts])
        for axis in self.partial_axes:
            if self.groups[axis].size == 1:
                continue
            C.record("all_reduce", axis, flat, "grad", f"partial gradient shards ({len(parts)} units)")
            dist.all_reduce(flat, group=self.groups[axis].group)
        offset = 0
        for s, lay in parts:
            s.grad[lay.sa:] = flat[offset:offset + lay.sb]
            offset += lay.sb

    def _gather_into_params(self) -> None:
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                flat = self._all_gather(unit, self.shards[unit], "step")
                for x, v in lay.views(flat).items():
                    self.gm.get_parameter(x).copy_(v)

    # --- stage 3 ----------------------------------------------------------------------

    def _free_parameters(self) -> None:
        for u in self.units:
            for x in u:
                p = self.gm.get_parameter(x)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None

    def _recut_shards(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                params = {x: values[x].detach() for x in lay.names}
                flat = lay.rank_major(lay.flatten(params).float())
                self.shards[unit].copy_(flat.view(lay.n, -1)[self._rank(unit)])

    def _pack(self, t: torch.Tensor):
        entry = self._live.get(storage_key(t))
        if entry is not None and entry[0]() is not None:
            self._saved_at[entry[1]] = next(self._clock)
            return (_HANDLE, entry[1], t.size(), t.stride(), t.storage_offset())
        observe_saved(t)  # these hooks shadow the memory meter's
        return t.detach()  # never ``t``: see autopar/ops/regather.py SavedGathers.pack

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _HANDLE):
            return packed
        _, unit, size, stride, offset = packed
        flat = self._regathered.get(unit)
        if flat is None:
            flat = self._gathered(unit, self._prefetched_bwd, "bwd")
            self._regathered[unit] = flat
            self._prefetch_backward(unit)
        return flat.as_strided(size, stride, offset)

    def _prefetch_backward(self, unit: int) -> None:
        """Start the re-gather of the unit backward reaches next (of the chunk's units whose
        parameters forward saved, the one saved last before this one), so it runs while this
        unit's gradients compute, as FSDP2 prefetches in backward.  Only a unit backward will
        re-gather anyway is started, so the calls and bytes are those of the gathers it replaces
        (recorded when it starts)."""
        at = self._saved_at.get(unit, 0)
        earlier = [u for u, t in self._saved_at.items() if t < at and self.unit_chunks[u] == self.unit_chunks[unit]]
        prev = max(earlier, key=self._saved_at.__getitem__, default=None)
        if (prev is None or prev in self._regathered or prev in self._prefetched_bwd
                or self.layouts[prev].n == 1 or self.shards[prev].is_meta):
            return
        self._prefetched_bwd[prev] = self._start_gather(prev, self.shards[prev], "bwd", async_op=True)


def _ordered_units(gm: torch.fx.GraphModule) -> list[tuple[int, list[str]]]:
    """(unit index, parameter names) in the order the program gathers them (from the nodes
    ``passes/zero.py`` inserted)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is zero_gather]
    nodes.sort(key=lambda n: n.args[0])
    return [(n.args[0], list(n.meta[META_KEY].params)) for n in nodes]


def _split_by(names: list[str], chunk_of: dict[str, int]) -> list[list[str]]:
    """``names`` cut into runs of one pipeline chunk each, order kept."""
    groups: dict[int | None, list[str]] = {}
    for x in names:
        groups.setdefault(chunk_of.get(x), []).append(x)
    return list(groups.values())


def _unit_grad_ready(sync: "weakref.ref[ZeroSync]", unit: int, param: torch.Tensor) -> None:
    live = sync()
    if live is not None:  # a freed program leaves an inert hook on a parameter kept elsewhere
        live._unit_grad_ready(unit)
