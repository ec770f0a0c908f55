"""Expert parallelism: measured bytes equal the cost model's, given the realised routing.

The token all-to-alls of dispatch and combine move as many rows as the router sent to
other ranks' experts, which depends on the data.  The runtime records the per-expert
counts of every MoE call in ``comm_stats()``; ``Cost.comm_table(expert_counts=...)`` turns
them into the exact rows.  Every other collective (the counts exchange, SP, gradient
reductions over dp and edp) is data-independent and compared as in tests/dist/test_bytes.py.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.jobs import BATCH, SEQ, train_job

PLANS = [("ep=2,dp=2", 2), ("ep=2,dp=4", 4), ("ep=2,dp=2,tp=2,sp", 4), ("ep=4,dp=2,cp=2", 4)]


def _dispatch_counts(records) -> list:
    return [r["counts"] for r in records if r["phase"] == "fwd" and r["counts"] is not None
            and r["tag"].startswith("MoE dispatch")]


def _ep_rank(rank: int, plan) -> int:
    return (rank // plan.tp) % (plan.dp * plan.cp) % plan.ep


@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
@pytest.mark.parametrize("model_name", ["example_moe", "hf_mixtral"])
def test_ep_bytes_equal_cost_model_given_counts(dist_pool, model_name, plan, world):
    """Token rows hand-checked from the counts; counts checked across ranks; all rows equal."""
    results = dist_pool(train_job, model_name, plan, "sgd", {}, 1, world=world)
    cost = predicted_cost(model_name, {}, plan, world, BATCH)
    p = cost.plan
    all_counts = [_dispatch_counts(r["comm"]) for r in results]
    for rank, counts in enumerate(all_counts):
        assert len(counts) == 2  # one dispatch per MoE layer
        for layer, (sent, received) in enumerate(counts):
            # every local token is routed to top-2 experts
            assert sum(sent) == BATCH // p.dp * SEQ // (p.tp * p.cp) * 2
            # what this rank received from each ep peer is what that peer sent to its experts
            num_local = len(sent) // p.ep
            mine = _ep_rank(rank, p)
            peers = [q for q in range(world) if q // (p.tp * p.ep) == rank // (p.tp * p.ep) and q % p.tp == rank % p.tp]
            for src, q in enumerate(sorted(peers, key=lambda q: _ep_rank(q, p))):
                assert list(received[src]) == list(all_counts[q][layer][0][mine * num_local:(mine + 1) * num_local])
    for rank, r in enumerate(results):
        counts = all_counts[rank]
        # Hand check of the first call: every row this rank routes to another rank's experts
        # is sent once, as h fp32 values.
        sent, received = counts[0]
        num_local = len(sent) // cost.plan.ep
        mine = _ep_rank(rank, cost.plan)
        first = next(x for x in r["comm"] if x["tag"] == "MoE dispatch: tokens to expert owners")
        assert first["bytes_sent"] == (sum(sent) - sum(sent[mine * num_local:(mine + 1) * num_local])) * 64 * 4
        assert first["bytes_recv"] == sum(sum(row) for src, row in enumerate(received) if src != mine) * 64 * 4
        assert_comm_equal(r["comm"], cost.comm_table(expert_counts=counts, ep_rank=mine), rank)


@pytest.mark.parametrize("model_name", ["example_moe", "hf_mixtral"])
def test_moe_without_ep_bytes_equal_cost_model(dist_pool, model_name):
    """dp only: experts run where their tokens are; dense and expert gradients are two all-reduces."""
    results = dist_pool(train_job, model_name, "dp=2", "sgd", {}, 1, world=2)
    cost = predicted_cost(model_name, {}, "dp=2", 2, BATCH)
    for rank, r in enumerate(results):
        assert sum(x["op"] == "all_reduce" and x["phase"] == "grad" for x in r["comm"]) == 2
        assert_comm_equal(r["comm"], cost.comm_table(), rank)
