"""Custom ``torch.autograd.Function`` s run whole, their own backward included, under every dimension.

A tiny Llama whose MLPs apply two Functions whose backward is not autograd's derivative of their
forward (tests/support/models.py ``hf_llama_functions``: an identity that halves its gradient on
the MLP's input, a gated pair returning a tuple from a float argument with a straight-through
backward) trains 3 SGD steps under each plan and is compared with single-process training on the
same global batches (loss per step <= 1e-5, full state dict <= 1e-4, fp32).  The trace keeps each
Function as one node that calls its ``apply`` (autopar/frontend/custom_functions.py); its placement
comes from its forward and backward traced to aten ops and placed op by op
(passes/autograd_functions.py): the gate and up projections' outputs reach it split by
features under tp, by rows under dp, by positions under cp.  Were the backward lost (autograd
through the recorded forward), every gradient below the first MLP would differ.
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.jobs import reference, train_cases_job

pytest.importorskip("transformers")

MODEL = "hf_llama_functions"
PLANS = ["dp=2,zero=3", "tp=2,sp", "cp=2:ring", "pp=2,mb=2"]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(MODEL, p, {}) for p in PLANS], "sgd", world=2)
    return {plan: [rank[i] for rank in results] for i, plan in enumerate(PLANS)}


@pytest.mark.parametrize("plan", PLANS)
def test_custom_functions_match_single_process(trained, plan):
    ranks = trained[plan]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(reference(MODEL, "sgd", ()), (ranks[0]["losses"], ranks[0]["state"]))
