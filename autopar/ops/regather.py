"""Sequence parallelism's backward re-gather: save the sequence shard, all-gather it again in backward.

Under SP each column-parallel group (q/k/v, gate/up, the LM head) reads the all-gather of the
rank's sequence shard ``[.., s/tp, ..] -> [.., s, ..]``, and its GEMMs save that full input for
their weight gradients: ``tp`` times the bytes of the shard, the largest activation of a layer
at high ``tp``.  Megatron-LM saves the shard and all-gathers it again in backward (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, section 4.2.2);
this module does the same for every op of the user's graph, not only for fused GEMMs.

How: :func:`keeping_shards` pushes ``saved_tensors_hooks`` for a micro-batch.  The SP pass's
all-gathers (:func:`autopar.ops.collectives.all_gather` with ``regather=True``) register their
output with :meth:`SavedGathers.register`.  When autograd saves a tensor on that output's
storage (the GEMM's input, or a view of it), the pack hook stores a handle holding the
*shard*; the first unpack in backward all-gathers the shard again (recorded as a ``bwd``
all-gather), later unpacks of the same output reuse it, and it is freed with the last handle.

The hooks delegate every other tensor -- and the shard itself -- to the hooks that were active
when they were pushed (the memory meter's, ZeRO-3's: :mod:`autopar.runtime.stepping.memory`,
:mod:`autopar.runtime.gradients.zero`), so those still count and replace what they own.  Inside an
activation-recompute region torch's checkpoint hooks are on top and nothing is saved; the
recomputed forward's all-gather is the region's own (passes/recompute.py), not a re-gather.

Neighbours: :mod:`autopar.ops.collectives` (the all-gather and the byte records), the cost
model's re-gather row and activation terms (cost/comm.py, cost/memory.py).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from autopar.compat import storage_key, tensor_base, top_saved_tensors_hooks
from autopar.ops.collectives import all_gather, gather_again
from autopar.ops.step import activate, find_current

__all__ = ["SavedGathers", "keeping_shards", "regathers"]


class _Gathered:
    """One SP all-gather output: its shard (until it is first saved for backward; then as the
    outer hooks packed it), how to gather it, and the re-gathered copy."""

    __slots__ = ("shard", "packed", "dim", "axis", "tag", "step", "full")

    def __init__(self, shard: torch.Tensor, dim: int, axis: str, tag: str, step) -> None:
        self.shard, self.dim, self.axis, self.tag, self.step = shard, dim, axis, tag, step
        self.packed: Any = None
        self.full: torch.Tensor | None = None


class _Handle:
    """What autograd keeps instead of a tensor on a gathered storage."""

    __slots__ = ("gathered", "size", "stride", "offset")

    def __init__(self, gathered: _Gathered, t: torch.Tensor) -> None:
        self.gathered, self.size, self.stride, self.offset = gathered, t.size(), t.stride(), t.storage_offset()


class SavedGathers:
    """The saved-tensor hooks of one micro-batch (see the module docstring)."""

    def __init__(self, step, outer: tuple | None) -> None:
        self.step = step
        self._outer_pack, self._outer_unpack = outer if outer is not None else (None, None)
        # storage_key(gathered buffer) -> (weak reference, _Gathered); an entry leaves with its buffer
        self._live: dict[tuple, tuple] = {}

    def register(self, full: torch.Tensor, shard: torch.Tensor, dim: int, axis: str, tag: str) -> None:
        """``full`` is the all-gather of ``shard`` along ``dim`` over ``axis``."""
        # The gather may return a view of its buffer (a no-op .contiguous(), e.g. one batch row):
        # saved views name that buffer as their base, so key by it.
        full = tensor_base(full)
        key = storage_key(full)
        ref = weakref.ref(full, lambda _ref, key=key: self._live.pop(key, None))
        self._live[key] = (ref, _Gathered(shard.detach(), dim, axis, tag, self.step))

    def pack(self, t: torch.Tensor):
        entry = self._live.get(storage_key(t))
        if entry is None or entry[0]() is None:
            # ``t.detach()``, never ``t``: a saved *output* keeps its grad_fn, whose node would
            # then own (in C++, out of the garbage collector's sight) a tensor owning that node.
            # Backward frees the cycle, but a graph it never runs through (retain_graph, a
            # pipeline stage's unused branch) would keep its activations, the program and its
            # process groups alive for good.  Lossless: unpack re-attaches the grad_fn, and the
            # version counter is shared.
            return self._outer_pack(t) if self._outer_pack is not None else t.detach()
        gathered = entry[1]
        if gathered.shard is not None:  # backward keeps the shard: the outer hooks see (and count) it once
            shard, gathered.shard = gathered.shard, None
            gathered.packed = self._outer_pack(shard) if self._outer_pack is not None else shard
        return _Handle(gathered, t)

    def unpack(self, packed):
        if not isinstance(packed, _Handle):
            return self._outer_unpack(packed) if self._outer_unpack is not None else packed
        g = packed.gathered
        if g.full is None:
            g.full = _regather(g, self._outer_unpack)
        # The copy lives as long as a handle does: autograd frees a node's saved tensors after its
        # backward, so it goes with the last user -- and survives from the input half of a split
        # backward (zbv, dualpipev; retain_graph) to its weight half, which unpacks again.
        return g.full.as_strided(packed.size, packed.stride, packed.offset)


def _regather(g: _Gathered, outer_unpack) -> torch.Tensor:
    shard = outer_unpack(g.packed) if outer_unpack is not None else g.packed
    # Backward may run where the step context is not current (another thread): use the forward's.
    with activate(g.step), torch.no_grad():
        return gather_again(shard, g.dim, g.axis, g.tag)


def regathers(gm: torch.fx.GraphModule) -> bool:
    """Does ``gm`` hold an all-gather whose output backward re-gathers (the SP pass's)?"""
    return any(n.op == "call_function" and n.target is all_gather and n.kwargs.get("regather")
               for n in gm.graph.nodes)


@contextlib.contextmanager
def keeping_shards(enabled: bool = True) -> Iterator[SavedGathers | None]:
    """Push the re-gather hooks for one micro-batch (or a pipelined step), innermost.
    ``enabled=False`` (a program without :func:`regathers`) pushes nothing: every saved tensor
    would pass through them to the outer hooks, at a Python call each (2-3% of a step)."""
    step = find_current()
    if step is None or not enabled:
        yield None
        return
    saved = SavedGathers(step, top_saved_tensors_hooks())
    with activate(step, regather=saved), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        yield saved
