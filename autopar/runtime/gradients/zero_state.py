"""Whole values and optimizer state over ZeRO shards: what both ZeRO strategies read and write.

A ZeRO strategy (:mod:`autopar.runtime.gradients.zero_optimizer`, ZeRO-1/2; :mod:`autopar.runtime.gradients.zero_fsdp`,
ZeRO-3) keeps, per unit of its :class:`autopar.runtime.gradients.zero_layout.ZeroLayout`, one tensor per
segment holding this rank's piece: the tensors the optimizer steps (``pieces``).  The functions
here move between those pieces and whole parameters under graph names -- for state dicts,
checkpoints, exports and weight loading -- and compute the clipping norm over them.  Reading whole
values all-gathers (collective: every rank of the unit's axis calls it, in the same order) and is
not recorded (it is not a training step's traffic); writing one parameter never gathers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import torch

from autopar.runtime.gradients import fused_step
from autopar.runtime.gradients.zero_layout import ZeroLayout, ZeroUnit, gather_unit

__all__ = ["gather_whole", "read_whole", "cut_pieces", "write_piece", "optimizer_state", "load_optimizer_state",
           "grad_square_sum"]


def gather_whole(unit: ZeroUnit, pieces: list[torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Name -> the whole value of each of the unit's parameters, all-gathered from every rank's
    ``pieces`` (in ``dtype``, default the pieces'): views of new buffers, not recorded."""
    bufs, srcs = [], []
    for seg, piece in zip(unit.segments, pieces):
        src = piece.detach().to(dtype or piece.dtype).contiguous()
        srcs.append(src)
        bufs.append(seg.new_buffer(src.dtype, src.device))
    gather_unit(unit, bufs, srcs, None)
    out: dict[str, torch.Tensor] = {}
    for seg, buf in zip(unit.segments, bufs):
        out.update(seg.views(buf))
    return out


def read_whole(layout: ZeroLayout, pieces: list[list[torch.Tensor]], names: Iterable[str], dtype: torch.dtype | None,
               held: Callable[[str], torch.Tensor | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole value)`` for each of ``names``: ``held(name)`` where that is not None (a value
    the strategy holds whole), else its unit's pieces gathered (in ``dtype``), once for the unit's
    names that follow each other, the previous unit dropped first: at most one unit whole."""
    current: tuple | None = None
    for name in names:
        value = held(name)
        if value is not None:
            yield name, value
            continue
        unit = layout.unit_of[name]
        if current is None or current[0] is not unit:
            current = None
            with torch.no_grad():
                current = (unit, gather_whole(unit, pieces[unit.index], dtype))
        yield name, current[1][name]


def cut_pieces(unit: ZeroUnit, values: dict[str, torch.Tensor], pieces: list[torch.Tensor]) -> None:
    """This rank's pieces of the unit re-cut from whole ``values`` (graph name -> tensor)."""
    with torch.no_grad():
        for seg, piece in zip(unit.segments, pieces):
            seg.cut({x: values[x].detach() for x in seg.names}, unit.rank, piece)


def write_piece(unit: ZeroUnit, name: str, value: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Parameter ``name``'s part of this rank's pieces set from its whole ``value`` (not collective)."""
    flat = value.detach().reshape(-1)
    with torch.no_grad():
        for seg, piece in zip(unit.segments, pieces):
            for x, start, stop, offset in seg.shard_pieces(unit.rank):
                if x == name:
                    piece[start:stop].copy_(flat[offset:offset + stop - start])


def optimizer_state(layout: ZeroLayout, stepped: list[list[torch.Tensor]],
                    optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Graph parameter name -> {state key: tp-local tensor}: each piece's state gathered over its unit's ranks."""
    out: dict[str, dict] = {}
    for unit, pieces in zip(layout.units, stepped):
        for seg, piece in zip(unit.segments, pieces):
            for key, value in optimizer.state.get(piece, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    for x in seg.names:
                        out.setdefault(x, {})[key] = value
                    continue
                buf = value.detach().contiguous()
                if unit.num_shards > 1:
                    full = seg.new_buffer(buf.dtype, buf.device)
                    gather_unit(_one_segment(unit, seg), [full], [buf], None)
                    buf = full
                for x, v in seg.views(buf).items():
                    out.setdefault(x, {})[key] = v.clone()
    return out


def load_optimizer_state(layout: ZeroLayout, stepped: list[list[torch.Tensor]], optimizer: torch.optim.Optimizer,
                         entries: dict[str, dict[str, torch.Tensor]]) -> None:
    """Inverse of :func:`optimizer_state`: this rank's piece of every segment's state cut from ``entries``."""
    for unit, pieces in zip(layout.units, stepped):
        for seg, piece in zip(unit.segments, pieces):
            per_name = {x: entries.get(x, {}) for x in seg.names}
            keys = set.intersection(*(set(e) for e in per_name.values()))
            new = {}
            for key in sorted(keys):
                first = per_name[seg.names[0]][key]
                if not torch.is_tensor(first) or first.dim() == 0:
                    new[key] = first.clone() if torch.is_tensor(first) else first
                    continue
                out = torch.empty(seg.shard_numel, dtype=piece.dtype, device=piece.device)
                new[key] = seg.cut({x: per_name[x][key] for x in seg.names}, unit.rank, out)
            if new:  # the scalar step on the piece's device where the optimizer is fused
                optimizer.state[piece] = fused_step.place_state(optimizer, piece, new)


def grad_square_sum(layout: ZeroLayout, stepped: Iterable[list[torch.Tensor]], weights: dict[str, float],
                    device: torch.device) -> torch.Tensor:
    """Sum of ``weights[name] * n * grad^2`` over the elements of this rank's pieces' gradients: each
    rank's piece is a distinct ``1/n`` of the unit's gradient (padding is zero)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for unit, pieces in zip(layout.units, stepped):
        for seg, piece in zip(unit.segments, pieces):
            if piece.grad is None:
                continue
            grad = piece.grad.detach().double()
            for name, start, stop, _ in seg.shard_pieces(unit.rank):
                total += weights[name] * unit.num_shards * grad[start:stop].square().sum()
    return total


def _one_segment(unit: ZeroUnit, seg) -> ZeroUnit:
    """The unit restricted to one segment (a collective over one of its buffers)."""
    return dataclasses.replace(unit, segments=(seg,))
