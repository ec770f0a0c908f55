"""ZeRO stages 1-3 and gradient accumulation: equivalence with the unparallelized model.

Each plan trains 3 steps on gloo ranks and is compared with single-process training on the
same global batches (loss at every step, full state dict after; tests/harness.py bounds),
with SGD and AdamW, on the example decoder and on HF Llama.  Also: the sharded state one rank
keeps (optimizer state and module parameters, counted from the original model), exact
state-dict round trips under ZeRO, the flat layout's padding, and the error for a ZeRO-3
program run outside ``train_step``.  Byte equality lives in tests/test_zero_bytes.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.zero import FlatLayout
from tests.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.jobs import build
from tests.zero_jobs import SEQ, VOCAB, outside_step_job, zero_state_job, zero_train_job

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
def test_zero_micro_batches_and_partial_grads(dist_pool, model_name, plan, world, batch):
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
        assert r["exact"]
        assert r["loss"] == results[0]["loss"]


def test_zero3_program_outside_train_step(dist_pool):
    messages = dist_pool(outside_step_job, "example", world=2)
    assert all(m.startswith("autopar: a ZeRO-3 program ran outside ParallelModule.train_step") for m in messages)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_flat_layout_pads_and_round_trips(n):
    shapes = {"w": torch.Size([3, 5]), "norm": torch.Size([7]), "b": torch.Size([2])}
    lay = FlatLayout(["w", "norm", "b"], shapes, {"norm"}, n)
    tensors = {k: torch.arange(s.numel(), dtype=torch.float32).view(s) + 100 * i
               for i, (k, s) in enumerate(shapes.items())}
    flat = lay.flatten(tensors)
    # A segment: w (15) then b (2) = 17 elements; B segment: norm (7), each padded to a multiple of n.
    sa, sb = -(-17 // n), -(-7 // n)
    assert (lay.sa, lay.sb) == (sa, sb)
    buf = lay.rank_major(flat)
    assert buf.numel() == n * (sa + sb)
    rows = buf.view(n, sa + sb)
    a_full = torch.cat([tensors["w"].reshape(-1), tensors["b"]])
    assert torch.equal(rows[:, :sa].reshape(-1)[:17], a_full)
    assert torch.equal(rows[:, sa:].reshape(-1)[:7], tensors["norm"])
    assert torch.equal(lay.from_rank_major(buf), flat)
    views = lay.views(flat)
    assert all(torch.equal(views[k], tensors[k]) for k in shapes)


@pytest.mark.parametrize("model_name,plan,world", [("example_tied", "tp=2,sp,dp=2,zero=3", 4),
                                                   ("example_fused", "tp=2,sp,dp=2,zero=2", 4)])
def test_zero_tied_and_fused_models(dist_pool, model_name, plan, world):
    _check(dist_pool, model_name, plan, world, 4, "sgd")


@pytest.mark.parametrize("plan", ["zero=1", "zero=2", "zero=3"])
def test_zero_without_process_group(plan):
    """dp=1 in one process: ZeRO keeps one shard (the whole model) and issues no collective."""
    import autopar

    model, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, 4, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    losses = [pm.train_step(*b) for b in batches]
    assert pm.comm_stats() == []
    assert_equivalent(_reference("example", "adamw", 4), (losses, pm.state_dict()))
