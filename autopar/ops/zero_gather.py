"""ZeRO-3's in-graph operator: gather one unit's parameters from their ``dp`` shards.

``passes/zero.py`` inserts ``zero_gather(unit)`` before the first node that reads a
parameter of the unit; the call returns the unit's full parameters (views of one flat
buffer), all-gathered over ``dp``, and its backward reduce-scatters the unit's gradient.
The shards and the collectives belong to the ZeRO-3 strategy of the running program
(:class:`autopar.runtime.zero.ZeroSync`), which the step context carries as ``zero``
while a micro-batch runs (:mod:`autopar.ops.step`).
"""
from __future__ import annotations

import torch

from autopar.ops.step import find_current

__all__ = ["zero_gather"]


class _Gather(torch.autograd.Function):
    """Shard -> the unit's full ``[A | B]`` buffer; backward reduce-scatters (and averages)."""

    @staticmethod
    def forward(ctx, shard, state, unit):
        ctx.state, ctx.unit = state, unit
        return state.gather_for_forward(unit, shard)

    @staticmethod
    def backward(ctx, grad):
        return ctx.state.scatter_in_backward(ctx.unit, grad), None, None


def zero_gather(unit: int) -> tuple[torch.Tensor, ...]:
    """The parameters of ZeRO-3 unit ``unit``, all-gathered over ``dp`` (called by the program)."""
    step = find_current()
    state = step.zero if step is not None else None
    if state is None:
        raise RuntimeError("autopar: a ZeRO-3 program ran outside ParallelModule.train_step; its parameters "
                           "exist only as shards there. Call pm.train_step, or read pm.state_dict().")
    unit = state.local_unit(unit)  # under pp a rank holds the units of its own chunks only
    flat = _Gather.apply(state.shards[unit], state, unit)
    return state.unit_views(unit, flat)
