"""Padded batches (targets ``-100``) under every dimension that splits tokens: exact, not averaged means.

Every row of the batch carries a different amount of padding (tests/support/padding_jobs.py), so the
pieces of the batch that dp ranks, cp chunks and micro-batches compute hold different counts
of valid targets.  The plain ``F.cross_entropy(...)`` loss is a mean over the valid targets of
the whole batch on one device; each plan must give the same losses, eval loss and final
state dict (fp32, the bounds of tests/support/reference.py).  Averaging the pieces' means, as a
runtime that does not normalise by the global count would, misses by ~1e-2 here.
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.padding_jobs import padded_plans_job, reference_padded

CASES = [
    # (model, plans run in one pool job, world, batch, overrides)
    ("example", ["dp=2,mb=2", "cp=2", "pp=2,mb=2", "dp=2,zero=3"], 2, 4, {}),
    ("hf_llama", ["cp=2:allgather,dp=2", "pp=2:interleaved,vpp=2,dp=2,mb=2"], 4, 4, {"num_hidden_layers": 4}),
    ("example_moe", ["ep=2,dp=2,mb=2"], 2, 4, {}),
]


@pytest.mark.parametrize("model_name,plans,world,batch,overrides", CASES, ids=[c[0] for c in CASES])
def test_padded_batches_equal_one_device(dist_pool, model_name, plans, world, batch, overrides):
    results = dist_pool(padded_plans_job, model_name, plans, batch, overrides, world=world)
    ref = reference_padded(model_name, batch, overrides)
    for plan in plans:
        for r in results:
            assert r[plan]["losses"] == results[0][plan]["losses"], plan
            assert r[plan]["eval"] == pytest.approx(ref["eval"], abs=1e-5), plan
        assert_equivalent((ref["losses"], ref["state"]), (results[0][plan]["losses"], results[0][plan]["state"]))
