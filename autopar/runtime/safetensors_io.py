"""Reading slices of safetensors files without reading (or mapping) the rest.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte range of the data) and the raw row-major data.  :class:`SafetensorsFile` parses the
header and reads one tensor's slice with plain positioned reads: the rows it needs, a
bounded block at a time, each block cut to the wanted columns and copied into the result.
A rank's peak memory while loading is therefore its own shards plus one block.

Why not ``safetensors.safe_open(...).get_slice``: it memory-maps the file, so every page a
strided slice touches (a column slice touches every row) is resident and counted against the
process, and its slices take one range per dimension, while a fused projection's shard (a
rank's heads of q, of k and of v) is several ranges of one dimension.

Neighbours: :mod:`autopar.runtime.pretrained` decides which slice each rank reads.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

__all__ = ["SafetensorsFile", "SAFETENSORS_DTYPES", "BLOCK_BYTES"]

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
BLOCK_BYTES = 16 * 1024 * 1024  # the most read at once beyond the slice itself


class SafetensorsFile:
    """One ``.safetensors`` file: its tensors' dtypes and shapes, and slice reads."""

    def __init__(self, path: str | os.PathLike):
        from autopar.errors import AutoparError

        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise AutoparError(f"autopar: {self.path} is not a safetensors file (shorter than its header); "
                                   "expected a file written by safetensors or save_pretrained.")
            (length,) = struct.unpack("<Q", head)
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise AutoparError(f"autopar: {self.path} is not a safetensors file ({exc}); expected a file "
                                   "written by safetensors or save_pretrained.") from exc
        self.metadata = header.pop("__metadata__", {}) or {}
        self.data_start = 8 + length
        self.entries = {}
        for name, entry in header.items():
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise AutoparError(f"autopar: tensor '{name}' in {self.path} has dtype {entry['dtype']}, which "
                                   f"autopar cannot read; expected one of {', '.join(SAFETENSORS_DTYPES)}.")
            self.entries[name] = (dtype, tuple(entry["shape"]), tuple(entry["data_offsets"]))

    def keys(self):
        return self.entries.keys()

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def read(self, name: str, index: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Tensor ``name``, or its slice: ``index[d]`` the ascending positions kept along dim ``d``
        (None: all of them).  Reads only the rows the slice needs, at most :data:`BLOCK_BYTES`
        of them at a time."""
        dtype, shape, (begin, _) = self.entries[name]
        index = list(index or []) + [None] * (len(shape) - len(index or []))
        if not shape:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + begin)
                return _from_bytes(f.read(dtype.itemsize), dtype, ())
        kept = [torch.arange(n) if i is None else i.to(torch.long) for n, i in zip(shape, index)]
        out = torch.empty([len(k) for k in kept], dtype=dtype)
        if out.numel() == 0:
            return out
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        step = max(1, BLOCK_BYTES // max(row_bytes, 1))
        inner = [None if len(k) == n else k for n, k in zip(shape[1:], kept[1:])]
        written = 0
        with open(self.path, "rb") as f:
            for lo, hi in _runs(kept[0]):
                for r0 in range(lo, hi, step):
                    r1 = min(hi, r0 + step)
                    f.seek(self.data_start + begin + r0 * row_bytes)
                    block = _from_bytes(f.read((r1 - r0) * row_bytes), dtype, (r1 - r0, *shape[1:]))
                    for d, keep in enumerate(inner, start=1):
                        if keep is not None:
                            block = block.index_select(d, keep)
                    out[written:written + r1 - r0].copy_(block)
                    written += r1 - r0
        return out


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending positions as maximal runs ``[lo, hi)`` of consecutive values."""
    values = positions.tolist()
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError("slice positions must be ascending")
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs
