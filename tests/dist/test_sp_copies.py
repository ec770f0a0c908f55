"""Sequence parallelism copies nothing around its collectives at micro-batch 2 and more (issue 30).

SP's all-gathers and reduce-scatters run along the sequence dim 1 of ``[batch, seq, hidden]``.
At micro-batch 1 a rank's piece of the gathered tensor is one block of memory; from micro-batch 2
on it is one block per sample, so laying the pieces out copies the result (gathering) or the
input (reduce-scattering) of every call, forward and backward.  The collectives now run on each sample's contiguous slices,
coalesced into one call (autopar/ops/collectives.py, "Copy-free slices"): both on NCCL, the
all-gathers only on gloo (its coalesced reduce-scatter is slower than the copies; ``SLICED_OPS``).
These gloo ranks run NCCL's choice too (tests/support/copy_jobs.py ``POLICIES``).  The meter is torch's
dispatcher (tests/support/copy_jobs.py): every ``clone``, ``copy_`` and ``_to_copy`` of a training step,
forward and backward, and those inside the collectives' bodies.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.copy_jobs import sp_copies_job

PLAN = "tp=2,sp"


@pytest.fixture(scope="module")
def runs(dist_pool):
    """Rank results of one step of hf_llama under ``tp=2,sp``, per (global batch, slicing policy)."""
    cache: dict = {}

    def get(batch: int, sliced: str = "both"):
        if (batch, sliced) not in cache:
            cache[batch, sliced] = dist_pool(sp_copies_job, "hf_llama", PLAN, batch, sliced, world=2)
        return cache[batch, sliced]
    return get


@pytest.mark.parametrize("batch", [2, 4])
def test_no_copy_around_sp_collectives(runs, batch):
    """Both collectives sliced, as on NCCL: one coalesced call per recorded collective, over the
    ``batch`` samples' slices, and no copy in either body."""
    for rank, r in enumerate(runs(batch)):
        assert r["records"], "no SP collective ran: the test would pass vacuously"
        assert all(shape[0] == batch for _, _, shape in r["records"]), (rank, r["records"])
        assert len(r["calls_inside"]) == len(r["records"]), (rank, r["calls_inside"], len(r["records"]))
        assert {n for *_, n in r["calls_inside"]} == {batch}, (rank, r["calls_inside"])
        assert all("coalesced" in op for _, op, _ in r["calls_inside"]), (rank, r["calls_inside"])
        assert r["around"] == [], (rank, r["around"])


def test_gloo_slices_its_gathers_and_stacks_its_reduce_scatters(runs):
    """gloo's own choice (``SLICED_OPS``): its coalesced reduce-scatter is slower than stacking the
    pieces, so only the reduce-scatters copy; the gathers copy nothing."""
    for rank, r in enumerate(runs(2, "default")):
        bodies = {body for body, _ in r["around"]}
        assert bodies == {"_scatter"}, (rank, r["around"])
        gathers = [call for call in r["calls_inside"] if call[0] == "_gather"]
        assert gathers and all("coalesced" in op and n == 2 for _, op, n in gathers), (rank, gathers)


def test_the_step_copies_no_more_at_micro_batch_2_than_at_1(runs):
    """Outside the collectives the program's copies are the model's own (HF's attention output
    ``.contiguous()``, the loss's label shift): as many at micro-batch 2 as at 1."""
    for one, two in zip(runs(1), runs(2)):
        assert len(two["elsewhere"]) == len(one["elsewhere"]), (one["elsewhere"], two["elsewhere"])


def test_the_meter_sees_the_copies_of_stacked_pieces(runs):
    """Control: with slicing off (every SP collective stacks the ranks' pieces in front: one copy, of
    the gathered result or of the input to reduce-scatter) the same meter counts a copy in each
    call; the losses and the trained state are the same bit
    for bit under every choice (each sample's values travel and sum in the same order), and the
    gloo choice is the program the equivalence tests prove equal to one device (test_equivalence.py)."""
    for sliced, gloo, moved in zip(runs(2), runs(2, "default"), runs(2, "none")):
        assert len(moved["around"]) == len(moved["records"]), (len(moved["around"]), len(moved["records"]))
        for other in (sliced, gloo):
            assert other["loss"] == moved["loss"]
            assert other["state"].keys() == moved["state"].keys()
            assert all(torch.equal(other["state"][k], v) for k, v in moved["state"].items())
