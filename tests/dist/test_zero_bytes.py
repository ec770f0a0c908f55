"""Byte equality for ZeRO and gradient accumulation: measured collectives == the cost model.

Same comparison as tests/dist/test_bytes.py (per (phase, collective, mesh axis): total bytes
sent and received per step and the number of calls), for plans with ``zero=1..3`` and
``mb>1``; it reuses that module's helpers.  The test shapes need no padding (every ZeRO
segment's element count divides by dp), so the runtime moves exactly ``P*w/dp`` per rank.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.zero_jobs import zero_train_job

PLANS = [("dp=2,zero=1", 2, 4), ("dp=2,zero=2", 2, 4), ("dp=2,zero=2,mb=2", 2, 4), ("dp=4,zero=3", 4, 4),
         ("tp=2,sp,dp=2,zero=3", 4, 4), ("tp=2,sp,dp=2,zero=1", 4, 4), ("tp=2,sp,dp=2,zero=2,mb=2", 4, 4),
         ("dp=2,zero=3,mb=2", 2, 4), ("dp=2,mb=4", 2, 8)]


@pytest.mark.parametrize("plan,world,batch", PLANS, ids=[p for p, _, _ in PLANS])
@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_zero_bytes_equal_cost_model(dist_pool, model_name, plan, world, batch):
    results = dist_pool(zero_train_job, model_name, plan, "sgd", {}, batch, 1, world=world)
    cost = predicted_cost(model_name, {}, plan, world, batch)
    for rank, r in enumerate(results):
        assert_comm_equal(r["comm"], cost.comm_table(), rank)
