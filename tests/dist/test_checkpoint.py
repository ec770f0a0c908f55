"""Checkpoints (autopar/runtime/weights/checkpoint.py) across processes: resharding, crashes.

Save under ``tp=2,dp=2,zero=1`` and load under ``dp=4,zero=3`` (and the reverse), then keep
training: the losses of the 3 steps and the final state dict match uninterrupted
single-process training (tests/support/reference.py bounds), and the model + optimizer state read
back is bit-identical to what was written.  A save killed (in a child process) after
writing its data, before its commit, leaves the previous checkpoint loadable.  The
single-process checkpoint tests are tests/unit/test_checkpoint.py.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.runtime.weights.checkpoint import load_model_state_dict
from tests.support.checkpoint_jobs import BATCH, SEQ, VOCAB, full_state, reshard_job
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import build

CASES = [("tp=2,dp=2,zero=1", "dp=4,zero=3"), ("dp=4,zero=3", "tp=2,dp=2,zero=1"), ("tp=2,sp", "dp=2,zero=2")]


def _reference(model_name: str):
    _, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, {})[0], batches, loss_fn, OPTIMIZERS["adamw"], kwargs)


@pytest.mark.parametrize("plan_a,plan_b", CASES, ids=[f"{a}->{b}" for a, b in CASES])
@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_save_under_one_plan_load_under_another(dist_pool, tmp_path, model_name, plan_a, plan_b):
    world = 4 if "dp=4" in plan_a + plan_b else 2
    path = str(tmp_path / "ckpt")
    results = dist_pool(reshard_job, model_name, plan_a, plan_b, path, world=world)
    model, _, _ = build(model_name, {})
    num_trained = len(list(model.parameters()))
    for r in results:
        assert not r["differences"], "\n".join(r["differences"])
        assert r["num_optim"] == 3 * num_trained  # AdamW: step, exp_avg, exp_avg_sq per parameter
        assert r["losses"] == results[0]["losses"]
    assert_equivalent(_reference(model_name), (results[0]["losses"], results[0]["state"]))
    # The same checkpoint loads into the unparallelized model.
    full = load_model_state_dict(path)
    model.load_state_dict(full)
    assert full.keys() == model.state_dict().keys()
    assert os.path.islink(path) and not list(tmp_path.glob("*.tmp"))


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    path, side = tmp_path / "ckpt", tmp_path / "first.pt"
    child = Path(__file__).resolve().parents[1] / "support" / "checkpoint_jobs.py"
    proc = subprocess.Popen([sys.executable, str(child), str(path), str(side)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.strip() == "WRITTEN":
                break
        proc.kill()  # SIGKILL in the middle of the second save
    finally:
        proc.wait(timeout=60)
    assert list(tmp_path.glob("ckpt.data-*.tmp")), "the second save had started writing"
    first = torch.load(side)
    model, loss_fn, kwargs = build("example", {}, seed=4)
    (inputs, target), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=inputs, example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    pm.load(path)
    loaded = full_state(pm)
    assert loaded.keys() == first.keys() and all(torch.equal(loaded[k], first[k]) for k in first)
    pm.save(path)  # the leftover temporary directory does not block the next save
    assert torch.equal(load_model_state_dict(path)["embed_tokens.weight"], pm.state_dict()["embed_tokens.weight"])
