"""A model built on the meta device gets its values on each rank, for that rank's shards only.

Each case builds the model under ``torch.device("meta")`` on every rank, then either loads a
sharded ``save_pretrained`` directory with ``pm.load_pretrained`` (equal to ``from_pretrained`` +
one device: loss at each of 3 steps and the state dict after, fp32; and bf16 within the precision
tests' bounds) or initialises it with ``init_weights=model._init_weights`` after a seed (equal to
``model.apply(model._init_weights)`` after the same seed on one device, bit for bit, for GPT-2,
Llama and Mixtral under ``tp=2,sp``, ``pp=2,mb=2`` and ``dp=2,zero=3``; GPT-2's parent modules
write their children's ``c_proj.weight``).  Loading plans: ``tp=2,sp,dp=2``, ``pp=2,mb=2`` on 4
layers, ``dp=2,zero=3``, and ``ep=2,dp=2`` on Mixtral, whose checkpoint keeps the experts one by
one (transformers' conversion stacks them; load_pretrained applies the same rules).  The user's
meta model stays on meta.
"""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar.verification.compare import LOSS_ATOL, PARAM_ATOL  # noqa: E402
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train  # noqa: E402
from tests.support.jobs import BATCH, SEQ, VOCAB, build  # noqa: E402
from tests.dist.test_precision import LOSS_RTOL, STATE_ATOL  # noqa: E402  (bf16 against its recipe)
from tests.support.precision_jobs import reference_bf16  # noqa: E402
from tests.support.pretrained_jobs import INIT_SEED, meta_cases_job  # noqa: E402

LLAMA4 = {"num_hidden_layers": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a sharded save_pretrained directory of a model of seed 7 (other values than build's seed 0)."""
    out = {}
    for name, overrides in (("hf_llama", LLAMA4), ("hf_mixtral", {})):
        model, _, _ = build(name, overrides, seed=7)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, max_shard_size="40KB")
        assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3
        out[name] = str(path)
    return out


def _pretrained(name: str, overrides: dict, path: str):
    cls = type(build(name, overrides)[0])
    return cls.from_pretrained(path, attn_implementation="sdpa")


def _reference(name: str, overrides: dict, path: str):
    _, loss_fn, kwargs = build(name, overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    return reference_train(lambda: _pretrained(name, overrides, path).train(), batches, loss_fn,
                           OPTIMIZERS["adamw"], kwargs)


def _initialised(name: str, overrides: dict):
    model, _, _ = build(name, overrides)
    torch.manual_seed(INIT_SEED)
    model.apply(model._init_weights)
    return model


def _check_state(got: dict, expected: dict, atol: float) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert torch.allclose(got[key], value, atol=atol, rtol=0), (key, float((got[key] - value).abs().max()))


FP32_CASES = [("hf_llama", LLAMA4, "pp=2,mb=2"), ("hf_llama", LLAMA4, "dp=2,zero=3"), ("hf_mixtral", {}, "ep=2,dp=2")]


def test_load_pretrained_equals_from_pretrained_on_two_ranks(dist_pool, checkpoints):
    cases = [(name, overrides, plan, checkpoints[name], None) for name, overrides, plan in FP32_CASES]
    results = dist_pool(meta_cases_job, cases, world=2)
    for index, (name, overrides, plan, path, _) in enumerate(cases):
        ref = _reference(name, overrides, path)
        initial = _pretrained(name, overrides, path).state_dict()
        got = results[0][index]
        _check_state(got["initial"], initial, atol=0.0)  # loaded exactly
        assert_equivalent(ref, (got["losses"], got["state"]), loss_atol=LOSS_ATOL, param_atol=PARAM_ATOL)
        assert all(r[index]["untouched"] for r in results), plan
        assert results[1][index]["losses"] == got["losses"]


def test_load_pretrained_under_tp_sp_dp(dist_pool, checkpoints):
    path = checkpoints["hf_llama"]
    results = dist_pool(meta_cases_job, [("hf_llama", LLAMA4, "tp=2,sp,dp=2", path, None)], world=4)
    got = results[0][0]
    _check_state(got["initial"], _pretrained("hf_llama", LLAMA4, path).state_dict(), atol=0.0)
    assert_equivalent(_reference("hf_llama", LLAMA4, path), (got["losses"], got["state"]),
                      loss_atol=LOSS_ATOL, param_atol=PARAM_ATOL)


BF16_CASES = [("hf_llama", LLAMA4, "dp=2,zero=3", 2), ("hf_mixtral", {}, "ep=2,dp=2", 2),
              ("hf_llama", LLAMA4, "pp=2,mb=2", 2), ("hf_llama", LLAMA4, "tp=2,sp,dp=2", 4)]


@pytest.mark.parametrize("world", [2, 4])
def test_load_pretrained_in_bf16(dist_pool, checkpoints, world):
    cases = [(name, overrides, plan, checkpoints[name], "bf16") for name, overrides, plan, w in BF16_CASES if w == world]
    results = dist_pool(meta_cases_job, cases, world=world)
    for index, (name, overrides, plan, path, _) in enumerate(cases):
        ref = reference_bf16(name, "adamw", overrides, model=_pretrained(name, overrides, path).train())
        got = results[0][index]
        _check_state(got["initial"], _pretrained(name, overrides, path).state_dict(), atol=0.0)  # fp32 masters
        assert got["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL), plan
        _check_state(got["state"], ref["state"], atol=STATE_ATOL)


INIT_MODELS = [("hf_gpt2", {}), ("hf_llama", LLAMA4), ("hf_mixtral", {})]
INIT_PLANS = ["tp=2,sp", "pp=2,mb=2", "dp=2,zero=3"]


def test_init_weights_equals_model_apply_under_tp_pp_and_zero3(dist_pool):
    """GPT-2's ``_init_weights`` re-initialises each block's ``c_proj.weight`` from the attention and MLP
    modules (a parent writing its child's parameter); every shard equals ``model.apply`` bit for bit."""
    cases = [(name, overrides, plan, None, None, 0) for name, overrides in INIT_MODELS for plan in INIT_PLANS]
    results = dist_pool(meta_cases_job, cases, world=2)
    for index, (name, overrides, plan, *_) in enumerate(cases):
        _check_state(results[0][index]["initial"], _initialised(name, overrides).state_dict(), atol=0.0)


@pytest.mark.parametrize("name,overrides,plan,world", [("hf_gpt2", {}, "pp=2,mb=2", 2),
                                                       ("hf_llama", LLAMA4, "tp=2,sp,dp=2", 4)])
def test_a_program_from_init_weights_trains_as_model_apply_does(dist_pool, name, overrides, plan, world):
    results = dist_pool(meta_cases_job, [(name, overrides, plan, None, None)], world=world)
    got = results[0][0]
    _check_state(got["initial"], _initialised(name, overrides).state_dict(), atol=0.0)
    _, loss_fn, kwargs = build(name, overrides)
    ref = reference_train(lambda: _initialised(name, overrides).train(), make_batches(VOCAB, BATCH, SEQ, 3, seed=1),
                          loss_fn, OPTIMIZERS["adamw"], kwargs)
    assert_equivalent(ref, (got["losses"], got["state"]), loss_atol=LOSS_ATOL, param_atol=PARAM_ATOL)


def test_a_meta_built_program_loads_a_checkpoint_of_another_plan(dist_pool, tmp_path):
    from tests.support.pretrained_jobs import meta_checkpoint_job

    results = dist_pool(meta_checkpoint_job, "hf_llama", {}, "dp=2,zero=3", str(tmp_path / "ckpt"), world=2)
    got = results[0]
    _check_state(got["got"], got["expected"], atol=0.0)
    trained, loaded = got["losses"]
    assert abs(trained - loaded) <= LOSS_ATOL  # optimizer state came along: the same next step
