"""Checkpoints in one process (plan ``none``): the unparallelized model, foreign directories.

A checkpoint loads into the original model; a save refuses a directory that is not an
autopar checkpoint; the multi-rank state-dict check (``roundtrip_job``) catches a load that
does nothing.  Resharding across plans on gloo ranks and a save killed before its
commit are tested in tests/dist/test_checkpoint.py.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.weights.checkpoint import load_model_state_dict
from tests.support.checkpoint_jobs import BATCH, SEQ, VOCAB
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import build, load_problems, roundtrip_job


def test_checkpoint_loads_into_the_original_model(tmp_path):
    model, loss_fn, kwargs = build("example", {})
    (inputs, target), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=inputs, example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    pm.train_step(inputs, target)
    pm.save(tmp_path / "c")
    fresh, _, _ = build("example", {}, seed=3)
    fresh.load_state_dict(load_model_state_dict(tmp_path / "c"))
    expected = pm.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())


def test_save_refuses_a_foreign_directory(tmp_path):
    model, loss_fn, kwargs = build("example", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=inputs, example_kwargs=kwargs, plan="none", loss_fn=loss_fn)
    (tmp_path / "mine").mkdir()
    with pytest.raises(autopar.AutoparError, match="^autopar: checkpoint path .* is not an autopar checkpoint"):
        pm.save(tmp_path / "mine")


def test_the_roundtrip_check_catches_a_load_that_does_nothing(monkeypatch):
    """tests/dist/test_equivalence.py's state-dict check (``roundtrip_job``) in one process: silent on
    the real load, and naming the tensors and the loss when ``load_state_dict`` is made a no-op."""
    assert roundtrip_job("example", "none", {}) == []
    monkeypatch.setattr(autopar.ParallelModule, "load_state_dict", lambda self, state_dict: None)
    problems = roundtrip_job("example", "none", {})
    text = "\n".join(problems)
    names = list(build("example", {})[0].state_dict())
    assert problems[0].startswith(f"after load_state_dict: {len(names)} of {len(names)} tensors differ beyond 0")
    assert sum(f"\n    {name}: max |diff| " in text for name in names) == 5, text  # the worst five, named
    assert "loss on the next batch: the loaded program" in problems[-1]


def test_load_problems_refuses_a_program_that_already_holds_the_state():
    model, loss_fn, kwargs = build("example", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, inputs, example_kwargs=kwargs, plan="none", loss_fn=loss_fn)
    assert load_problems(pm.state_dict(), pm) == [
        "the program already held the saved state before loading: a load that does nothing would pass"]
