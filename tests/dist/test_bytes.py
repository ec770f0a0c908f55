"""Byte equality: what the running program sends equals what the cost model predicts.

Each plan runs on gloo ranks; every collective the runtime issued (forward, backward,
gradient sync, loss reporting) is compared with ``autopar.estimate(...).comm_table()``
for the same model (``ModelSpec.from_module``), shapes and plan, collective kind by
collective kind: for each (phase, collective, mesh axis), the total bytes sent and
received per step, and the number of calls.  The records themselves are checked first
against the wire (``wire=True``, tests/support/wire.py): every collective and point-to-point
call that entered torch.distributed in the measured step has its record.
"""
from __future__ import annotations


import pytest

from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.jobs import BATCH, train_job

PLANS = [("tp=2", 2), ("tp=2,sp", 2), ("dp=2", 2), ("tp=2,sp,dp=2", 4), ("tp=4,sp", 4), ("dp=2,mb=2", 2)]
_KV4 = {"example": {"num_kv_heads": 4}, "hf_llama": {"num_key_value_heads": 4}}




@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_measured_bytes_equal_cost_model(dist_pool, model_name, plan, world):
    overrides = dict(_KV4[model_name]) if "tp=4" in plan else {}
    results = dist_pool(train_job, model_name, plan, "sgd", overrides, 1, world=world)
    cost = predicted_cost(model_name, overrides, plan, world, BATCH)
    for rank, r in enumerate(results):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)


# OLMo 2 normalises q and k over the whole projection width, which tp shards: each norm
# all-reduces its per-token statistics forward and their gradient backward (passes/reduction_rules.py).
@pytest.mark.parametrize("plan,world", [("tp=2", 2), ("tp=2,sp,dp=2", 4)])
def test_olmo2_norm_statistics_bytes_equal_cost_model(dist_pool, plan, world):
    results = dist_pool(train_job, "hf_olmo2", plan, "sgd", {}, 1, world=world)
    cost = predicted_cost("hf_olmo2", {}, plan, world, BATCH)
    for rank, r in enumerate(results):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)


# Qwen3 normalises q and k per head: the norm weights (the head dim) are replicated under tp and
# their gradient, from the heads a rank holds, is summed over tp with the other partial ones.
def test_qwen3_per_head_norm_bytes_equal_cost_model(dist_pool):
    results = dist_pool(train_job, "hf_qwen3", "tp=2,sp", "sgd", {}, 1, world=2)
    cost = predicted_cost("hf_qwen3", {}, "tp=2,sp", 2, BATCH)
    assert cost.spec.qk_head_norm
    for rank, r in enumerate(results):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)


# Falcon's new decoder: ``x @ w.T`` projections, a KV-grouped fused qkv, attention and MLP in
# parallel (two row-parallel reductions a layer, as in any decoder).
def test_falcon_bytes_equal_cost_model(dist_pool):
    results = dist_pool(train_job, "hf_falcon", "tp=2,sp", "sgd", {}, 1, world=2)
    cost = predicted_cost("hf_falcon", {}, "tp=2,sp", 2, BATCH)
    assert (cost.spec.num_heads, cost.spec.num_kv_heads) == (4, 2)
    for rank, r in enumerate(results):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)
