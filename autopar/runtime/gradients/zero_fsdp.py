"""ZeRO-3 as FSDP: parameters that live only as ``dp`` shards, gathered per unit while the program runs.

:class:`FullyShardedSync` is the gradient-sync strategy (:class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`)
for ``zero=3``.  It holds a :class:`autopar.runtime.gradients.zero_layout.ZeroLayout` (the units ``passes/zero.py``
made: a decoder layer, a MoE layer's experts, the rest of the model) and, per unit and segment, one
flat shard (an ``nn.Parameter``; the fp32 master under mixed precision, cast as it is gathered: FSDP2's
layout) that the optimizer steps; the module's own parameters are emptied.  Whole values and
optimizer state over the shards are :mod:`autopar.runtime.gradients.zero_state`.

* forward: the program calls :func:`autopar.ops.zero_gather.zero_gather` per unit, which all-gathers
  the unit's segments before first use (phase ``fwd``, :meth:`FullyShardedSync.gather_for_forward`)
  into fresh flat buffers of which the parameters are views; the next unit of the same pipeline
  chunk is prefetched (its gather started then, waited for at its own first use): at most two
  gathered units live, the cost model's double buffer;
* backward: saved-tensor hooks (:meth:`FullyShardedSync.pack` / ``unpack``) keep no gathered
  parameter for backward but re-gather the unit when backward first needs it (phase ``bwd``;
  the re-gather of the unit backward reaches next is started then, prefetched like forward's)
  and drop it when the unit's gradient is reduce-scattered (phase ``grad``), once per unit and
  micro-batch.  The views' backward (one ``cat`` per segment, :meth:`FlatSegment.views
  <autopar.runtime.gradients.flat_layout.FlatSegment.views>`) gives each segment's gradient already laid out
  as the reduce-scatter reads it: no flattening or rank-major copy;
* in a flat micro-batch that reduce-scatter runs while backward computes the next unit's
  gradients (:meth:`FullyShardedSync.scatter_in_backward`); under pp torch's stages differentiate
  the shards themselves (:meth:`FullyShardedSync.chunk_shards`).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Iterator

import torch
import torch.nn as nn

from autopar.compat import storage_key, tensor_base
from autopar.ops.step import activate, current, observe_saved
from autopar.runtime.gradients import zero_state
from autopar.runtime.gradients.zero_layout import ZeroLayout, ZeroUnit, all_reduce_grads, gather_unit, scatter_unit

__all__ = ["FullyShardedSync"]

_HANDLE = object()  # marks a packed saved tensor that is a view of a gathered unit


class FullyShardedSync:
    """ZeRO-3 over the ``dp`` axis (see the module docstring).  ``originals``: under mixed precision,
    graph name -> this rank's piece of the user's fp32 tensor (the shards are cut from it)."""

    zero_stage = 3

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer,
                 originals: dict[str, torch.Tensor] | None = None):
        self.gm = gm
        self.mixed = originals is not None
        self.layout = ZeroLayout(gm, program, buckets, groups, 3)
        self._params = dict(gm.named_parameters())
        values = originals if self.mixed else {x: p.detach() for x, p in self._params.items()}
        self.shards: list[list[nn.Parameter]] = []
        for unit in self.layout.units:
            dtype = torch.float32 if self.mixed else unit.dtype
            device = self._params[unit.names[0]].device
            self.shards.append([nn.Parameter(seg.cut(values, unit.rank, torch.empty(seg.shard_numel, dtype=dtype,
                                                                                  device=device)), requires_grad=True)
                                for seg in unit.segments])
        self.optimizer = make_optimizer([s for shards in self.shards for s in shards])
        self._live: dict[tuple, tuple] = {}  # storage of a gathered buffer -> (weakref, unit, segment)
        self._regathered: dict[int, list[torch.Tensor]] = {}
        self._prefetched: dict[int, tuple] = {}  # unit -> its forward all-gather in flight
        self._prefetched_bwd: dict[int, tuple] = {}  # unit -> its backward re-gather in flight
        self._defer_scatter = False  # inside a flat micro-batch: reduce-scatters overlap backward
        self._deferred: tuple | None = None  # the reduce-scatter in flight
        # unit -> when forward last saved its parameters for backward (a counter): backward
        # re-gathers the units in the reverse of that order (a tied head's unit comes first).
        self._saved_at: dict[int, int] = {}
        self._clock = itertools.count(1)
        self._free_parameters()

    @property
    def units(self) -> list[tuple[str, ...]]:
        return [u.names for u in self.layout.units]

    def local_unit(self, program_unit: int) -> ZeroUnit:
        """This rank's unit of the program's unit index (under pp a rank holds its chunks' units)."""
        return self.layout.local_unit(program_unit)

    def chunk_shards(self, chunk: int) -> list[nn.Parameter]:
        """The flat shards of pipeline chunk ``chunk``'s units (the chunk's real parameters, which
        torch's split weight backward differentiates)."""
        return [s for u in self.layout.chunk_units(chunk) for s in self.shards[u.index]]

    def _free_parameters(self) -> None:
        """The module's parameters emptied: their values live in the shards only."""
        for unit in self.layout.units:
            for x in unit.names:
                p = self._params[x]
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None

    # --- gathers --------------------------------------------------------------------------

    def _start_gather(self, unit: ZeroUnit, phase: str | None, dtype=None, async_op: bool = False) -> tuple:
        """Start (``async_op``) or run the unit's all-gather: ``(buffers, work or None, sources)``;
        the sources must stay alive until the work is waited for."""
        srcs = [s.detach().to(dtype or unit.dtype).contiguous() for s in self.shards[unit.index]]
        bufs = [seg.new_buffer(srcs[0].dtype, srcs[0].device) for seg in unit.segments]
        return bufs, gather_unit(unit, bufs, srcs, phase, async_op=async_op), srcs

    def _gathered(self, unit: ZeroUnit, in_flight: dict, phase: str) -> list[torch.Tensor]:
        """The unit's gathered buffers: its prefetched gather in ``in_flight`` waited for, else gathered now."""
        pending = in_flight.pop(unit.index, None)
        if pending is None:
            return self._start_gather(unit, phase)[0]
        bufs, work, _srcs = pending
        work.wait()
        return bufs

    def gather_for_forward(self, unit: ZeroUnit) -> tuple[torch.Tensor, ...]:
        """The unit's gathered buffers in forward (``zero_gather``), the next unit of its chunk prefetched."""
        bufs = self._gathered(unit, self._prefetched, "fwd")
        units = self.layout.units
        if unit.index + 1 < len(units):
            nxt = units[unit.index + 1]
            if nxt.chunk == unit.chunk and nxt.num_shards > 1:
                self._prefetched[nxt.index] = self._start_gather(nxt, "fwd", async_op=True)
        # Fresh tensors, not views: saved-tensor packing finds gathered parameters by their base.
        return tuple(b if tensor_base(b) is b else b.clone() for b in bufs)

    def unit_views(self, unit: ZeroUnit, bufs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The unit's parameters, in ``zero_gather``'s order, as views of its gathered buffers (tracked for packing)."""
        views = {}
        for i, (seg, buf) in enumerate(zip(unit.segments, bufs)):
            self._live[storage_key(buf)] = (weakref.ref(buf), unit.index, i)
            views.update(seg.views(buf))
        return tuple(views[x] for x in unit.names)

    def _drain_prefetched(self) -> None:
        """Wait for gathers started but not used (a forward that stopped early), and drop them."""
        for _, work, _ in list(self._prefetched.values()) + list(self._prefetched_bwd.values()):
            if work is not None:
                work.wait()
        self._prefetched.clear()
        self._prefetched_bwd.clear()

    # --- reduce-scatters ------------------------------------------------------------------------

    def scatter_in_backward(self, unit: ZeroUnit, grads) -> tuple | None:
        """The unit's gradients (one per segment) reduce-scattered into this rank's shards' gradients.

        In a flat micro-batch the reduce-scatter runs while backward computes the next unit's
        gradients: started here, waited for when the next one starts (or the micro-batch ends),
        which adds the result to the shards' ``.grad`` (returning None: the shards get no gradient
        from autograd).  Under pp torch's stages differentiate the shards themselves (the split
        weight backward), so the gradients are returned, reduced."""
        self._regathered.pop(unit.index, None)  # every use of the unit in backward has run
        if not self._defer_scatter:
            return tuple(self._finish_scatter(self._start_scatter(unit, grads, async_op=False)))
        self._finish_deferred()
        self._deferred = self._start_scatter(unit, grads, async_op=True)
        return None

    def _start_scatter(self, unit: ZeroUnit, grads, async_op: bool) -> tuple:
        # Mixed precision reduces in fp32 (the cost model's w_gc = 4 B).
        ins = [(g.float() if self.mixed else g).contiguous() for g in grads]
        outs = [torch.empty(seg.shard_numel, dtype=ins[0].dtype, device=ins[0].device) for seg in unit.segments]
        return unit, outs, scatter_unit(unit, outs, ins, async_op=async_op), ins

    @staticmethod
    def _finish_scatter(pending: tuple) -> list[torch.Tensor]:
        """The shard gradients of a started reduce-scatter, averaged (in place: each is its own buffer)."""
        unit, outs, work, _ins = pending
        if work is not None:
            work.wait()
        return [o.div_(unit.divisor) if unit.divisor > 1 else o for o in outs]

    def _finish_deferred(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and add it to its shards' gradients."""
        pending, self._deferred = self._deferred, None
        if pending is None:
            return
        for shard, grad in zip(self.shards[pending[0].index], self._finish_scatter(pending)):
            shard.grad = grad if shard.grad is None else shard.grad.add_(grad)

    # --- saved-tensor hooks: no gathered parameter is kept for backward ------------------------

    def pack(self, t: torch.Tensor):
        entry = self._live.get(storage_key(t))
        if entry is not None and entry[0]() is not None:
            self._saved_at[entry[1]] = next(self._clock)
            return (_HANDLE, entry[1], entry[2], t.size(), t.stride(), t.storage_offset())
        observe_saved(t)  # these hooks shadow the memory meter's
        return t.detach()  # never ``t``: see autopar/ops/regather.py SavedGathers.pack

    def unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _HANDLE):
            return packed
        _, index, segment, size, stride, offset = packed
        bufs = self._regathered.get(index)
        if bufs is None:
            bufs = self._gathered(self.layout.units[index], self._prefetched_bwd, "bwd")
            self._regathered[index] = bufs
            self._prefetch_backward(index)
        return bufs[segment].as_strided(size, stride, offset)

    def _prefetch_backward(self, index: int) -> None:
        """Start the re-gather of the unit backward reaches next (of the chunk's units whose
        parameters forward saved, the one saved last before this one), so it runs while this
        unit's gradients compute, as FSDP2 prefetches in backward.  Only a unit backward will
        re-gather anyway is started, so the calls and bytes are those of the gathers it replaces."""
        units = self.layout.units
        at = self._saved_at.get(index, 0)
        earlier = [u for u, t in self._saved_at.items() if t < at and units[u].chunk == units[index].chunk]
        prev = max(earlier, key=self._saved_at.__getitem__, default=None)
        if (prev is None or prev in self._regathered or prev in self._prefetched_bwd
                or units[prev].num_shards == 1):
            return
        self._prefetched_bwd[prev] = self._start_gather(units[prev], "bwd", async_op=True)

    # --- the protocol's step entry points --------------------------------------------------------

    @contextlib.contextmanager
    def microbatch(self, last: bool = False, defer_scatter: bool = True) -> Iterator[None]:
        """One micro-batch's forward and backward (or, from :meth:`pipeline_step`, a pipelined step):
        the program's gathers and the saved-tensor hooks; ``defer_scatter``: reduce-scatters overlap backward."""
        self._defer_scatter = defer_scatter
        try:
            with activate(current(), zero=self), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._finish_deferred()
            self._defer_scatter = False
            self._live.clear()
            self._regathered.clear()
            self._drain_prefetched()

    def pipeline_step(self):
        return self.microbatch(defer_scatter=False)

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """After a backward: the chunk's re-gathered units are dropped once its weight gradients exist
        (an input-only backward keeps them for the weight half, which reads some of them again)."""
        if kind == "inference":  # torch's first-step shape inference: no parameter gradient made
            self._regathered.clear()
        elif chunk is not None and kind != "input":
            for unit in self.layout.chunk_units(chunk):
                self._regathered.pop(unit.index, None)

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """An evaluation forward: the units gathered, nothing scattered or kept."""
        try:
            with activate(current(), zero=self):
                yield
        finally:
            self._live.clear()
            self._drain_prefetched()

    def sync(self) -> None:
        """Partial gradients (their own segments) summed over their axes on the shards, one call per axis."""
        parts = [s.grad for u, shards in zip(self.layout.units, self.shards)
                 for seg, s in zip(u.segments, shards) if seg.partial and s.grad is not None]
        for axis in self.layout.partial_axes:
            all_reduce_grads(parts, axis, self.layout.groups, "partial gradient shards")

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_square_sum(self, weights: dict[str, float], device: torch.device) -> torch.Tensor:
        return zero_state.grad_square_sum(self.layout, self.shards, weights, device)

    def scale_grads(self, coef: float) -> None:
        for shards in self.shards:
            for s in shards:
                if s.grad is not None:
                    s.grad.mul_(coef)

    # --- whole parameters and state ----------------------------------------------------------------

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Graph name -> the whole (tp-local) parameter while the block runs: the module's parameters
        filled from the gathered shards, or under mixed precision the fp32 masters gathered;
        ``write_back`` re-cuts the shards from them."""
        dtype = torch.float32 if self.mixed else None
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for unit, shards in zip(self.layout.units, self.shards):
                for x, v in zero_state.gather_whole(unit, shards, dtype).items():
                    if self.mixed:
                        values[x] = v.clone()
                    else:
                        self._params[x].data = v.clone()
                        values[x] = self._params[x]
        try:
            yield values
            if write_back:
                for unit, shards in zip(self.layout.units, self.shards):
                    zero_state.cut_pieces(unit, values, shards)
        finally:
            if not self.mixed:
                self._free_parameters()

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` (its tp-local shape): its piece of its unit's shard (the master
        under mixed precision), or a parameter outside every unit (frozen) itself; nothing is gathered."""
        unit = self.layout.unit_of.get(name)
        if unit is None:
            with torch.no_grad():
                self._params[name].copy_(value)
            return
        zero_state.write_piece(unit, name, value, self.shards[unit.index])

    def read_parameters(self, names):
        """``(name, value)`` for each graph parameter of ``names``: a unit's shards all-gathered
        (collective over its ranks) once for its names that follow each other, at most one unit whole."""
        def held(name):
            return self._params[name].detach() if name not in self.layout.unit_of else None
        return zero_state.read_whole(self.layout, self.shards, names, torch.float32 if self.mixed else None, held)

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return zero_state.optimizer_state(self.layout, self.shards, self.optimizer)

    def load_optimizer_state(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        zero_state.load_optimizer_state(self.layout, self.shards, self.optimizer, entries)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat shards: parameters, or under mixed precision masters (and parameter shards at once)."""
        shards = [s for ss in self.shards for s in ss]
        return {"params": [] if self.mixed else shards, "master_params": shards if self.mixed else [],
                "grads": [s.grad for s in shards if s.grad is not None]}
