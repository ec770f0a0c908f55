"""KV-head replication of a fused QKV projection on gloo ranks (issue 40, item 3a).

GPT-BigCode's multi-query attention projects the 4 query heads and its one KV head in one fused
``c_attn`` (cut by ``split``), Phi-3's ``qkv_proj`` with one KV head likewise (cut by slices).  Under
tp=2 the fused weight and bias are laid out block by block (``ParamShard.whole``): the query rows
split by heads, the KV rows whole on every rank, whose gradient ``sum_whole_rows``
(autopar/ops/whole_rows.py) sums over tp in backward.  Each plan trains 3 SGD steps and is compared
with one process (loss per step and the full state dict after, fp32, tight tolerance), and the last
step's collectives equal the cost model's ``comm_table()`` (the two ``f_q`` rows of cost/comm.py)
and the wire.  The single-process checks are tests/unit/test_kv_replication.py.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, reference, train_cases_job

CASES = [("hf_gpt_bigcode", (), "tp=2,sp"), ("hf_gpt_bigcode", (), "tp=2"),
         ("hf_phi3", (("num_key_value_heads", 1),), "tp=2,sp")]
IDS = [f"{name}-{plan}" for name, _, plan in CASES]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(name, plan, dict(ov)) for name, ov, plan in CASES], "sgd", world=2)
    return {case: [rank[i] for rank in results] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("name,overrides,plan", CASES, ids=IDS)
def test_fused_kv_replication_matches_single_process(trained, name, overrides, plan):
    ranks = trained[(name, overrides, plan)]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(reference(name, "sgd", overrides), (ranks[0]["losses"], ranks[0]["state"]))


@pytest.mark.parametrize("name,overrides,plan", CASES, ids=IDS)
def test_fused_kv_replication_bytes_equal_cost_model(trained, name, overrides, plan):
    cost = predicted_cost(name, dict(overrides), plan, 2, BATCH)
    assert cost.spec.fused_qkv and cost.spec.num_kv_heads == 1
    for rank, r in enumerate(trained[(name, overrides, plan)]):
        kv_rows = [x for x in r["comm"] if x["phase"] == "bwd" and x["tag"].endswith("KV rows")]
        assert len(kv_rows) == cost.spec.num_layers * (1 + int(cost.spec.qkv_bias)), (rank, kv_rows)
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)
