"""KV-head replication on gloo ranks: tp that does not divide the KV heads (issue 28).

A tiny Hugging Face Llama (4 query heads) with one KV head (multi-query attention) under
``tp=2,sp`` (also with full recompute, with ``dp=2,zero=1`` and as ``tp=2,pp=2``) and ``tp=4``, and
with two KV heads under ``tp=4``: the k and v projections stay whole on every tp rank, each rank
gets the copies of K and V its query heads read (one KV head: the GQA broadcast makes only those;
two: a ``local_shard`` of the broadcast; passes/matmul_rules.py), and the K/V weights' gradients,
partial over tp, are summed by a tp bucket after backward.  Each plan trains 3 SGD steps and is
compared with one process (loss per step and the full state dict after, fp32, tight tolerance),
and the last step's collectives equal the cost model's ``comm_table()`` (the K/V gradients in the
tp partial-gradient row, ``KV_REPLICATED`` in cost/flops.py) and the wire.  Parameters, gradients
and AdamW state per rank equal the cost model's memory, activations within its 10%.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, assert_memory_report_equals_cost_model, predicted_cost
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, reference, train_cases_job
from tests.support.zero_jobs import SEQ

MODEL = "hf_llama"
CASES = [(1, "tp=2,sp", 2), (1, "tp=2,sp,recompute=full", 2), (1, "tp=4", 4), (2, "tp=4", 4),
         (1, "tp=2,sp,dp=2,zero=1", 4), (1, "tp=2,pp=2,mb=2", 4)]
IDS = [f"kv{kv}-{plan}" for kv, plan, _ in CASES]


@pytest.fixture(scope="module")
def trained(dist_pool):
    out = {}
    for world in sorted({w for _, _, w in CASES}):
        cases = [(kv, plan) for kv, plan, w in CASES if w == world]
        results = dist_pool(train_cases_job, [(MODEL, plan, {"num_key_value_heads": kv}) for kv, plan in cases],
                            "sgd", world=world)
        out.update({case: [rank[i] for rank in results] for i, case in enumerate(cases)})
    return out


@pytest.mark.parametrize("kv,plan,world", CASES, ids=IDS)
def test_kv_replication_matches_single_process(trained, kv, plan, world):
    ranks = trained[(kv, plan)]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    ref = reference(MODEL, "sgd", (("num_key_value_heads", kv),))
    assert_equivalent(ref, (ranks[0]["losses"], ranks[0]["state"]))


@pytest.mark.parametrize("kv,plan,world", CASES, ids=IDS)
def test_kv_replication_bytes_equal_cost_model(trained, kv, plan, world):
    cost = predicted_cost(MODEL, {"num_key_value_heads": kv}, plan, world, BATCH)
    assert cost.spec.num_kv_heads == kv and cost.plan.tp % kv == 0 and kv < cost.plan.tp
    for rank, r in enumerate(trained[(kv, plan)]):
        grads = [x for x in r["comm"] if x["phase"] == "grad" and x["axis"] == "tp"]
        assert grads, (rank, "the K/V gradients were not summed over tp")
        pp_rank = rank // (world // cost.plan.pp)  # pp is the outermost mesh axis
        assert_comm_equal(r["comm"], cost.comm_table(pp_rank), rank, wire=True)


@pytest.mark.parametrize("kv,plan,world", [(1, "tp=2,sp", 2), (2, "tp=4", 4)], ids=["kv1-tp=2,sp", "kv2-tp=4"])
def test_kv_replication_memory_equals_cost_model(dist_pool, kv, plan, world):
    """Parameters, gradients and AdamW state per rank (the k/v projections whole) equal the cost
    model's; saved activations (K and V at the rank's a/tp heads) within its 10%."""
    assert_memory_report_equals_cost_model(dist_pool, MODEL, plan, {"num_key_value_heads": kv}, world, BATCH, SEQ)
