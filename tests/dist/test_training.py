"""Training essentials under parallel plans: gradient clipping, LR schedules, evaluation.

Each case trains 3 steps under a plan and the same recipe on one device
(tests/support/training_jobs.py): with ``max_grad_norm``, ``last_grad_norm`` must equal
``clip_grad_norm_``'s total norm within 1e-5 relative (clipping active at every step: the
bound is below every norm; without it, None), the
learning rate before every step must be the scheduler's, ``eval_step`` after the first
update must give the unparallelized eval loss and leave parameters and gradients untouched,
and losses and the final state dict must match (tests/support/reference.py bounds).
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.training_jobs import freed_job, recipe_job, reference_recipe

CLIP = 0.05  # below every gradient norm of these runs: each step clips

CASES = [
    # (model, plan, world, optimizer, max_grad_norm, overrides)
    ("hf_llama", "tp=2,sp,pp=2,mb=2", 4, "sgd", CLIP, {"num_hidden_layers": 2}),
    ("example_moe", "ep=2,dp=2", 2, "adamw", CLIP, {}),
    ("example", "dp=2,zero=2,tp=2,sp", 4, "adamw", CLIP, {}),
    ("example", "dp=2,zero=3", 2, "sgd", CLIP, {}),
    ("example", "cp=2,tp=2,sp", 4, "adamw", None, {}),       # scheduler and eval, no clipping
    ("example", "pp=2:1f1b,mb=2", 2, "adamw", None, {}),
    ("example", "dp=2,tp=2", 4, "sgd", 1e9, {}),             # a bound never reached: no change
]


@pytest.mark.parametrize("model_name,plan,world,opt,clip,overrides", CASES, ids=[c[1] for c in CASES])
def test_recipe_matches_one_device(dist_pool, model_name, plan, world, opt, clip, overrides):
    results = dist_pool(recipe_job, model_name, plan, opt, clip, overrides, world=world)
    ref = reference_recipe(model_name, opt, clip, overrides)
    if clip == CLIP:
        assert min(ref["norms"]) > CLIP, ref["norms"]  # every step really clips
    for r in results:
        if clip is None:  # no clipping, no norm (it would cost an all-reduce the cost model does not list)
            assert r["norms"] == [None] * len(ref["norms"])
        else:
            assert r["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        assert r["lrs"] == pytest.approx(ref["lrs"], rel=1e-12)
        assert r["eval"] == pytest.approx(ref["eval"], abs=1e-5)
        assert r["eval_kept_state"]
        assert r["losses"] == results[0]["losses"]
        assert r["stats"]["tokens"] > 0 and r["stats"]["tokens_per_s"] > 0
    assert_equivalent((ref["losses"], ref["state"]), (results[0]["losses"], results[0]["state"]))


FREED = [("dp=2", 2), ("tp=2,sp", 2), ("dp=2,zero=3", 2), ("pp=2,tp=2,sp,mb=4", 4)]


@pytest.mark.parametrize("plan,world", FREED, ids=[p for p, _ in FREED])
def test_dropped_program_is_freed(dist_pool, plan, world):
    """A program the user drops is freed with its process groups: no reference cycle runs
    through a gradient hook or a saved-tensor hook (C++ state the garbage collector cannot
    see), which would keep its activations and gloo threads for the rest of the process."""
    assert dist_pool(freed_job, "hf_llama", plan, world=world) == [True] * world
