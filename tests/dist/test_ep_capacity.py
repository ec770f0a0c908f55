"""MoE capacity factor (``capacity=F``) on 2 ranks: what expert parallelism must not change.

Dropping is a semantic change, so the unparallelized model is not the reference.  Instead:
- expert parallelism does not change what is dropped: ``ep=2,dp=2`` trains exactly like
  ``dp=2`` with the same capacity (each rank applies it to its own tokens, as Megatron-Core
  does);
- a capacity no expert reaches is dropless: equivalent to the original model.
That the compiled program drops what a hand-written dropping MoE drops is tested in one
process in tests/unit/test_ep_capacity.py.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist.test_equivalence import _check
from tests.support.jobs import train_job

FACTOR = 0.5


def test_ep_does_not_change_what_capacity_drops(dist_pool):
    plan = f"dp=2,capacity={FACTOR}"
    local = dist_pool(train_job, "example_moe", plan, "sgd", {}, world=2)
    expert_parallel = dist_pool(train_job, "example_moe", "ep=2," + plan, "sgd", {}, world=2)
    assert expert_parallel[0]["losses"] == pytest.approx(local[0]["losses"], abs=1e-6)
    for key, value in local[0]["state"].items():
        assert torch.allclose(expert_parallel[0]["state"][key], value, atol=1e-6), key


def test_capacity_no_expert_reaches_is_dropless(dist_pool):
    _check(dist_pool, "example_moe", "ep=2,dp=2,capacity=4", 2, "sgd", overrides={})
