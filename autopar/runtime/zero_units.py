"""ZeRO's units: which parameters are flattened together, their ``dp`` shards, and the
collectives that move a unit (all-gather of its shards, reduce-scatter of its gradient).

:class:`ZeroUnits` is the shared base of :class:`autopar.runtime.zero.ZeroSync` at every ZeRO
stage; :mod:`autopar.runtime.zero_grads` (ZeRO-1/2: sharded optimizer state and gradients)
and :mod:`autopar.runtime.zero_params` (ZeRO-3: parameters gathered per unit) build on it.

Layout.  The parameters of one unit (a ``dp`` gradient bucket of the data-parallel pass for
ZeRO-1/2; one decoder layer, or the rest of the model, for ZeRO-3, as grouped by
``passes/zero.py``) are flattened into one buffer with two segments: ``A``, the ordinary
parameters, and ``B``, those whose gradients are partial sums over another axis (norm
weights under SP, axis ``tp``); :class:`autopar.runtime.flat_layout.FlatLayout` says where
each parameter sits.  Each segment is zero-padded to a multiple of ``dp`` and rank ``r`` owns
``[A_r, B_r]``, so a reduce-scatter / all-gather of the rank-major buffer
``[A_0 B_0 | A_1 B_1 | ...]`` moves exactly the padded sizes.  The optimizer (the user's
factory) gets one flat fp32 shard parameter per unit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.ops.zero_gather import zero_gather
from autopar.passes.context import META_KEY
from autopar.runtime.flat_layout import FlatLayout

__all__ = ["ZeroUnits"]

# One unit: (parameter names, the mesh axis its shards span, its gradient divisor or None).
Unit = tuple[list[str], str, "int | None"]


class ZeroUnits:
    """The units of a ZeRO strategy, their flat fp32 shards and the optimizer over them.

    ``zero_stage``: 1, 2 or 3; ``originals``: under mixed precision, graph name -> this rank's
    piece of the user's fp32 tensor (the shards are cut from it and are the masters)."""

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer,
                 zero_stage: int, originals: dict[str, torch.Tensor] | None = None):
        self.gm, self.groups, self.zero_stage = gm, groups, zero_stage
        self.mixed = originals is not None  # fp32 masters cut from ``originals``, bf16 parameters
        self.buckets = list(buckets)
        # The ranks holding copies of the dense weights: dp, or dp*cp under cp (Megatron's
        # distributed optimizer shards over the data- and context-parallel ranks alike).
        self.axis = "dp_cp" if "dp_cp" in groups else "dp"
        self.partial = {x for x, axes in program.grad_partial_axes.items() if axes}
        self.partial_axes = _partial_axes(program.grad_partial_axes, self.partial)
        # Each unit is sharded over the ranks holding copies of its parameters: the dense axis, or
        # for experts split over ep the ``edp`` ranks (their gradients averaged by dp*cp all the same).
        self.pipeline = program.pipeline
        params = dict(gm.named_parameters())
        units = self._units(gm, params)
        self.units = [list(u) for u, _, _ in units]
        # Under pp: the pipeline chunk each unit belongs to (ZeRO-2 reduce-scatters a chunk's units
        # after its backward); ZeRO-3: the program's unit index -> this rank's (it holds its chunks' units).
        owner = self.pipeline.param_chunk() if self.pipeline is not None else {}
        self.unit_chunks = [owner.get(u[0]) for u in self.units]
        self._local = {g: i for i, g in enumerate(self._global_units)}
        self.unit_axes = [axis for _, axis, _ in units]
        self.unit_divisors = [div for _, _, div in units]
        self._unit_of = {x: unit for unit, names in enumerate(self.units) for x in names}
        self.layouts = [FlatLayout(u, {x: params[x].shape for x in u}, self.partial if axis == self.axis else set(),
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

    def _units(self, gm, params: dict) -> list[Unit]:
        """(parameter names, mesh axis, gradient divisor) per unit, in gather order under ZeRO-3."""
        self._global_units: list[int] = []
        if self.zero_stage == 3:  # per decoder layer, a MoE layer's experts apart (passes/zero.py)
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
        if self.zero_stage == 2 and self.pipeline is not None:
            # Each chunk's gradients are scattered after its backward: units split at chunk borders.
            owner = self.pipeline.param_chunk()
            units = [(names, axis, div) for u, axis, div in units for names in _split_by(u, owner)]
        return units

    def _chunk_units(self, chunk: int) -> list[int]:
        """This rank's units that belong to pipeline chunk ``chunk``."""
        return [unit for unit, c in enumerate(self.unit_chunks) if c == chunk]

    def local_unit(self, unit: int) -> int:
        """This rank's index of the program's ZeRO-3 unit ``unit`` (``zero_gather``'s argument)."""
        return self._local[unit]

    def _rank(self, unit: int) -> int:
        """This rank's index among the ranks the unit's shards span."""
        axis = self.unit_axes[unit]
        return self.groups[axis].rank if axis in self.groups else 0

    def _recut_shards(self, values: dict[str, torch.Tensor]) -> None:
        """Every unit's shard cut again from whole parameter values (graph name -> tensor)."""
        with torch.no_grad():
            for unit, lay in enumerate(self.layouts):
                params = {x: values[x].detach() for x in lay.names}
                flat = lay.rank_major(lay.flatten(params).float())
                self.shards[unit].copy_(flat.view(lay.n, -1)[self._rank(unit)])

    def _add_shard_grad(self, unit: int, grad: torch.Tensor) -> None:
        shard = self.shards[unit]
        shard.grad = grad if shard.grad is None else shard.grad + grad

    # --- collectives of one unit --------------------------------------------------------

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
            collectives.record("all_gather", axis, src, phase, f"ZeRO unit {unit} ({len(lay.names)} tensors)")
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
        collectives.record("reduce_scatter", axis, buf, "grad",
                           f"ZeRO gradient unit {unit} ({len(lay.names)} tensors)")
        out = torch.empty(lay.shard_numel, dtype=buf.dtype, device=buf.device)
        work = dist.reduce_scatter_single(out, buf, group=self.groups[axis].group, async_op=async_op)
        return unit, out, work, buf

    def _finish_reduce_scatter(self, pending: tuple) -> torch.Tensor:
        """The shard gradient of a started reduce-scatter, averaged, fp32."""
        unit, out, work, _buf = pending
        if work is not None:
            work.wait()
        divisor = self.unit_divisors[unit] or self.layouts[unit].n
        # Averaged in place (``out`` is this call's own buffer, fp32 when mixed precision reduces in
        # fp32): no allocation while gloo may still hold its working copy of the input.
        out = out.float()
        return out.div_(divisor) if divisor > 1 else out


def _partial_axes(grad_partial_axes: dict, partial: set[str]) -> list[str]:
    """The one set of axes the partial gradients are summed over (sorted; [] when none)."""
    axis_sets = {frozenset(grad_partial_axes[x]) for x in partial}
    if len(axis_sets) > 1:
        raise AutoparError(f"autopar: ZeRO found gradients partial over different axis sets {sorted(map(sorted, axis_sets))}; "
                           "expected one set; use zero=0 for this plan.")
    return sorted(next(iter(axis_sets))) if axis_sets else []


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
