"""The wire-level guard (tests/support/wire.py) sees every call autopar makes and fails on one without a record.

The byte tests compare the cost model with the program's own records; the guard counts each
collective and point-to-point call where it enters torch.distributed and checks that the records
account for it (``assert_comm_equal`` does so whenever the records carry the step's wire calls).
Here: each kind of torch.distributed call autopar makes is seen as its c10d operator, with the
records' ring-convention bytes; and a training step into which a collective is injected without a
record fails the guard, naming that operator.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from tests.support.comm_check import assert_comm_equal, assert_wire_matches_records
from tests.support.jobs import _parallelize
from tests.support.wire import WireCounter, guard_program


def _mapping_job():
    """Each kind of call, on 2 ranks of the default group: [(call, [(op, kind, n, sent, recv)])]."""
    rank, x = dist.get_rank(), torch.ones(4)  # 16 bytes
    import torch.distributed._functional_collectives as funcol

    def pair():
        peer = 1 - rank
        ops = [dist.isend(x, peer), dist.irecv(torch.empty(4), peer)]
        for w in ops:
            w.wait()

    def batched():
        ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, torch.empty(4), 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    calls = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce async": lambda: dist.all_reduce(x.clone(), async_op=True).wait(),
        "all_gather_single": lambda: dist.all_gather_single(torch.empty(8), x),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(torch.empty(2), x),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(4), x),
        # uneven rows (MoE dispatch): rank 0 keeps 1 row of 4 bytes and sends 3, rank 1 keeps 1 and sends 3
        "all_to_all_single split": lambda: dist.all_to_all_single(
            torch.empty(4), x, output_split_sizes=[1, 3][::1 - 2 * rank], input_split_sizes=[1, 3][::1 - 2 * rank]),
        "isend/irecv": pair,
        "batch_isend_irecv": batched,
        "functional all_reduce": lambda: funcol.all_reduce(x, "sum", dist.group.WORLD).wait(),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "barrier": dist.barrier,
    }
    out = []
    for name, fn in calls.items():
        with WireCounter() as counter:
            fn()
        out.append((name, [(c.op, c.kind, c.group_size, c.bytes_sent, c.bytes_recv) for c in counter.calls]))
    return out


_EXPECTED = {  # rank 0's view: (operator, records' kind, group size, sent, received), 16-byte buffers on 2 ranks
    "all_reduce": [("c10d.allreduce_.default", "all_reduce", 2, 16.0, 16.0)],  # 2(n-1)/n·F
    "all_reduce async": [("c10d.allreduce_.default", "all_reduce", 2, 16.0, 16.0)],
    "all_gather_single": [("c10d._allgather_base_.default", "all_gather", 2, 16.0, 16.0)],  # (n-1)·shard
    "reduce_scatter_single": [("c10d._reduce_scatter_base_.default", "reduce_scatter", 2, 8.0, 8.0)],  # (n-1)/n·F
    "all_to_all_single": [("c10d.alltoall_base_.default", "all_to_all", 2, 8.0, 8.0)],  # (n-1)/n of the buffer
    "all_to_all_single split": [("c10d.alltoall_base_.default", "all_to_all", 2, 12.0, 12.0)],  # the peer's rows
    "isend/irecv": [("c10d.send.default", "send", 2, 16.0, 0.0), ("c10d.recv_.default", "recv", 2, 0.0, 16.0)],
    "batch_isend_irecv": [("c10d.send.default", "send", 2, 16.0, 0.0), ("c10d.recv_.default", "recv", 2, 0.0, 16.0)],
    "functional all_reduce": [("_c10d_functional.all_reduce.default", "all_reduce", 2, 16.0, 16.0)],
    "broadcast": [("c10d.broadcast_.default", "broadcast", 2, 16.0, 0.0)],
    "barrier": [("c10d.barrier.default", "barrier", 2, 0.0, 0.0)],
}


def test_every_kind_of_call_is_seen_with_ring_bytes(dist_pool):
    """What the guard sees of each torch.distributed call autopar makes, and the bytes it derives."""
    seen = dict(dist_pool(_mapping_job, world=2)[0])
    assert seen == _EXPECTED


def _inject(pm, extra):
    """Run ``extra()`` on every rank right after the step's gradient sync: a collective no record names."""
    sync = pm.grad_sync.sync

    def sync_then_extra(*args, **kwargs):
        out = sync(*args, **kwargs)
        extra()
        return out
    pm.grad_sync.sync = sync_then_extra
    return sync


def _injected_job(plan: str):
    """One warm-up step, then one guarded step per injection: {name: that step's records (with wire)}."""
    import torch.distributed._functional_collectives as funcol
    from autopar.ops import collectives

    pm, batches = _parallelize("example", plan, "sgd", {}, wire=False)
    pm.train_step(*batches[0])
    guard_program(pm)
    rank = dist.get_rank()
    injections = {
        "none": lambda: None,
        "dist.all_reduce": lambda: dist.all_reduce(torch.ones(8)),
        "async dist.all_reduce": lambda: dist.all_reduce(torch.ones(8), async_op=True).wait(),
        "functional all_reduce": lambda: funcol.all_reduce(torch.ones(8), "sum", dist.group.WORLD).wait(),
        "broadcast": lambda: dist.broadcast(torch.ones(8), src=0),
        "isend/irecv": lambda: [w.wait() for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(8), 1 - rank), dist.P2POp(dist.irecv, torch.empty(8), 1 - rank)])],
        "record without a call": lambda: collectives.record("all_reduce", "dp", torch.ones(8), "grad", "phantom"),
    }
    out = {}
    for name, extra in injections.items():
        sync = _inject(pm, extra)
        pm.train_step(*batches[1])
        del pm.grad_sync.sync  # the class's method again
        assert pm.grad_sync.sync == sync
        out[name] = pm.comm_stats()
    return out


_NAMED = {  # what the guard's failure must name
    "dist.all_reduce": "c10d.allreduce_.default",
    "async dist.all_reduce": "c10d.allreduce_.default",
    "functional all_reduce": "_c10d_functional.all_reduce.default",
    "broadcast": "c10d.broadcast_.default",
    "isend/irecv": "c10d.send.default",
    "record without a call": "all_reduce on 2 ranks",
}


def test_collective_without_record_fails_naming_its_op(dist_pool):
    results = dist_pool(_injected_job, "dp=2", world=2)
    for rank, r in enumerate(results):
        assert r["none"].wire, "the guard counted nothing in a dp=2 step"
        assert_wire_matches_records(r["none"], rank)
        for name, op in _NAMED.items():
            with pytest.raises(AssertionError, match=re.escape(op)):
                assert_wire_matches_records(r[name], rank)
        # The shared byte helper runs the guard first, whatever the cost model's rows.
        with pytest.raises(AssertionError, match=re.escape("c10d.allreduce_.default")):
            assert_comm_equal(r["dist.all_reduce"], [], rank)
    # The unrecorded p2p pair: both of its operators are named.
    with pytest.raises(AssertionError, match=re.escape("c10d.recv_.default")):
        assert_wire_matches_records(results[0]["isend/irecv"], 0)


def _options_job(plan: str):
    """A guarded step with gradient clipping and local batches: its records (with wire)."""
    pm, batches = _parallelize("example", plan, "sgd", {}, wire=False, max_grad_norm=1.0)
    inputs, target = batches[0]
    part = pm.batch_slice(target.shape[0], target.shape[1])
    local = (tuple(part.take(t) for t in inputs), part.take(target))
    pm.train_step(*local, local=True)
    guard_program(pm).train_step(*local, local=True)
    return pm.comm_stats()


def test_clipping_norm_and_valid_count_are_recorded(dist_pool):
    """The two collectives the cost model's table leaves out (docs/cost-model.md) are on the wire and recorded."""
    for rank, records in enumerate(dist_pool(_options_job, "dp=2", world=2)):
        assert_wire_matches_records(records, rank)
        tags = [r["tag"] for r in records]
        assert "gradient norm" in tags and "valid-target count of the global batch" in tags, tags


def test_records_without_wire_are_refused():
    with pytest.raises(AssertionError, match="carry no wire calls"):
        assert_wire_matches_records([], 0)
