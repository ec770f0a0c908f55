"""ZeRO-3: parameters that live only as ``dp`` shards, gathered per unit while the program runs.

:class:`ShardedParameters` is the part of :class:`autopar.runtime.zero.ZeroSync` that the
program's :func:`autopar.ops.zero_gather.zero_gather` calls (through the step context's
``zero``), on the units, layouts and collectives of :class:`autopar.runtime.zero_units.ZeroUnits`:

* forward: the graph calls ``zero_gather`` per unit, which all-gathers before first use
  (phase ``fwd``, :meth:`ShardedParameters.gather_for_forward`); the next unit of the same
  pipeline chunk is prefetched, its gather started then and waited for at its own first use;
* backward: saved-tensor hooks (:meth:`ShardedParameters._pack` / ``_unpack``) keep no gathered
  parameter for backward but re-gather the unit when backward first needs it (phase ``bwd``;
  the re-gather of the unit backward reaches next is then started, prefetched like forward's,
  :meth:`ShardedParameters._prefetch_backward`) and drop it when the unit's gradient is
  reduce-scattered (phase ``grad``), once per unit and micro-batch;
* in a flat micro-batch that reduce-scatter runs while backward computes the next unit's
  gradients (:meth:`ShardedParameters.scatter_in_backward`); under pp torch's stages
  differentiate the shards themselves (:meth:`ShardedParameters.chunk_shards`).
"""
from __future__ import annotations

import itertools
import weakref

import torch

from autopar.compat import storage_key, tensor_base
from autopar.ops.step import observe_saved
from autopar.runtime.zero_units import ZeroUnits

__all__ = ["ShardedParameters"]

_HANDLE = object()  # marks a packed saved tensor that is a view of a gathered unit


class ShardedParameters(ZeroUnits):
    """ZeRO-3's gathers, saved-tensor hooks and in-backward reduce-scatters."""

    def _init_sharded_parameters(self) -> None:
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

    def chunk_shards(self, chunk: int) -> list[torch.nn.Parameter]:
        """ZeRO-3 under pp: the flat shards of pipeline chunk ``chunk``'s units (the chunk's real
        parameters, which torch's split weight backward differentiates)."""
        return [self.shards[unit] for unit in self._chunk_units(chunk)] if self.zero_stage == 3 else []

    def _free_parameters(self) -> None:
        """The module's parameters emptied: their values live in the shards only."""
        for u in self.units:
            for x in u:
                p = self.gm.get_parameter(x)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None

    # --- the program's zero_gather (autopar/ops/zero_gather.py) --------------------------

    def gather_for_forward(self, unit: int, shard: torch.Tensor) -> torch.Tensor:
        """The unit's full flat buffer, gathered in forward and tracked for saved-tensor packing.

        The next unit of the same pipeline chunk is prefetched: its all-gather starts now and
        runs while this unit's layer computes (at most two gathered units live, the cost model's
        double buffer); the bytes and calls are the same, recorded when each gather starts."""
        flat = self._gathered(unit, self._prefetched, "fwd")
        nxt = unit + 1
        if (nxt < len(self.units) and self.unit_chunks[nxt] == self.unit_chunks[unit]
                and self.layouts[nxt].n > 1 and not shard.is_meta):
            self._prefetched[nxt] = self._start_gather(nxt, self.shards[nxt], "fwd", async_op=True)
        # A fresh tensor, not a view: saved-tensor packing finds gathered parameters by their base.
        return flat if tensor_base(flat) is flat else flat.clone()

    def unit_views(self, unit: int, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The unit's parameters as views of its gathered buffer ``flat`` (tracked for packing)."""
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

    def _drain_prefetched(self) -> None:
        """Wait for gathers started but not used (a forward that stopped early), and drop them."""
        for _, work, _ in list(self._prefetched.values()) + list(self._prefetched_bwd.values()):
            work.wait()
        self._prefetched.clear()
        self._prefetched_bwd.clear()

    # --- saved-tensor hooks: no gathered parameter is kept for backward ---------------------

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
