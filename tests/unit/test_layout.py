"""Parameter layouts and the byte convention, in one process."""
from __future__ import annotations

import pytest
import torch

from autopar.ops.collectives import record, record_p2p
from autopar.ops.step import AxisGroup, StepContext, activate
from autopar.runtime.weights.layout import local_index, pad_piece, shard_local, unpad_piece
from autopar.passes.context import ParamShard


def test_plain_shard_takes_contiguous_rows():
    full = torch.arange(24.0).view(6, 4)
    parts = [shard_local(full, {"tp": ParamShard(0)}, {"tp": (r, 3)}) for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    assert torch.equal(parts[1], full[2:4])


def test_uneven_vocabulary_shard_is_padded():
    """tp=4 over 10 rows: 3 rows per rank, the 2 rows past 10 (on the last rank) are zero padding;
    a checkpoint piece read at local_index pads to the same, and unpad_piece drops it again."""
    full = torch.arange(1.0, 21.0).view(10, 2)
    shards = {"tp": ParamShard(0, size=10)}
    parts = [shard_local(full, shards, {"tp": (r, 4)}) for r in range(4)]
    assert all(p.shape == (3, 2) for p in parts)
    assert torch.equal(torch.cat(parts)[:10], full) and not torch.cat(parts)[10:].any()
    for r, part in enumerate(parts):
        index = local_index((10, 2), shards, {"tp": (r, 4)})
        piece = full[index[0]]
        assert torch.equal(pad_piece(piece, (10, 2), shards, {"tp": (r, 4)}), part)
        assert torch.equal(unpad_piece(part, tuple(piece.shape)), piece)


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


def _recorded(issue) -> list[tuple[str, float, float]]:
    """(op, bytes sent, bytes received) of what ``issue()`` records, as this rank of tp=4 and pp=2
    (no process group: the recorder is what is checked)."""
    step = StepContext(groups={"tp": AxisGroup(None, 4, 1), "pp": AxisGroup(None, 2, 0)})
    with activate(step):
        issue()
    return [(r.op, r.bytes_sent, r.bytes_recv) for r in step.recorder.records]


# 100 fp32 elements (400 B) on a group of 4, by the ring convention of docs/architecture.md
@pytest.mark.parametrize("op,expected", [
    ("all_gather", 3 * 400),           # (n-1) x the shard this rank contributes
    ("reduce_scatter", 3 * 400 / 4),   # (n-1)/n x the full buffer
    ("all_reduce", 2 * 3 * 400 / 4),   # 2(n-1)/n x the buffer (reduce-scatter + all-gather)
    ("all_to_all", 3 * 400 / 4),       # the parts addressed to the other n-1 ranks (even split)
])
def test_collectives_record_the_ring_convention(op, expected):
    t = torch.zeros(100)
    assert _recorded(lambda: record(op, "tp", t, "fwd", "test")) == [(op, expected, expected)]


def test_point_to_point_records_what_each_side_moves():
    t = torch.zeros(16)  # 64 B: a send sends them, a recv receives them
    issued = _recorded(lambda: (record_p2p("send", "pp", t, "fwd", "test"), record_p2p("recv", "pp", t, "bwd", "test")))
    assert issued == [("send", 64.0, 0.0), ("recv", 0.0, 64.0)]
