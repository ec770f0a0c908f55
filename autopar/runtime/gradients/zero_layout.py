"""ZeRO's layout: which parameters are flattened together (units), over which ranks each is sharded,
and the unit collectives that move them.

One :class:`ZeroLayout` serves both ZeRO strategies, which hold it rather than inherit from it:
:class:`autopar.runtime.gradients.zero_optimizer.DistributedOptimizer` (ZeRO-1/2: optimizer state and, under
ZeRO-2, gradients sharded; the parameters whole) and :class:`autopar.runtime.gradients.zero_fsdp.FullyShardedSync`
(ZeRO-3: parameters sharded too, gathered per unit while the program runs).  Shared reads and
writes of whole values and optimizer state over the shards are :mod:`autopar.runtime.gradients.zero_state`.

Units.  ZeRO-1/2: one per ``dp`` gradient bucket of the data-parallel pass (``passes/data_parallel.py``;
under pp ZeRO-2's are cut at pipeline-chunk borders, so that a chunk's gradients scatter after its
backward).  ZeRO-3: one per ``zero_gather`` node that ``passes/zero.py`` inserted (a decoder layer,
a MoE layer's experts, the rest of the model), in the order the program gathers them; under pp a
rank keeps the units of its own chunks.  Each unit is sharded over the ranks holding copies of its
parameters: the dense axis (``dp``, or ``dp_cp`` under cp, as Megatron's distributed optimizer), or
for experts split over ``ep`` the ``edp`` ranks (their gradients still averaged by ``dp*cp``: the
bucket's divisor).

Segments (:class:`autopar.runtime.gradients.flat_layout.FlatSegment`).  A unit's parameters lie in one flat,
padded buffer per segment: the ordinary ones, then under ZeRO-2/3 those whose gradients are partial
sums over another axis (norm weights under SP), which those strategies sum over that axis on the
shards once per step.  (ZeRO-1 sums them on the whole gradients first: one segment.)  Every
collective of a unit is one call, coalesced over its segments when it has two.  Padding is zero
when a segment's elements divide by the shard count (true for every test model), and then the bytes
equal the cost model's ``P*w/dp`` terms exactly; otherwise each call moves the padded size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.ops.zero_gather import zero_gather
from autopar.passes.context import META_KEY
from autopar.runtime.gradients.flat_layout import FlatSegment

__all__ = ["ZeroUnit", "ZeroLayout", "gather_unit", "scatter_unit", "all_reduce_grads"]


@dataclass(eq=False)
class ZeroUnit:
    """One unit: its parameters, the ranks its shards span, its segments."""

    index: int                      # this rank's index of the unit
    names: tuple[str, ...]          # its parameters (ZeRO-3: in the order zero_gather returns them)
    axis: str                       # the mesh axis its shards span
    group: object                   # that axis's process group (None: one rank)
    num_shards: int                 # the axis size
    rank: int                       # this rank's index on the axis
    divisor: int                    # what its reduced gradient is divided by
    chunk: int | None               # its pipeline chunk (None without pp)
    dtype: torch.dtype              # its parameters' dtype
    segments: tuple[FlatSegment, ...]

    @property
    def shard_numel(self) -> int:
        return sum(s.shard_numel for s in self.segments)


class ZeroLayout:
    """The units of one rank's ZeRO strategy (see the module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, zero_stage: int):
        self.groups = groups
        self.axis = "dp_cp" if "dp_cp" in groups else "dp"
        partial = {x for x, axes in program.grad_partial_axes.items() if axes}
        self.partial_axes = _partial_axes(program.grad_partial_axes, partial)
        params = dict(gm.named_parameters())
        owner = program.pipeline.param_chunk() if program.pipeline is not None else {}
        self.program_units: list[int] = []  # ZeRO-3: the program's index of each of this rank's units
        if zero_stage == 3:
            specs = self._gathered_units(gm, params, buckets)
        else:
            specs = self._bucket_units(params, buckets, owner if zero_stage == 2 else None)
        self.units: list[ZeroUnit] = []
        for index, (names, axis, divisor) in enumerate(specs):
            g = groups.get(axis)
            n = g.size if g is not None else 1
            split = partial if zero_stage >= 2 and axis == self.axis else set()
            segments = tuple(FlatSegment(part, {x: params[x].shape for x in part}, n, partial=is_partial)
                             for is_partial, part in ((False, [x for x in names if x not in split]),
                                                      (True, [x for x in names if x in split])) if part)
            self.units.append(ZeroUnit(index, tuple(names), axis,
                                       g.group if g is not None else None, n, g.rank if g is not None else 0,
                                       divisor or n, owner.get(names[0]), params[names[0]].dtype, segments))
        self.unit_of = {x: u for u in self.units for x in u.names}
        self._local = {g: i for i, g in enumerate(self.program_units)}

    def _bucket_units(self, params: dict, buckets, owner: dict | None) -> list[tuple]:
        """ZeRO-1/2: the dense and expert buckets (``owner``: cut at chunk borders)."""
        units = [(list(b.params), b.axis, b.divisor) for b in buckets if b.axis in (self.axis, "edp")]
        if not units:  # dp=1: the data-parallel pass made no dp bucket; one unit, one shard
            units = [([x for x, p in params.items() if p.requires_grad], self.axis, None)]
        if owner is not None:
            units = [(names, axis, div) for u, axis, div in units for names in _split_by(u, owner)]
        return [u for u in units if u[0]]

    def _gathered_units(self, gm, params: dict, buckets) -> list[tuple]:
        """ZeRO-3: the program's gather units this rank holds, each sharded over the ranks its
        gradient bucket reduces over (the dense axis, or ``edp`` for experts split over ep)."""
        held = [(g, u) for g, u in _ordered_units(gm) if u[0] in params]  # pp: this rank's chunks
        self.program_units = [g for g, _ in held]
        bucket_of = {x: b for b in buckets if b.axis in (self.axis, "edp") for x in b.params}
        out = []
        for _, names in held:
            b = bucket_of.get(names[0])
            out.append((names, b.axis, b.divisor) if b is not None else (names, self.axis, None))
        return out

    def local_unit(self, program_unit: int) -> ZeroUnit:
        """This rank's unit of the program's ZeRO-3 unit index (``zero_gather``'s argument)."""
        return self.units[self._local[program_unit]]

    def chunk_units(self, chunk: int) -> list[ZeroUnit]:
        """This rank's units that belong to pipeline chunk ``chunk``."""
        return [u for u in self.units if u.chunk == chunk]


# --- the collectives of one unit ---------------------------------------------------------------

def gather_unit(unit: ZeroUnit, outs: list[torch.Tensor], ins: list[torch.Tensor], phase: str | None,
                async_op: bool = False):
    """All-gather the unit's shards ``ins`` (one per segment) into its flat buffers ``outs``: one
    call, coalesced over two segments; recorded under ``phase`` (None: not recorded, reads outside
    a step; one rank: no call, no record).  ``ins[i]`` may be rank's piece of ``outs[i]`` (in place).  Returns the work (async)."""
    if phase is not None and unit.num_shards > 1:
        collectives.record("all_gather", unit.axis, ins[0], phase, f"ZeRO unit {unit.index} ({len(unit.names)} tensors)",
                           nbytes=sum(t.numel() * t.element_size() for t in ins))
    return _call("all_gather", unit, outs, ins, async_op)


def scatter_unit(unit: ZeroUnit, outs: list[torch.Tensor], ins: list[torch.Tensor], async_op: bool = False):
    """Reduce-scatter (sum) the unit's flat gradient buffers ``ins`` into this rank's shards ``outs``
    (phase ``grad``); ``outs[i]`` may be this rank's piece of ``ins[i]`` (in place).  Returns the work."""
    if unit.num_shards > 1:
        collectives.record("reduce_scatter", unit.axis, ins[0], "grad",
                           f"ZeRO gradient unit {unit.index} ({len(unit.names)} tensors)",
                           nbytes=sum(t.numel() * t.element_size() for t in ins))
    return _call("reduce_scatter", unit, outs, ins, async_op)


def _call(op: str, unit: ZeroUnit, outs: list, ins: list, async_op: bool):
    if unit.num_shards == 1:
        for o, i in zip(outs, ins):
            if o.data_ptr() != i.data_ptr() or o.is_meta:
                o.copy_(i)
        return None
    single = dist.all_gather_single if op == "all_gather" else dist.reduce_scatter_single
    if len(outs) == 1 or outs[0].is_meta:
        # On meta (the scale simulation's fake group has no meta kernel for the coalesced operators)
        # nothing moves, so one call per segment says the same.
        works = [single(o, i, group=unit.group, async_op=async_op) for o, i in zip(outs, ins)]
        return works[-1] if async_op and len(works) == 1 else _Works(works) if async_op else None
    group = unit.group if unit.group is not None else dist.distributed_c10d._get_default_group()
    coalesced = group.allgather_into_tensor_coalesced if op == "all_gather" else group.reduce_scatter_tensor_coalesced
    work = coalesced(outs, ins)
    if not async_op:
        work.wait()
        return None
    return work


def all_reduce_grads(grads: list[torch.Tensor], axis: str, groups: dict, what: str = "partial gradient bucket") -> None:
    """Sum gradients ``grads`` over ``axis`` in place (phase ``grad``): one contiguous tensor directly,
    several through one flat buffer."""
    group = groups[axis]
    if group.size == 1 or not grads:
        return
    flat = grads[0] if len(grads) == 1 and grads[0].is_contiguous() else torch.cat([g.reshape(-1) for g in grads])
    collectives.record("all_reduce", axis, flat, "grad", f"{what} ({len(grads)} tensors)")
    dist.all_reduce(flat, group=group.group)
    if flat is grads[0]:
        return
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class _Works:
    """Several works waited for as one (meta's one call per segment)."""

    def __init__(self, works):
        self.works = [w for w in works if w is not None]

    def wait(self):
        for w in self.works:
            w.wait()
        return True


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
