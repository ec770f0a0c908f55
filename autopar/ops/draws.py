"""Random draws over a data-parallel rank's rows: the whole batch's numbers, this rank's rows kept.

A model that draws random numbers outside dropout (PhiMoE's router samples its experts in train
mode: ``empty_like(scores).exponential_()``, ``rand_like(best)``, ``.uniform_()``) draws them from
the default generator, which one device calls once for every token of the batch.  A dp rank
holding ``1/dp`` of the rows would draw as many numbers for its own rows from the start of the
same stream: the first rows' numbers, on every rank.  :func:`rows_draw`, which the batch
propagation puts in place of such a draw (``passes/random_draws.py``), draws the *whole* batch's
tensor, ``dp`` times the rows along the rank's row dim, with the same op and arguments from the
default generator, and keeps rank ``r``'s rows ``r * n .. (r + 1) * n`` (the rows the runtime
hands it: ``autopar.runtime.stepping.batching.rank_rows``).  Every rank's generator then advances
as one device's does, draw after draw.

Exact (the one device's numbers, bit for bit) when every rank's default generator is in the state
one device's would be in, as when every rank seeds it alike (``torch.manual_seed(seed)`` on every
rank, as ``autopar verify`` and the zoo do); with different seeds per rank it is still a valid
draw (the rows of independent draws), not the one device's.  The whole tensor is drawn in the
layout of the rank's (the same order of dims in memory), since a fill walks memory.  Outside a
step, on the meta device or on one rank it is the op itself.

Neighbours: ``passes/random_draws.py`` (which draws get it), ``passes/draw_rules.py`` (their
placements), :mod:`autopar.ops.rng` (dropout's own streams).
"""
from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from autopar.ops.step import find_current

__all__ = ["rows_draw", "SIZED"]

# Draws that take their shape as a list (the argument's index), not from a tensor.
SIZED = {"aten::rand.default": 0, "aten::randn.default": 0, "aten::randint.default": 1, "aten::randint.low": 2}


def _op(name: str):
    qualified, overload = name.rsplit(".", 1)
    namespace, op = qualified.split("::")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _empty_in_layout(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """An empty tensor of ``shape`` whose dims lie in memory in the order of ``x``'s."""
    if x.is_contiguous():
        return x.new_empty(shape)
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first (stable: ties keep dim order)
    inverse = sorted(range(x.dim()), key=order.__getitem__)
    return x.new_empty([shape[d] for d in order]).permute(inverse)


@has_side_effect  # it advances the default generator: never dropped as dead code
def rows_draw(op: str, dim: int, axis: str, *args, **kwargs) -> torch.Tensor:
    """``op(*args, **kwargs)`` (``op`` by name, ``"aten::exponential_.default"``) drawn for the whole
    batch of data axis ``axis``: its local rows along ``dim`` times the axis size, this rank's rows
    kept (in place, into the tensor an in-place fill was given)."""
    fn = _op(op)
    step = find_current()
    group = step.groups.get(axis) if step is not None else None
    if group is None or group.size == 1:
        return fn(*args, **kwargs)
    if op in SIZED:
        at = SIZED[op]
        if torch.device(kwargs.get("device") or "cpu").type == "meta":
            return fn(*args, **kwargs)
        size = [int(s) for s in args[at]]
        rows = size[dim]
        size[dim] = rows * group.size
        whole = fn(*args[:at], size, *args[at + 1:], **kwargs)
        return whole.narrow(dim, group.rank * rows, rows).contiguous()
    x = args[0]
    if x.device.type == "meta":
        return fn(*args, **kwargs)
    rows = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = rows * group.size
    whole = fn(_empty_in_layout(x, shape), *args[1:], **kwargs)
    mine = whole.narrow(dim, group.rank * rows, rows)
    if op.split("::")[1].split(".")[0].endswith("_"):  # an in-place fill: into the tensor it was given
        return x.copy_(mine)
    memory_format = kwargs.get("memory_format") or torch.preserve_format
    return torch.empty_like(x, dtype=whole.dtype, memory_format=memory_format).copy_(mine)
