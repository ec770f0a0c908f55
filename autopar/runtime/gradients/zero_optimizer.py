"""ZeRO-1/2 as Megatron's distributed optimizer: whole parameters in flat buffers, the optimizer on this rank's shard.

:class:`DistributedOptimizer` is the gradient-sync strategy (:class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`)
:class:`autopar.runtime.module.ParallelModule` uses for ``zero=1`` and ``zero=2``.  It composes:

* a :class:`autopar.runtime.gradients.zero_layout.ZeroLayout` (the units: the ``dp`` gradient buckets);
* the parameters: each unit's live in flat buffers (one per segment,
  :class:`autopar.runtime.gradients.flat_layout.FlatSegment`) of which the module's parameters are views;
* what the optimizer steps, one tensor per segment: this rank's piece of the parameter buffer
  itself (a view: no second copy of the shard), or under mixed precision an fp32 master of it;
* the gradient policy: :class:`autopar.runtime.gradients.zero_grads.KeptGrads` (ZeRO-1) or
  :class:`autopar.runtime.gradients.zero_grads.ScatteredGrads` (ZeRO-2), which brings each unit's
  gradients to the shard;
* whole values and optimizer state over the shards: :mod:`autopar.runtime.gradients.zero_state`.

After the optimizer step every unit's all-gather starts, in place (each rank's updated piece is
already where the buffer holds it; under mixed precision the master is first cast into it) and
asynchronously, one per unit; each is waited for right before the next forward first reads one of
the unit's parameters (:class:`_FirstUse`, a torch-function mode active only while gathers are in
flight), or before anything else reads or writes parameters (:meth:`DistributedOptimizer.await_parameters`).
Why at run time and not a graph node as ZeRO-3's ``zero_gather``: ZeRO-1/2 programs are ZeRO-0's
graph (their views, byte predictions and compiled program stay those of plain dp), and the same
Parameter objects are read by the flat graph, by torch's pipeline stages and by a compiled copy.
Code that reads ``pm.gm``'s parameters directly between two steps must call ``await_parameters()``
first.

Event recording (for tests, off by default): set ``events`` to a list and the strategy appends
``(kind, unit)`` as it starts reduce-scatters (``reduce_scatter``), ends a micro-batch's backward
(``backward_end``, unit None), starts all-gathers (``all_gather``), begins a micro-batch with
gathers in flight (``forward_begin``, unit: how many) and waits for one (``all_gather_wait``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from autopar.runtime.gradients import zero_state
from autopar.runtime.gradients.zero_grads import KeptGrads, ScatteredGrads
from autopar.runtime.gradients.zero_layout import ZeroLayout, gather_unit

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    """ZeRO stage ``zero_stage`` (1 or 2) over the ``dp`` axis (see the module docstring).

    ``originals``: under mixed precision, graph name -> this rank's piece of the user's fp32 tensor
    (the masters are cut from it)."""

    def __init__(self, gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer, zero_stage: int,
                 originals: dict[str, torch.Tensor] | None = None):
        self.gm, self.zero_stage = gm, zero_stage
        self.mixed = originals is not None
        self.layout = ZeroLayout(gm, program, buckets, groups, zero_stage)
        params = dict(gm.named_parameters())
        self._params = params
        self.param_bufs: list[list[torch.Tensor]] = []
        self.pieces: list[list[nn.Parameter]] = []
        with torch.no_grad():
            for unit in self.layout.units:
                bufs = []
                for seg in unit.segments:
                    buf = seg.write(seg.new_buffer(unit.dtype, params[seg.names[0]].device),
                                    {x: params[x].detach() for x in seg.names})
                    for x, view in seg.views(buf).items():
                        params[x].data = view
                    bufs.append(buf)
                self.param_bufs.append(bufs)
                self.pieces.append([self._stepped(unit, seg, buf, originals) for seg, buf in zip(unit.segments, bufs)])
        self.optimizer = make_optimizer([p for pieces in self.pieces for p in pieces])
        self.grads = (KeptGrads(self.layout, params, self.pieces, mixed=self.mixed, buckets=buckets,
                                pipeline=program.pipeline, num_microbatches=program.plan.mb, events=None)
                      if zero_stage == 1 else ScatteredGrads(self.layout, params, self.pieces, mixed=self.mixed,
                                                             events=None))
        # The after-step all-gathers in flight: unit -> work, and id(parameter) -> its unit.
        self._gathering: dict[int, object] = {}
        self._gathering_params: dict[int, int] = {}

    def _stepped(self, unit, seg, buf: torch.Tensor, originals) -> nn.Parameter:
        """What the optimizer steps for one segment: this rank's piece of the parameter buffer, or
        (mixed precision) an fp32 master of it cut from the user's tensors."""
        piece = seg.rank_piece(buf, unit.rank)
        if originals is None:
            return nn.Parameter(piece, requires_grad=True)  # a view: stepping it updates the buffer
        master = torch.empty(seg.shard_numel, dtype=torch.float32, device=buf.device)
        return nn.Parameter(seg.cut({x: originals[x] for x in seg.names}, unit.rank, master), requires_grad=True)

    @property
    def units(self) -> list[tuple[str, ...]]:
        """Each unit's parameter names."""
        return [u.names for u in self.layout.units]

    @property
    def events(self) -> list | None:
        """The event list tests set (see the module docstring); None: not recorded."""
        return self.grads.events

    @events.setter
    def events(self, value: list | None) -> None:
        self.grads.events = value

    def _event(self, kind: str, unit: int | None = None) -> None:
        if self.grads.events is not None:
            self.grads.events.append((kind, unit))

    # --- the step -----------------------------------------------------------------------

    @contextlib.contextmanager
    def microbatch(self, last: bool = False) -> Iterator[None]:
        """One flat micro-batch's forward and backward: the previous step's all-gathers waited for at
        first use; ZeRO-1 starts reduce-scatters in the ``last`` one's backward, ZeRO-2 in every one's."""
        if isinstance(self.grads, KeptGrads):
            self.grads.arm(last)
        try:
            with self.first_use():
                yield
        except BaseException:
            self.grads.reset()
            raise
        finally:
            if isinstance(self.grads, KeptGrads):
                self.grads.disarm()
        self._event("backward_end")
        self.grads.after_backward(None, "full")

    @contextlib.contextmanager
    def pipeline_step(self) -> Iterator[None]:
        """A pipelined step (every action of this rank's chunks).  A V-shaped schedule's evaluation
        runs a whole step and drops its gradients: whatever its backward started is dropped first."""
        self.grads.reset()
        with self.first_use():
            yield

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """After backward action ``kind`` of pipeline chunk ``chunk`` (see the protocol)."""
        if kind != "inference":  # torch's first-step shape inference makes no parameter gradient
            self.grads.after_backward(chunk, kind)

    def chunk_shards(self, chunk: int) -> list:
        """ZeRO-3's flat shards of a pipeline chunk: none under ZeRO-1/2."""
        return []

    def sync(self) -> None:
        self.grads.sync()

    def step(self) -> None:
        """The optimizer step on the shards, then their in-place all-gathers started."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.grads.after_step()
        self._gather_into_params()

    def scale_grads(self, coef: float) -> None:
        self.grads.scale(coef)

    def grad_square_sum(self, weights: dict[str, float], device: torch.device) -> torch.Tensor:
        return zero_state.grad_square_sum(self.layout, self.pieces, weights, device)

    @contextlib.contextmanager
    def forward_only(self) -> Iterator[None]:
        """An evaluation forward: the after-step all-gathers waited for first."""
        self.await_parameters()
        yield

    # --- the after-step all-gathers ----------------------------------------------------------

    def _gather_into_params(self) -> None:
        """Every unit's updated piece (the master cast into it, under mixed precision) all-gathered in
        place, asynchronously; on the meta device (scale simulation) at once."""
        self.await_parameters()  # (none in flight: a step follows a forward, which waited)
        with torch.no_grad():
            for unit, bufs, pieces in zip(self.layout.units, self.param_bufs, self.pieces):
                own = [seg.rank_piece(b, unit.rank) for seg, b in zip(unit.segments, bufs)]
                if self.mixed:
                    for piece, master in zip(own, pieces):
                        piece.copy_(master)
                if unit.num_shards == 1:
                    continue
                if bufs[0].is_meta:
                    gather_unit(unit, bufs, own, "step")
                    continue
                self._event("all_gather", unit.index)
                self._gathering[unit.index] = gather_unit(unit, bufs, own, "step", async_op=True)
                for x in unit.names:
                    self._gathering_params[id(self._params[x])] = unit.index

    def _await_unit(self, index: int) -> None:
        work = self._gathering.pop(index)
        for x in self.layout.units[index].names:
            self._gathering_params.pop(id(self._params[x]), None)
        work.wait()
        self._event("all_gather_wait", index)

    def await_parameters(self) -> None:
        """Wait for every after-step all-gather still in flight: called by each path that reads or
        writes the module's parameters other than the next forward (state dicts, checkpoints,
        exports, evaluation, ``full_parameters``, ``read_parameters``, ``write_parameter``)."""
        for index in sorted(self._gathering):
            self._await_unit(index)

    def await_read(self, t: torch.Tensor) -> None:
        """Before a call reads ``t``: if it is a parameter whose unit's after-step all-gather is in
        flight, wait for that unit (:class:`_FirstUse`)."""
        index = self._gathering_params.get(id(t))
        if index is not None:
            self._await_unit(index)

    def gathers_in_flight(self) -> int:
        """How many after-step all-gathers are in flight."""
        return len(self._gathering)

    def scatters_in_flight(self) -> int:
        """How many gradient reduce-scatters are in flight."""
        return self.grads.in_flight()

    def early_units(self) -> list[int]:
        """The units whose reduce-scatter may start in backward (ZeRO-1: no gradient of theirs is
        first summed over another axis; ZeRO-2: every unit)."""
        return [u.index for u in getattr(self.grads, "early", self.layout.units)]

    @contextlib.contextmanager
    def first_use(self) -> Iterator[None]:
        """Around a training micro-batch (or pipelined step): each after-step gather in flight is
        waited for when a call first reads one of its unit's parameters, the rest when the block ends."""
        if not self._gathering:
            yield
            return
        self._event("forward_begin", len(self._gathering))
        try:
            with _FirstUse(self):
                yield
        finally:
            self.await_parameters()

    # --- whole parameters and state ------------------------------------------------------------

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Graph name -> the whole (tp-local) parameter: the module's own (whole already), or under
        mixed precision the fp32 masters gathered; ``write_back`` re-cuts the masters from them and
        refreshes the bf16 parameters (without mixed precision the shards are views: nothing to do)."""
        self.await_parameters()
        if not self.mixed:
            yield {x: self._params[x] for u in self.layout.units for x in u.names}
            return
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for unit, pieces in zip(self.layout.units, self.pieces):
                values.update({x: v.clone() for x, v in zero_state.gather_whole(unit, pieces, torch.float32).items()})
        yield values
        if write_back:
            with torch.no_grad():
                for unit, pieces in zip(self.layout.units, self.pieces):
                    zero_state.cut_pieces(unit, values, pieces)
                    for x in unit.names:
                        self._params[x].copy_(values[x])

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` (its tp-local shape): the module's (whole) parameter, and under
        mixed precision this rank's piece of its master; nothing is gathered."""
        self.await_parameters()  # a gather still in flight would overwrite the value later
        with torch.no_grad():
            self._params[name].copy_(value)
        unit = self.layout.unit_of.get(name)
        if unit is not None and self.mixed:
            zero_state.write_piece(unit, name, value, self.pieces[unit.index])

    def read_parameters(self, names):
        """``(name, value)`` for each graph parameter of ``names`` (its tp-local shape; the fp32
        master under mixed precision: each unit gathered once for its names that follow each other,
        collective over the unit's ranks)."""
        self.await_parameters()

        def held(name):
            whole = not self.mixed or name not in self.layout.unit_of
            return self._params[name].detach() if whole else None
        return zero_state.read_whole(self.layout, self.pieces, names, torch.float32, held)

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return zero_state.optimizer_state(self.layout, self.pieces, self.optimizer)

    def load_optimizer_state(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        zero_state.load_optimizer_state(self.layout, self.pieces, self.optimizer, entries)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Under mixed precision the fp32 masters (none otherwise: the shards are the parameters'
        buffers); the gradients held beyond the parameters' ``.grad``."""
        return {"params": [], "master_params": [p for ps in self.pieces for p in ps] if self.mixed else [],
                "grads": self.grads.memory_tensors()}


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

    def __init__(self, sync: DistributedOptimizer):
        super().__init__()
        self.sync = sync

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.sync.gathers_in_flight() and _reads_values(func):
            for arg in (*args, *(kwargs or {}).values()):
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if isinstance(t, torch.Tensor):
                        self.sync.await_read(t)
        return func(*args, **(kwargs or {}))
