"""Two patterns of the zoo's models under tp, on gloo ranks, each against one process.

**A fused QKV split by heads after a view** (Ergo's attention):
``qkv(x).view(b, s, -1, d).split((heads, kv_heads, kv_heads), dim=-2)``, the parts counted in heads
after the view, and every linear casting its weight to fp32 first (Ergo's ``ErgoLinearWithFP32Output``).
The analysis reads the parts as the projection's parts in features (``autopar/frontend/analyze.py``,
``_head_split_parts``) and a cast weight as its parameter; the TP pass shards the weight part by part
and marks the projection's output by blocks, which the view scales to blocks of heads
(``passes/view_rules.py``), so the split cuts each rank's share of every part.  The last step's
collectives equal the cost model's and the wire's (one region entry per region, the casts inside
it).  A tp that would cut a KV head is refused at the view.

**Rows picked by a boolean mask and written back by it** (XMOD's language adapters):
``out[mask] = adapter(h[mask])`` with ``mask`` a replicated boolean over the batch's rows and ``h``
sharded on the sequence (SP): every rank picks the same rows of its shard; the mask's dim becomes
the picked rows' dim and the sequence shard stays where it was (the ``index`` and ``index_put``
rules of ``passes/view_rules.py``).  The batches' rows fall in both groups.  A mask over the
sequence is refused, naming the indexing node.

Each plan trains 3 SGD steps (loss per step and the full state dict after, fp32, tight tolerance).
"""
from __future__ import annotations

import pytest

from autopar.errors import AutoparError
from autopar.passes.compile import compile_program
from autopar.plan import Plan
from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, SEQ, VOCAB, make_batches, reference, train_cases_job
from tests.support.models import MODELS, AdapterDecoder, make_batch

CASES = [("example_head_split", "tp=2"), ("example_head_split", "tp=2,sp"),
         ("example_adapters", "tp=2,sp"), ("example_adapters", "tp=2")]
IDS = [f"{name}-{plan}" for name, plan in CASES]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(name, plan, {}) for name, plan in CASES], "sgd", world=2)
    return {case: [rank[i] for rank in results] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("name,plan", CASES, ids=IDS)
def test_matches_single_process(trained, name, plan):
    ranks = trained[(name, plan)]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(reference(name, "sgd", ()), (ranks[0]["losses"], ranks[0]["state"]))


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp"])
def test_qkv_split_by_heads_bytes_equal_cost_model(trained, plan):
    cost = predicted_cost("example_head_split", {}, plan, 2, BATCH)
    assert cost.spec.fused_qkv
    for rank, r in enumerate(trained[("example_head_split", plan)]):
        assert_comm_equal(r["comm"], cost.comm_table(), rank, wire=True)


def _compile(model, plan: str):
    _, loss_fn, kwargs = MODELS["example_adapters"]
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(model, (ids,), kwargs, Plan.parse(plan), loss_fn, world_size=2)


def test_a_tp_that_cuts_a_kv_head_is_refused():
    with pytest.raises(AutoparError, match="autopar: cannot shard node 'view'.*cuts a block"):
        _compile(MODELS["example_head_split"][0](num_kv_heads=1), "tp=2")


def test_the_batches_mix_both_groups():
    """Otherwise every mask would pick every row or none, and the adapters' cases could not fail."""
    for (ids,), _ in make_batches(VOCAB, BATCH, SEQ, 3, seed=1):
        assert len(set((ids.sum(-1) % 2).tolist())) > 1  # AdapterDecoder.groups


def test_a_mask_over_the_sharded_dim_is_refused():
    class TokenAdapters(AdapterDecoder):
        def groups(self, input_ids):
            return input_ids % len(self.adapters[0])  # [b, s]: each token's adapter, a mask over the sequence

    with pytest.raises(AutoparError, match=r"autopar: .*node 'index'"):
        _compile(TokenAdapters(MODELS["example_adapters"][0]().decoder), "tp=2,sp")
