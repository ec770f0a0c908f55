"""ZeRO stages 1-3 and gradient accumulation on gloo ranks: equivalence with the unparallelized model.

Each plan trains 3 steps on gloo ranks and is compared with single-process training on the
same global batches (loss at every step, full state dict after; tests/support/reference.py bounds),
with SGD and AdamW, on the example decoder and on HF Llama.  Also: the sharded state one rank
keeps (optimizer state and module parameters, counted from the original model), exact
state-dict round trips under ZeRO, and the error for a ZeRO-3 program run outside
``train_step``.  Byte equality lives in tests/dist/test_zero_bytes.py; the flat layout's
padding and ZeRO without a process group in tests/unit/test_zero.py.
"""
from __future__ import annotations

import functools

import pytest

from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import build
from tests.support.reference import assert_no_differences
from tests.support.zero_jobs import SEQ, VOCAB, outside_step_job, zero2_overlap_job, zero_state_job, zero_train_job

# (plan, world, global batch): dp=2,mb=4 needs 8 samples.
PLANS = [("dp=2,zero=1", 2, 4), ("dp=2,zero=2", 2, 4), ("dp=4,zero=3", 4, 4), ("tp=2,sp,dp=2,zero=3", 4, 4),
         ("dp=2,mb=4", 2, 8)]
# Per-micro-batch reduce-scatters (zero=2, 3 with mb>1) and partial tp gradients under ZeRO-2.
EXTRA = [("dp=2,zero=2,mb=2", 2, 4), ("tp=2,sp,dp=2,zero=2,mb=2", 4, 4), ("dp=2,zero=3,mb=2", 2, 4),
         ("tp=2,sp,dp=2,zero=1", 4, 4)]


@functools.lru_cache(maxsize=None)
def _reference(model_name: str, opt_name: str, batch: int):
    _, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, batch, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, {})[0], batches, loss_fn, OPTIMIZERS[opt_name], kwargs)


def _check(dist_pool, model_name, plan, world, batch, opt_name):
    results = dist_pool(zero_train_job, model_name, plan, opt_name, {}, batch, world=world)
    for r in results:
        assert r["losses"] == results[0]["losses"]
    assert_equivalent(_reference(model_name, opt_name, batch), (results[0]["losses"], results[0]["state"]))


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("plan,world,batch", PLANS, ids=[p for p, _, _ in PLANS])
@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_zero_plan_matches_single_process(dist_pool, model_name, plan, world, batch, opt_name):
    _check(dist_pool, model_name, plan, world, batch, opt_name)


@pytest.mark.parametrize("plan,world,batch", EXTRA, ids=[p for p, _, _ in EXTRA])
@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_zero_microbatches_and_partial_grads(dist_pool, model_name, plan, world, batch):
    _check(dist_pool, model_name, plan, world, batch, "sgd")


@pytest.mark.parametrize("plan,dp", [("dp=2,zero=1", 2), ("dp=2,zero=2", 2), ("dp=2,zero=3", 2)])
def test_sharded_state_per_rank(dist_pool, plan, dp):
    model, _, _ = build("example", {})
    total = sum(p.numel() for p in model.parameters())  # untied: every parameter is trained
    results = dist_pool(zero_state_job, "example", plan, world=dp)
    for r in results:
        assert r["opt_numel"] == total // dp         # the optimizer sees only this rank's shard
        assert r["state_numel"] == 2 * total // dp   # AdamW exp_avg + exp_avg_sq of the shard
        assert r["module_numel"] == (0 if plan.endswith("zero=3") else total)
        assert r["loss"] == results[0]["loss"]
    assert_no_differences([r["load"] for r in results])


def test_zero3_program_outside_train_step(dist_pool):
    messages = dist_pool(outside_step_job, "example", world=2)
    assert all(m.startswith("autopar: a ZeRO-3 program ran outside ParallelModule.train_step") for m in messages)


@pytest.mark.parametrize("model_name,plan,world", [("example_tied", "tp=2,sp,dp=2,zero=3", 4),
                                                   ("example_fused", "tp=2,sp,dp=2,zero=2", 4)])
def test_zero_tied_and_fused_models(dist_pool, model_name, plan, world):
    _check(dist_pool, model_name, plan, world, 4, "sgd")


def test_zero2_starts_each_units_reduce_scatter_during_backward(dist_pool):
    """Stage 2 starts a unit's reduce-scatter from its gradients' hooks while backward still runs
    (several units started before backward ends), and none is left after the step."""
    for r in dist_pool(zero2_overlap_job, "example", 16 * 1024, world=2):
        assert r["units"] > 2 and any(0 < n < r["units"] for n in r["seen"]), r
        assert r["left"] == 0
