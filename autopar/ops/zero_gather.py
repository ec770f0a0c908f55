"""ZeRO-3's in-graph operator: gather one unit's parameters from their ``dp`` shards.

``passes/zero.py`` inserts ``zero_gather(unit)`` before the first node that reads a
parameter of the unit; the call returns the unit's full parameters (views of its gathered flat
buffers, one per segment), all-gathered over ``dp``, and its backward reduce-scatters the unit's
gradient.  The shards and the collectives belong to the ZeRO-3 strategy of the running program
(:class:`autopar.runtime.gradients.zero_fsdp.FullyShardedSync`), which the step context carries as ``zero``
while a micro-batch runs (:mod:`autopar.ops.step`).
"""
from __future__ import annotations

import torch

from autopar.ops.step import find_current

__all__ = ["zero_gather"]


class _Gather(torch.autograd.Function):
    """The unit's shards (one per segment) -> its gathered flat buffers; backward reduce-scatters
    (and averages) the buffers' gradients."""

    @staticmethod
    def forward(ctx, state, unit, *shards):
        ctx.state, ctx.unit, ctx.num_shards = state, unit, len(shards)
        return state.gather_for_forward(unit)

    @staticmethod
    def backward(ctx, *grads):
        reduced = ctx.state.scatter_in_backward(ctx.unit, grads)
        return (None, None, *(reduced if reduced is not None else (None,) * ctx.num_shards))


def zero_gather(unit: int) -> tuple[torch.Tensor, ...]:
    """The parameters of ZeRO-3 unit ``unit``, all-gathered over ``dp`` (called by the program)."""
    step = find_current()
    state = step.zero if step is not None else None
    if state is None:
        raise RuntimeError("autopar: a ZeRO-3 program ran outside ParallelModule.train_step; its parameters "
                           "exist only as shards there. Call pm.train_step, or read pm.state_dict().")
    local = state.local_unit(unit)  # under pp a rank holds the units of its own chunks only
    bufs = _Gather.apply(state, local, *state.shards[local.index])
    return state.unit_views(local, bufs)
