"""Activation recompute on gloo ranks: exact training, bytes and activation memory.

``recompute=selective`` (attention core through o_proj, MLP activation through down_proj)
and ``recompute=full`` (each decoder layer from its input) train exactly like the
single-device model: the loss of every step (<= 1e-5) and the full state dict after 3 SGD
steps (<= 1e-4), fp32, with and without pp.  The last step's collectives equal the cost
model's ``comm_table`` (full recompute re-sends each layer's forward collectives but the
trailing one, in backward); each region is recomputed once per micro-batch; on the flat
executor the measured activations (saved at the end of forward plus the largest working
set of a recomputation) are within 10% of the cost model's recompute terms, the bound of
tests/dist/test_memory_report.py.  Dropout under recompute draws the same masks as
without it: the runs are bit-identical.  Several plans share one pool job.
"""
from __future__ import annotations

import functools

import pytest

import autopar
from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import SEQ, VOCAB, build
from tests.support.recompute_jobs import BATCH, recompute_plans_job

PLANS = {
    ("example", 2): ("tp=2,sp,recompute=selective", "tp=2,sp,recompute=full", "tp=2,recompute=full",
                     "dp=2,recompute=full", "dp=2,zero=3,recompute=selective", "pp=2,mb=2,recompute=full",
                     "pp=2,mb=2,recompute=selective"),
    ("hf_llama", 2): ("tp=2,sp,recompute=selective", "dp=2,recompute=full", "pp=2,mb=2,recompute=full",
                      "pp=2,mb=2,recompute=selective"),
    ("example", 4): ("pp=2,tp=2,sp,mb=2,recompute=full", "tp=2,sp,dp=2,zero=3,recompute=full"),
    ("hf_llama", 4): ("cp=2:ring,dp=2,recompute=selective", "cp=2:allgather,dp=2,recompute=full",
                      "cp=2:ulysses,dp=2,recompute=selective", "cp=2:ring,dp=2,recompute=full"),
}
CASES = [(model, world, plan) for (model, world), plans in PLANS.items() for plan in plans]
IDS = [f"{model}-{plan}" for model, _, plan in CASES]


@functools.lru_cache(maxsize=None)
def _run(pool, model_name: str, world: int):
    return pool(recompute_plans_job, model_name, list(PLANS[(model_name, world)]), "sgd", {}, world=world)


@functools.lru_cache(maxsize=None)
def _reference(model_name: str):
    _, loss_fn, kwargs = build(model_name, {})
    return reference_train(lambda: build(model_name, {})[0], make_batches(VOCAB, BATCH, SEQ, 3, seed=1), loss_fn,
                           OPTIMIZERS["sgd"], kwargs)


@functools.lru_cache(maxsize=None)
def _cost(model_name: str, world: int, plan: str):
    return predicted_cost(model_name, {}, plan, world, BATCH)


def _per_rank(dist_pool, model_name, world, plan):
    return [r[plan] for r in _run(dist_pool, model_name, world)]


@pytest.mark.parametrize("model_name,world,plan", CASES, ids=IDS)
def test_recompute_trains_like_the_single_device_model(dist_pool, model_name, world, plan):
    results = _per_rank(dist_pool, model_name, world, plan)
    for r in results:  # every rank reports the same global loss
        assert r["losses"] == results[0]["losses"]
    assert_equivalent(_reference(model_name), (results[0]["losses"], results[0]["state"]))


@pytest.mark.parametrize("model_name,world,plan", CASES, ids=IDS)
def test_recompute_bytes_equal_the_cost_model(dist_pool, model_name, world, plan):
    results = _per_rank(dist_pool, model_name, world, plan)
    parsed = autopar.Plan.parse(plan)
    cost = _cost(model_name, world, plan)
    for rank, r in enumerate(results):
        stage = rank // (parsed.world_size // parsed.pp)  # pp is the outermost mesh axis
        assert_comm_equal(r["comm"], cost.comm_table(stage), rank)


@pytest.mark.parametrize("model_name,world,plan", CASES, ids=IDS)
def test_each_region_is_recomputed_once_per_microbatch(dist_pool, model_name, world, plan):
    results = _per_rank(dist_pool, model_name, world, plan)
    parsed = autopar.Plan.parse(plan)
    per_layer = 1 if parsed.recompute == "full" else 2  # the layer, or its attention and MLP regions
    layers = 2 // parsed.pp  # two layers, one per pipeline stage under pp=2
    assert all(r["recomputed"] == per_layer * layers * parsed.mb for r in results)
    assert len(results[0]["regions"]) == 2 * per_layer


FLAT = [case for case in CASES if "pp=" not in case[2]]  # the pipelined executor meters no activations


@pytest.mark.parametrize("model_name,world,plan", FLAT, ids=[f"{m}-{p}" for m, _, p in FLAT])
def test_recompute_activation_memory_matches_the_cost_model(dist_pool, model_name, world, plan):
    results = _per_rank(dist_pool, model_name, world, plan)
    predicted = _cost(model_name, world, plan).memory()
    activations = (predicted["activations"] + predicted["embedding_activations"]
                   + predicted["head_activations"] + predicted["recompute_buffer"])
    for r in results:
        measured = r["memory"]["activations"]
        assert abs(measured - activations) <= 0.10 * activations, (measured, activations)


DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1, mlp_dropout=0.1)


def test_recomputed_dropout_draws_the_same_masks(dist_pool):
    """The recomputation restores the step's dropout streams: bit-identical to no recompute."""
    plans = ["tp=2,sp", "tp=2,sp,recompute=selective", "tp=2,sp,recompute=full",
             "pp=2,mb=2", "pp=2,mb=2,recompute=full"]
    results = dist_pool(recompute_plans_job, "example", plans, "sgd", DROPOUT, steps=2, world=2)[0]
    for base, plan in ((plans[0], plans[1]), (plans[0], plans[2]), (plans[3], plans[4])):
        assert results[plan]["recomputed"] > 0
        assert results[plan]["losses"] == results[base]["losses"], plan
        for key, value in results[base]["state"].items():
            assert results[plan]["state"][key].equal(value), (plan, key)
