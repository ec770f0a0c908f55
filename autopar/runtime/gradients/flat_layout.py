"""One segment of a ZeRO unit: its parameters in one padded flat buffer, and each rank's shard of it.

:class:`FlatSegment` says where each parameter of a segment sits in the segment's flat buffer
and in each rank's shard.  The buffer holds the parameters one after the other, then zeros up to
``n * shard_numel`` elements (``shard_numel = ceil(numel / n)``); rank ``r``'s shard is the
``r``-th run of ``shard_numel`` elements.  So the buffer *is* rank-major: a reduce-scatter of it
over the ``n`` ranks leaves rank ``r``'s reduced shard exactly where its piece of the buffer
is (in place), and an all-gather of the shards into it leaves every parameter whole where its
view reads it -- no flattening copy and no rank-major copy per step.

A ZeRO unit (:mod:`autopar.runtime.gradients.zero_layout`) has one segment, or two under ZeRO-2/3 when
some of its gradients are partial sums over another axis (norm weights under SP): those form a
second segment, so that every rank holds an equal part of them and sums it over that axis once
per step.  The unit's collectives then run coalesced over its segments: one call.
"""
from __future__ import annotations

import math

import torch

__all__ = ["FlatSegment"]


class FlatSegment:
    """Where each parameter of one segment sits in its padded flat buffer and in the shards.

    ``partial``: the segment holds gradients that are partial sums over another mesh axis."""

    def __init__(self, names: list[str], shapes: dict[str, torch.Size], n: int, partial: bool = False):
        self.names = list(names)
        self.shapes = {x: torch.Size(shapes[x]) for x in names}
        self.n = n
        self.partial = partial
        self.sizes = [math.prod(self.shapes[x]) for x in self.names]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // n)
        self.offsets: dict[str, int] = {}
        offset = 0
        for x, size in zip(self.names, self.sizes):
            self.offsets[x] = offset
            offset += size

    @property
    def padded_numel(self) -> int:
        """Elements of the flat buffer: ``n`` shards."""
        return self.n * self.shard_numel

    def new_buffer(self, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
        """An uninitialised (or zeroed) flat buffer of the segment."""
        make = torch.zeros if zero else torch.empty
        return make(self.padded_numel, dtype=dtype, device=device)

    def write(self, buffer: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """Every parameter's value from ``values`` into ``buffer``, zeros in the padding."""
        for x, view in self.views(buffer).items():
            view.copy_(values[x])
        buffer[self.numel:].zero_()
        return buffer

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> the parameter's view of the flat ``buffer``.

        One ``torch.split`` that includes the padding as a last piece, not a slice per parameter:
        the backward of a split is one ``cat`` (zeros where a piece has no gradient), which gives
        the gradient of the whole padded buffer -- the reduce-scatter's input -- in one tensor."""
        pieces = torch.split(buffer, self.sizes + [self.padded_numel - self.numel])
        return {x: piece.view(self.shapes[x]) for x, piece in zip(self.names, pieces)}

    def rank_piece(self, buffer: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s shard of the flat ``buffer`` (a view)."""
        return buffer[rank * self.shard_numel:(rank + 1) * self.shard_numel]

    def shard_pieces(self, rank: int) -> list[tuple[str, int, int, int]]:
        """``(name, start, stop, offset)``: the pieces of each parameter inside rank ``rank``'s shard
        (``start:stop`` in the shard; ``offset``: where the piece starts in the parameter's own
        flattened elements).  Padding belongs to no parameter."""
        lo, hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for x, size in zip(self.names, self.sizes):
            start = self.offsets[x]
            a, b = max(start, lo), min(start + size, hi)
            if a < b:
                out.append((x, a - lo, b - lo, a - start))
        return out

    def cut(self, values: dict[str, torch.Tensor], rank: int, out: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s shard of whole parameter ``values`` written into ``out`` (zeros in the
        padding), without building the whole buffer."""
        out.zero_()
        for x, start, stop, offset in self.shard_pieces(rank):
            out[start:stop].copy_(values[x].reshape(-1)[offset:offset + stop - start])
        return out
