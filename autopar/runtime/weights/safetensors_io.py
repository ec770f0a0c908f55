"""Reading slices of safetensors files without reading (or mapping) the rest, and writing
files whose tensors arrive one piece at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte range of the data) and the raw row-major data.  :class:`SafetensorsFile` parses the
header and reads one tensor's slice with plain positioned reads: the rows it needs, a
bounded block at a time, each block cut to the wanted columns and copied into the result.
Rows kept whole are read straight into the result; otherwise one block buffer is reused.
A rank's peak memory while loading is therefore its own shards plus one block.

Why not ``safetensors.safe_open(...).get_slice``: it memory-maps the file, so every page a
strided slice touches (a column slice touches every row) is resident and counted against the
process, and its slices take one range per dimension, while a fused projection's shard (a
rank's heads of q, of k and of v) is several ranges of one dimension.

Writing: :class:`SafetensorsLayout` fixes a file's header from its tensors' names, dtypes
and shapes alone, so the file can be created (header written, data region sized) before any
value exists; then each rank writes the pieces it holds at their byte offsets with
``os.pwrite`` (:meth:`SafetensorsLayout.write_piece`), one tensor piece in memory at a time.
Why not ``safetensors.torch.save_file``: it takes every tensor of the file in memory at once.

Neighbours: :mod:`autopar.runtime.weights.pretrained` decides which slice each rank reads;
:mod:`autopar.runtime.weights.export` decides which pieces each rank writes.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import struct

import torch

__all__ = ["WEIGHTS_NAME", "INDEX_NAME", "SafetensorsFile", "SafetensorsLayout", "SAFETENSORS_DTYPES", "BLOCK_BYTES", "parse_size"]

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# Hugging Face's file names: one file, or an index of shards (save_pretrained / from_pretrained).
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
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
        whole_rows = all(k is None for k in inner)  # rows read straight into the result, no block
        buffer = None if whole_rows else torch.empty(min(step, len(kept[0])) * row_bytes, dtype=torch.uint8)
        written = 0
        with open(self.path, "rb", buffering=0) as f:
            for lo, hi in _runs(kept[0]):
                for r0 in range(lo, hi, step):
                    r1 = min(hi, r0 + step)
                    f.seek(self.data_start + begin + r0 * row_bytes)
                    if whole_rows:
                        _read_into(f, out[written:written + r1 - r0], self.path)
                    else:  # one block buffer, reused: cut to the wanted columns, copied into the result
                        raw = buffer[:(r1 - r0) * row_bytes]
                        _read_into(f, raw, self.path)
                        block = raw.view(dtype).view((r1 - r0, *shape[1:]))
                        for d, keep in enumerate(inner, start=1):
                            if keep is not None:
                                block = block.index_select(d, keep)
                        out[written:written + r1 - r0].copy_(block)
                    written += r1 - r0
        return out


def _read_into(f, target: torch.Tensor, path: str) -> None:
    """Fill the contiguous tensor ``target`` with the next bytes of ``f``."""
    view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            from autopar.errors import AutoparError
            raise AutoparError(f"autopar: {path} ends inside a tensor's data; expected a complete safetensors "
                               "file (was it truncated or still being written?).")
        done += n


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


# --- writing ---------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or ``"5GB"`` / ``"100KB"`` (powers of 10) / ``"2GiB"`` (of 2), as
    Hugging Face's ``max_shard_size`` reads them."""
    from autopar.errors import AutoparError

    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise AutoparError(f"autopar: max_shard_size={size!r} is not a size; expected a positive number of bytes "
                           "or a string such as '5GB', '500MB' or '2GiB'.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


class SafetensorsLayout:
    """The header and byte offsets of a safetensors file holding ``tensors`` (name -> (dtype,
    shape)), known before any value: tensors are laid out widest dtype first (each one aligned
    to its element size, as safetensors does), in the given order within a dtype width."""

    def __init__(self, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        order = sorted(tensors, key=lambda n: -tensors[n][0].itemsize)  # stable: given order within a width
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        offset = 0
        for name in order:
            dtype, shape = tensors[name]
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.entries[name] = (dtype, tuple(shape), offset)
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data start 8-byte aligned
        self.header = struct.pack("<Q", len(text)) + text
        self.data_bytes = offset

    @property
    def file_bytes(self) -> int:
        return len(self.header) + self.data_bytes

    def create(self, path: str) -> None:
        """Write the header and size the file; the data region reads as zeros until written."""
        with open(path, "wb") as f:
            f.write(self.header)
            f.truncate(self.file_bytes)

    def write_piece(self, fd: int, name: str, local: torch.Tensor, index: list[torch.Tensor | None]) -> None:
        """Write ``local``, the positions ``index[d]`` (ascending; None: all) of tensor ``name`` along
        each dim, into the open file ``fd`` at their offsets: one ``os.pwrite`` per run of
        consecutive positions of the last cut dim, for each kept position of the dims before it."""
        dtype, shape, begin = self.entries[name]
        if local.numel() == 0:
            return
        data = local.detach().to("cpu", dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        base = len(self.header) + begin
        index = list(index) + [None] * (len(shape) - len(index))
        cut = [d for d, i in enumerate(index) if i is not None]
        if not cut:
            _pwrite(fd, view, base)
            return
        last = cut[-1]
        inner = math.prod(shape[last + 1:]) * dtype.itemsize  # bytes of one position of dim `last`
        strides = [math.prod(shape[d + 1:]) * dtype.itemsize for d in range(last)]
        outer = [range(n) if i is None else i.tolist() for n, i in zip(shape[:last], index[:last])]
        runs = _runs(index[last])
        row = len(index[last]) * inner  # bytes of local per combination of outer positions
        for k, positions in enumerate(itertools.product(*outer)):
            start = base + sum(p * s for p, s in zip(positions, strides))
            at = k * row
            for lo, hi in runs:
                _pwrite(fd, view[at:at + (hi - lo) * inner], start + lo * inner)
                at += (hi - lo) * inner


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):  # pwrite may write less than asked (about 2 GB at most per call on Linux)
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done
