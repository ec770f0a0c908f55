"""``train_step(..., local=True)`` on gloo ranks: each rank loads only its part of the batch.

For each plan, one job trains the same model three AdamW steps on the global batches and
three on each rank's part of them (``pm.batch_slice(...).take``), then evaluates one more
batch both ways: the losses are equal (==) and so is the final full state dict.  The same
job checks that ``DataLoader(..., batch_sampler=DistributedBatchSampler(...))`` loads the
rows ``take`` cuts.  Jobs: tests/support/data_jobs.py; single-process rules: tests/unit/test_data.py.
"""
from __future__ import annotations

import pytest

from tests.support.data_jobs import local_vs_global_job

PLANS = [("dp=2", 2), ("cp=2,dp=2", 4), ("tp=2,sp,dp=2", 4), ("pp=2,dp=2,mb=2", 4), ("dp=2,mb=2,zero=1", 2)]


@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
def test_local_batches_match_the_global_batch(dist_pool, plan, world):
    results = dist_pool(local_vs_global_job, "example", plan, {}, world=world)
    for r in results:
        assert r["local"] == r["global"], (r["rank"], r["local"], r["global"])
        assert r["local_eval"] == r["global_eval"]
        assert r["same_state"], r["rank"]
        assert r["loader_matches_take"], r["rank"]
        assert r["local"] == results[0]["local"]  # every rank reports the global mean loss
    by_data = {}  # ranks of one dp/cp coordinate (tp ranks, pipeline stages) load the same part
    for r in results:
        by_data.setdefault((r["coords"].get("dp", 0), r["coords"].get("cp", 0)), []).append(r["slice"])
    assert all(s == slices[0] for slices in by_data.values() for s in slices)
    assert len({slices[0] for slices in by_data.values()}) == len(by_data)
