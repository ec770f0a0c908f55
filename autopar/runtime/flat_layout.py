"""The flat ``[A | B]`` buffer of one ZeRO unit and its ``dp`` shards.

:class:`FlatLayout` says where each parameter of a unit sits in the unit's flat buffer and
in each rank's shard: segment ``A`` holds the ordinary parameters, ``B`` those whose
gradients are partial sums over another axis; each segment is zero-padded to a multiple of
the shard count and rank ``r`` owns ``[A_r, B_r]``, so one reduce-scatter / all-gather of the
rank-major buffer ``[A_0 B_0 | A_1 B_1 | ...]`` moves exactly the padded sizes.  Used by
:class:`autopar.runtime.zero.ZeroSync` (the strategy) and its unit tests.
"""
from __future__ import annotations

import math

import torch

__all__ = ["FlatLayout"]


class FlatLayout:
    """Where each parameter of a unit sits in the flat ``[A | B]`` buffer and in the shards."""

    def __init__(self, names: list[str], shapes: dict[str, torch.Size], partial: set[str], n: int):
        self.names = list(names)
        self.a_names = [x for x in names if x not in partial]
        self.b_names = [x for x in names if x in partial]
        self.shapes = {x: shapes[x] for x in names}
        self.n = n
        self.na = sum(math.prod(self.shapes[x]) for x in self.a_names)
        self.nb = sum(math.prod(self.shapes[x]) for x in self.b_names)
        self.sa = -(-self.na // n)
        self.sb = -(-self.nb // n)
        self.offsets: dict[str, int] = {}
        offset = 0
        for x in self.a_names + self.b_names:
            self.offsets[x] = offset
            offset += math.prod(self.shapes[x])

    @property
    def shard_numel(self) -> int:
        return self.sa + self.sb

    @property
    def numel(self) -> int:
        return self.na + self.nb

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[A | B]`` (unpadded) from per-parameter tensors."""
        return torch.cat([tensors[x].reshape(-1) for x in self.a_names + self.b_names])

    def rank_major(self, flat: torch.Tensor) -> torch.Tensor:
        """``[A | B]`` -> the padded buffer ``[A_0 B_0 | A_1 B_1 | ...]`` of ``n * shard`` elements.

        A new buffer, written by one copy of ``flat`` and zeros where padding goes: every step's
        gradients pass here, and padding by ``nn.functional.pad`` then ``torch.cat`` cost two
        more passes over the unit (a few percent of a ZeRO-1 step on CPU).  The buffer is never
        ``flat`` itself, which would hold one buffer less than the cost model's
        ``zero_sync_buffer`` (cost/memory.py) and let a one-rank reduce-scatter, which averages
        its buffer in place, write into the caller's tensor."""
        buf = flat.new_empty(self.n * self.shard_numel)
        rows = buf.view(self.n, self.shard_numel)
        _place(rows[:, :self.sa], flat[:self.na])
        _place(rows[:, self.sa:], flat[self.na:])
        return buf

    def from_rank_major(self, buf: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`rank_major`: the unpadded ``[A | B]``."""
        rows = buf.view(self.n, self.sa + self.sb)
        if self.sb == 0:
            return buf[:self.na]
        return torch.cat([rows[:, :self.sa].reshape(-1)[:self.na], rows[:, self.sa:].reshape(-1)[:self.nb]])

    def shard_segments(self, rank: int) -> list[tuple[str, int, int]]:
        """``(name, start, stop)``: the pieces of each parameter inside rank ``rank``'s shard
        ``[A_r | B_r]`` (offsets into the shard; padding belongs to no parameter)."""
        return [(x, start, stop) for x, start, stop, _ in self.shard_pieces(rank)]

    def shard_pieces(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, start, stop, offset)``: as :meth:`shard_segments`, with where the piece
        starts in the parameter's own flattened elements (to write one parameter into a shard)."""
        out = []
        for names, base, size, shard_off in ((self.a_names, 0, self.sa, 0), (self.b_names, self.na, self.sb, self.sa)):
            lo, hi = rank * size, (rank + 1) * size  # this rank's window of the segment
            for x in names:
                start = self.offsets[x] - base
                stop = start + math.prod(self.shapes[x])
                a, b = max(start, lo), min(stop, hi)
                if a < b:
                    out.append((x, shard_off + a - lo, shard_off + b - lo, a - start))
        return out

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> the parameter's view of the unpadded ``[A | B]`` buffer ``flat``.

        One ``torch.split``, not a slice per parameter: a slice's backward is a zero-filled
        gradient of the whole buffer per parameter (summed by autograd), split's is one cat."""
        names = list(self.offsets)  # in offset order: A's parameters, then B's
        pieces = torch.split(flat, [math.prod(self.shapes[x]) for x in names])
        return {x: piece.view(self.shapes[x]) for x, piece in zip(names, pieces)}


def _place(rows: torch.Tensor, segment: torch.Tensor) -> None:
    """Write ``segment`` row-major into ``rows`` (one column block of a rank-major buffer: rank
    ``r``'s row), zeros after its end."""
    width = rows.shape[1]
    full, rest = divmod(segment.numel(), width) if width else (0, 0)
    rows[:full].copy_(segment[:full * width].reshape(full, width))
    if full < rows.shape[0]:
        rows[full, :rest].copy_(segment[full * width:])
        rows[full, rest:].zero_()
        rows[full + 1:].zero_()
