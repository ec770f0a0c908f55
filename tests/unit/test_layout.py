"""Parameter layouts and the byte convention, in one process."""
from __future__ import annotations

import pytest
import torch

from autopar.ops.collectives import ring_bytes
from autopar.runtime.layout import shard_local
from autopar.passes.context import ParamShard


def test_plain_shard_takes_contiguous_rows():
    full = torch.arange(24.0).view(6, 4)
    parts = [shard_local(full, {"tp": ParamShard(0)}, {"tp": (r, 3)}) for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    assert torch.equal(parts[1], full[2:4])


def test_block_shard_keeps_each_ranks_heads_of_every_part():
    # fused q|k|v with q = 4 rows, k = 2 rows, v = 2 rows, split over tp=2
    full = torch.arange(8.0).view(8, 1)
    shard = {"tp": ParamShard(0, (4, 2, 2))}
    rank0 = shard_local(full, shard, {"tp": (0, 2)}).flatten().tolist()
    rank1 = shard_local(full, shard, {"tp": (1, 2)}).flatten().tolist()
    assert rank0 == [0, 1, 4, 6]  # q rows 0-1, k row 4, v row 6
    assert rank1 == [2, 3, 5, 7]


def test_two_axes_compose():
    full = torch.arange(16.0).view(4, 4)
    shards = {"tp": ParamShard(0), "dp": ParamShard(1)}
    part = shard_local(full, shards, {"tp": (1, 2), "dp": (0, 2)})
    assert torch.equal(part, full[2:4, 0:2])


@pytest.mark.parametrize("op,nbytes,n,expected", [
    ("all_gather", 100, 4, (300, 300)),          # (n-1) * shard
    ("reduce_scatter", 400, 4, (300, 300)),      # (n-1)/n * buffer
    ("all_reduce", 400, 4, (600, 600)),          # 2(n-1)/n * buffer
    ("all_to_all", 400, 4, (300, 300)),          # the part addressed to the other ranks
    ("send", 64, 2, (64, 64)),
])
def test_ring_byte_convention(op, nbytes, n, expected):
    assert ring_bytes(op, nbytes, n) == pytest.approx(expected)
