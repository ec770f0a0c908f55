"""A fused QKV projection split by heads after a view, on gloo ranks (Ergo's attention).

``qkv(x).view(b, s, -1, d).split((heads, kv_heads, kv_heads), dim=-2)``: the parts are counted in
heads, after the view.  The analysis reads them as the projection's parts in features
(``autopar/frontend/analyze.py``, ``_head_split_parts``); the TP pass shards the weight part by part
and marks the projection's output by blocks, which the view scales to blocks of heads
(``passes/view_rules.py``), so the split cuts each rank's share of every part.  Each plan trains 3
SGD steps against one process (loss per step and the full state dict after, fp32, tight tolerance),
and the last step's collectives equal the cost model's and the wire's.  A tp that would cut a KV
head is refused at the view (tests/unit/test_analyze.py has the single-process half).
"""
from __future__ import annotations

import pytest

from autopar.errors import AutoparError
from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, reference, train_cases_job
from tests.support.models import MODELS, make_batch

NAME = "example_head_split"
PLANS = ["tp=2", "tp=2,sp"]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(NAME, plan, {}) for plan in PLANS], "sgd", world=2)
    return {plan: [rank[i] for rank in results] for i, plan in enumerate(PLANS)}


@pytest.mark.parametrize("plan", PLANS)
def test_qkv_split_by_heads_matches_single_process(trained, plan):
    ranks = trained[plan]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(reference(NAME, "sgd", ()), (ranks[0]["losses"], ranks[0]["state"]))


@pytest.mark.parametrize("plan", PLANS)
def test_qkv_split_by_heads_bytes_equal_cost_model(trained, plan):
    cost = predicted_cost(NAME, {}, plan, 2, BATCH)
    assert cost.spec.fused_qkv
    for rank, r in enumerate(trained[plan]):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)


def test_a_tp_that_cuts_a_kv_head_is_refused():
    from autopar.passes.compile import compile_program
    from autopar.plan import Plan
    factory, loss_fn, kwargs = MODELS[NAME]
    ids, _ = make_batch(128, 4, 16, 0)
    with pytest.raises(AutoparError, match="autopar: cannot shard node 'view'.*cuts a block"):
        compile_program(factory(num_kv_heads=1), (ids,), kwargs, Plan.parse("tp=2"), loss_fn, world_size=2)
