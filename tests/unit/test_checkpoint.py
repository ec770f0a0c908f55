"""Checkpoints in one process (plan ``none``): the unparallelized model, foreign directories.

A checkpoint loads into the original model; a save refuses a directory that is not an
autopar checkpoint.  Resharding across plans on gloo ranks and a save killed before its
commit are tested in tests/dist/test_checkpoint.py.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.checkpoint import load_model_state_dict
from tests.checkpoint_jobs import BATCH, SEQ, VOCAB
from tests.harness import OPTIMIZERS, make_batches
from tests.jobs import build


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
