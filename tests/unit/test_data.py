"""Loading only this rank's data (autopar/runtime/stepping/data.py), one process, explicit coordinates.

``BatchSlice.for_rank(plan, coords, ...)`` is what ``pm.batch_slice`` returns on the rank at
``coords``: its rows and positions, ``take``, the sampler's index sets over the ranks of a
plan, and the errors.  The multi-rank equivalence of ``train_step(..., local=True)`` with the
global step is tests/dist/test_local_batches.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autopar.errors import AutoparError
from autopar.ops.cp_attention import cp_chunk_indices
from autopar.plan import Plan
from autopar.runtime.stepping.batching import local_microbatches, split_microbatches
from autopar.runtime.stepping.data import BatchSlice, DistributedBatchSampler


def _ranks(plan: Plan):
    """Every rank's coordinates ``{axis: rank}`` of the plan's mesh."""
    axes = ("pp", "dp", "cp", "tp")
    for ranks in itertools.product(*(range(getattr(plan, a)) for a in axes)):
        yield dict(zip(axes, ranks))


def test_rows_are_the_contiguous_dp_slice():
    plan = Plan.parse("dp=2,mb=2")
    assert BatchSlice.for_rank(plan, {"dp": 0}, 8).rows == range(0, 4)
    assert BatchSlice.for_rank(plan, {"dp": 1}, 8).rows == range(4, 8)
    one = BatchSlice.for_rank(Plan.parse("none"), {}, 6, seq_len=5)
    assert one.rows == range(6) and one.positions is None and one.local_seq_len == 5


def test_positions_are_the_two_load_balanced_chunks():
    plan = Plan.parse("cp=2,dp=2")
    first = BatchSlice.for_rank(plan, {"dp": 1, "cp": 0}, 4, seq_len=16)
    second = BatchSlice.for_rank(plan, {"dp": 1, "cp": 1}, 4, seq_len=16)
    assert first.positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert second.positions.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(second.positions, cp_chunk_indices(16, 1, 2))
    assert (first.rows, first.local_batch_size, first.local_seq_len) == (range(2, 4), 2, 8)


def test_take_cuts_rows_then_positions():
    plan = Plan.parse("cp=2,dp=2")
    x = torch.arange(4 * 16 * 3).reshape(4, 16, 3)
    slc = BatchSlice.for_rank(plan, {"dp": 1, "cp": 1}, 4, seq_len=16)
    assert torch.equal(slc.take(x), x[2:4, 4:12])
    labels = torch.arange(4)  # per-sample, no sequence dim: rows only
    assert torch.equal(slc.take(labels), labels[2:4])
    assert torch.equal(slc.take_positions(x[2:4]), slc.take(x))


@pytest.mark.parametrize("text", ["dp=2", "cp=2,dp=2", "tp=2,sp,dp=2", "pp=2,dp=2,mb=2", "dp=2,mb=2,zero=1",
                                  "cp=2:ring,dp=2,mb=2"])
def test_local_microbatches_equal_the_global_ones(text):
    """Splitting ``take`` of the global batch gives exactly the global path's micro-batches."""
    plan = Plan.parse(text)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (8, 16), generator=gen)
    target = torch.randint(0, 100, (8, 16), generator=gen)
    cpu = torch.device("cpu")
    for coords in _ranks(plan):
        slc = BatchSlice.for_rank(plan, coords, 8, seq_len=16)
        got = split_microbatches((slc.take(ids),), slc.take(target), plan, cpu)
        want = local_microbatches((ids,), target, plan, coords, cpu)
        assert len(got) == len(want) == plan.mb
        for (gi, gt), (wi, wt) in zip(got, want):
            assert torch.equal(gi[0], wi[0]) and torch.equal(gt, wt)


def test_tp_and_pp_ranks_need_the_same_part():
    plan = Plan.parse("pp=2,dp=2,cp=2,tp=2,sp,mb=2")
    by_data = {}
    for coords in _ranks(plan):
        slc = BatchSlice.for_rank(plan, coords, 8, seq_len=32)
        by_data.setdefault((coords["dp"], coords["cp"]), set()).add(slc)
    assert len(by_data) == 4 and all(len(s) == 1 for s in by_data.values())


@pytest.mark.parametrize("shuffle", [False, True])
def test_sampler_index_sets(shuffle):
    plan = Plan.parse("tp=2,dp=4,mb=2")
    n, size = 45, 8
    per_rank = {}
    for coords in _ranks(plan):
        sampler = DistributedBatchSampler(n, size, BatchSlice.for_rank(plan, coords, size), shuffle=shuffle, seed=3)
        sampler.set_epoch(1)
        per_rank[(coords["dp"], coords["tp"])] = list(sampler)
    assert all(len(batches) == n // size for batches in per_rank.values())
    for dp in range(4):  # every tp rank of a dp coordinate loads the same rows
        assert per_rank[(dp, 0)] == per_rank[(dp, 1)]
    seen = []
    for b in range(n // size):
        parts = [per_rank[(dp, 0)][b] for dp in range(4)]
        assert all(len(p) == size // 4 for p in parts)
        union = set().union(*parts)
        assert len(union) == size  # disjoint over dp ranks, a full global batch together
        seen.append([i for p in parts for i in p])
    flat = [i for batch in seen for i in batch]
    assert len(set(flat)) == len(flat)  # no sample twice in an epoch
    if not shuffle:
        assert flat == list(range(n // size * size))


def test_sampler_shuffles_the_same_on_every_rank_and_by_epoch():
    plan = Plan.parse("dp=2")
    samplers = [DistributedBatchSampler(16, 4, BatchSlice.for_rank(plan, {"dp": r}, 4), shuffle=True, seed=7)
                for r in range(2)]
    first = [list(s) for s in samplers]
    for s in samplers:
        s.set_epoch(1)
    second = [list(s) for s in samplers]
    merged = [[i for r in range(2) for i in batches[r][b]] for batches in (first, second) for b in range(4)]
    assert sorted(i for batch in merged[:4] for i in batch) == list(range(16))
    assert merged[:4] != merged[4:]  # another epoch, another order
    again = DistributedBatchSampler(16, 4, BatchSlice.for_rank(plan, {"dp": 0}, 4), shuffle=True, seed=7)
    assert list(again) == first[0]


def test_sampler_without_drop_last_pads_the_last_batch():
    slices = [BatchSlice.for_rank(Plan.parse("dp=2"), {"dp": r}, 4) for r in range(2)]
    batches = [list(DistributedBatchSampler(10, 4, s, drop_last=False)) for s in slices]
    assert len(batches[0]) == 3
    assert batches[0][2] + batches[1][2] == [8, 9, 0, 1]


def test_data_loader_gives_the_rows_of_take():
    plan = Plan.parse("cp=2,dp=2")
    ids = torch.arange(12 * 8).reshape(12, 8)
    dataset = TensorDataset(ids)
    for coords in _ranks(plan):
        slc = BatchSlice.for_rank(plan, coords, 4, seq_len=8)
        loader = DataLoader(dataset, batch_sampler=DistributedBatchSampler(len(dataset), 4, slc))
        for b, (rows,) in enumerate(loader):
            assert torch.equal(slc.take_positions(rows), slc.take(ids[4 * b:4 * (b + 1)]))


def test_errors():
    with pytest.raises(AutoparError, match=r"^autopar: the global batch of 6 does not split into dp\*mb"):
        BatchSlice.for_rank(Plan.parse("dp=2,mb=2"), {"dp": 0}, 6)
    with pytest.raises(AutoparError, match=r"^autopar: .*cp=2.*pass seq_len"):
        BatchSlice.for_rank(Plan.parse("cp=2"), {"cp": 0}, 4)
    with pytest.raises(AutoparError, match=r"^autopar: cp=2 cuts the sequence into 2\*cp = 4 chunks.*18"):
        BatchSlice.for_rank(Plan.parse("cp=2"), {"cp": 0}, 4, seq_len=18)
    slc = BatchSlice.for_rank(Plan.parse("dp=2"), {"dp": 0}, 4)
    with pytest.raises(AutoparError, match=r"^autopar: BatchSlice.take expects a global-batch tensor with 4 rows"):
        slc.take(torch.zeros(2, 3))
    with pytest.raises(AutoparError, match=r"^autopar: the BatchSlice is of a global batch of 4"):
        DistributedBatchSampler(16, 8, slc)
    with pytest.raises(AutoparError, match=r"^autopar: a dataset of 3 samples holds no full global batch of 4"):
        DistributedBatchSampler(3, 4, slc)
    with pytest.raises(AutoparError, match=r"^autopar: .*mb must divide 3.*local=True this rank was given 3 rows"):
        split_microbatches((torch.zeros(3, 4, dtype=torch.long),), torch.zeros(3, 4), Plan.parse("dp=2,mb=2"),
                            torch.device("cpu"))


def _global_batches(samplers) -> list[list[int]]:
    """The global batches that ``samplers`` (one per dp rank, in dp order) hand out together."""
    per_rank = [list(s) for s in samplers]
    return [[i for rank in per_rank for i in rank[b]] for b in range(len(per_rank[0]))]


def _samplers(dp: int, n: int = 40, size: int = 4):
    plan = Plan.parse(f"dp={dp}")
    return [DistributedBatchSampler(n, size, BatchSlice.for_rank(plan, {"dp": r}, size), shuffle=True, seed=5)
            for r in range(dp)]


def test_sampler_resumes_where_it_stood_on_any_dp_size():
    """Interrupted after 3 global batches of epoch 1 under dp=2, resumed under dp=4 and under one
    rank: the batches that follow are the uninterrupted run's, sample for sample."""
    uninterrupted = _samplers(1)[0]
    uninterrupted.set_epoch(1)
    expected = [list(b) for b in uninterrupted]  # dp=1: the global batches themselves
    assert len(expected) == 10 and sorted(i for b in expected for i in b) == list(range(40))
    first = _samplers(2)
    for s in first:
        s.set_epoch(1)
        for _, __ in zip(range(3), iter(s)):
            pass
    states = [s.state_dict() for s in first]
    assert states[0] == states[1] and states[0]["epoch"] == 1 and states[0]["position"] == 3
    for dp in (4, 1):
        resumed = _samplers(dp)
        for s in resumed:
            s.load_state_dict(states[0])
            s.set_epoch(1)  # a training loop's own call for the epoch it resumes: the position stays
        assert _global_batches(resumed) == expected[3:]


def test_sampler_resumed_at_the_end_of_an_epoch_goes_to_the_next():
    sampler = _samplers(1)[0]
    assert len(list(sampler)) == 10
    state = sampler.state_dict()
    assert list(sampler) != []  # iterated again without a checkpoint: the epoch starts over
    resumed = _samplers(1)[0]
    resumed.load_state_dict(state)
    assert list(resumed) == []  # nothing left of epoch 0
    resumed.set_epoch(1)
    fresh = _samplers(1)[0]
    fresh.set_epoch(1)
    assert list(resumed) == list(fresh)


def test_sampler_refuses_the_position_of_another_order():
    state = _samplers(1)[0].state_dict()
    other = DistributedBatchSampler(40, 4, BatchSlice.for_rank(Plan.parse("dp=1"), {}, 4), shuffle=True, seed=6)
    with pytest.raises(AutoparError, match=r"^autopar: the saved data position is of another sampler: seed=5 "
                                           r"\(this sampler: 6\)"):
        other.load_state_dict(state)
