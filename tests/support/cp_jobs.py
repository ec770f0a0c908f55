"""Per-rank jobs for the context-parallel tests (run on every rank by tests/support/harness.py).

Not a test module.  Training and byte jobs reuse :func:`tests.support.jobs.train_job`; this module
adds the jobs that look inside the CP attention: how many score blocks a rank computes,
and the error a plan that cannot work raises at run time.
"""
from __future__ import annotations

import autopar
from autopar.ops import cp_attention
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, VOCAB, build

__all__ = ["blocks_job", "bad_sequence_job"]


def blocks_job(model_name: str, plan: str, overrides: dict, seq: int):
    """Score blocks this rank computes in one training step (forward)."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, BATCH, seq, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    pm.train_step(*batches[0])
    return pm.step_context.counters[cp_attention.SCORE_BLOCKS]


def bad_sequence_job(model_name: str, plan: str, seq: int) -> str:
    """The message of the error train_step raises for a sequence of ``seq`` tokens."""
    model, loss_fn, kwargs = build(model_name, {})
    good = make_batches(VOCAB, BATCH, 16, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=good[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    (inputs, target), = make_batches(VOCAB, BATCH, seq, 1, seed=1)
    try:
        pm.train_step(inputs, target)
    except ValueError as exc:
        return str(exc)
    return ""
