"""Random draws over the tokens, on gloo ranks: one device's numbers under dp (and ep).

A tiny MoE whose router samples its experts as PhiMoE's does in train mode (input jitter, a Gumbel
max per slot over the router's scores, a ``rand_like`` coin per token; no top-k: the ids are the
slots' max indices concatenated, tests/support/draw_jobs.py) trains 3 steps under ``dp=2`` and
``dp=2,ep=2``, the default generator seeded alike on every rank, against one device seeded the same.
Each draw over the rank's rows is made for the whole batch and the rank keeps its rows
(``autopar.ops.draws.rows_draw``), so the losses and the trained weights are one device's; under
``dp=2,ep=2`` the max routing is also found and its experts split over the ranks.
"""
from __future__ import annotations

import pytest

from tests.support import draw_jobs
from tests.support.reference import assert_equivalent


def test_the_draws_change_the_run():
    """The noise matters: one device seeded otherwise trains to another loss."""
    assert draw_jobs.reference(step_seed=draw_jobs.STEP_SEED + 1)[0] != draw_jobs.reference()[0]


@pytest.mark.parametrize("plan", ["dp=2", "dp=2,ep=2"])
def test_sampling_router_trains_as_one_device(dist_pool, plan):
    results = dist_pool(draw_jobs.train_job, plan, world=2)
    assert results[0]["rows_draws"] == 4  # jitter, two Gumbel draws, the coin
    assert results[0]["dispatches"] == (1 if "ep" in plan else 0)  # the max routing's experts split under ep
    assert results[0]["losses"] == results[1]["losses"]
    assert_equivalent(draw_jobs.reference(), (results[0]["losses"], results[0]["state"]))
