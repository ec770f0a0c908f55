"""Per-rank job for tests/dist/test_last_step_stats.py: a few steps with and without a hardware profile.

Not a test module.  :func:`stats_job` trains two steps of a plan with ``$AUTOPAR_HARDWARE_PROFILE``
naming ``profile`` (or unset for None) and returns what ``pm.last_step_stats`` and
``pm.predicted_cost`` say; the variable is restored afterwards (the pool's workers run other jobs).
"""
from __future__ import annotations

import functools
import os

import torch

import autopar
from autopar.planning.autoplan import PROFILE_ENV
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

__all__ = ["stats_job"]


def stats_job(plan: str, profile: str | None) -> dict:
    """``last_step_stats`` after two steps, the predicted Cost's step time and cluster, with ``profile``."""
    saved = os.environ.pop(PROFILE_ENV, None)
    if profile is not None:
        os.environ[PROFILE_ENV] = profile
    try:
        model, loss_fn, kwargs = build("example", {})
        batches = make_batches(VOCAB, BATCH, SEQ, 2, seed=3)
        pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                                 loss_fn=loss_fn, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        for inputs, target in batches:
            pm.train_step(inputs, target)
        cost = pm.predicted_cost
        return {"stats": dict(pm.last_step_stats),
                "cost": None if cost is None else {"step_time": cost.step_time, "gpu": cost.cluster.gpu,
                                                   "gpus_per_node": cost.cluster.gpus_per_node,
                                                   "plan": str(cost.plan), "global_batch": cost.global_batch,
                                                   "seq_len": cost.seq_len}}
    finally:
        os.environ.pop(PROFILE_ENV, None)
        if saved is not None:
            os.environ[PROFILE_ENV] = saved
