"""Checkpoints under every runtime dimension: save under one plan, load under another, train on.

Each case trains one AdamW step under ``plan_a`` with a learning-rate schedule, saves, loads
into a fresh module (other seed) under ``plan_b`` and trains two more steps.  Together the cases save and load under
pp (with tp, dp and mb), cp, sp, ep, zero and dp; ``tests/dist/test_checkpoint.py`` covers
more ZeRO and TP pairs.  What must hold: the three losses and the final state dict equal
uninterrupted single-process training with the same schedule, and the full model, optimizer
and scheduler state read back is bit-identical to what was written (the union over ranks: under pp each rank saves only
its own stage).
"""
from __future__ import annotations

import pytest

from tests.support.checkpoint_jobs import reshard_job
from tests.support.harness import assert_equivalent
from tests.support.jobs import build
from tests.support.training_jobs import reference_recipe

CASES = [
    ("example", "pp=2,tp=2,dp=2,mb=2", "cp=2,tp=2,sp,dp=2", 8),
    ("example", "cp=2,dp=2", "pp=2:1f1b,dp=2,mb=2", 4),
    ("hf_llama", "pp=2:gpipe,tp=2,sp,mb=2", "dp=2,zero=3,tp=2,sp", 4),
    ("example_moe", "ep=2,dp=2", "tp=2,sp", 2),  # ep folds over dp: 2 ranks
    ("example_tied", "pp=2,mb=2", "dp=2,zero=1", 2),  # the tied weight saved by both stages, loaded once
]


@pytest.mark.parametrize("model_name,plan_a,plan_b,world", CASES, ids=[f"{m}:{a}->{b}" for m, a, b, _ in CASES])
def test_checkpoint_between_plans(dist_pool, tmp_path, model_name, plan_a, plan_b, world):
    results = dist_pool(reshard_job, model_name, plan_a, plan_b, str(tmp_path / "ckpt"), scheduled=True,
                        world=world)
    num_trained = len(list(build(model_name, {})[0].parameters()))
    for r in results:
        assert not r["differences"], "\n".join(r["differences"])
        assert r["num_optim"] == 3 * num_trained  # AdamW: step, exp_avg, exp_avg_sq per parameter
        assert r["losses"] == results[0]["losses"]
    reference = reference_recipe(model_name, "adamw", None, {})
    assert_equivalent((reference["losses"], reference["state"]), (results[0]["losses"], results[0]["state"]))
