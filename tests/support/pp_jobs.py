"""Per-rank jobs for the pipeline-parallel tests (run on every rank by tests/support/harness.py).

Not a test module.  :func:`pp_train_job` is ``tests/support/jobs.py``'s ``train_job`` with a
user-given pipeline split; it also returns every rank's own state dict, so a test can check
that each rank (not only rank 0) returns the full state dict.
"""
from __future__ import annotations

import torch

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.wire import train_guarded

__all__ = ["pp_train_job", "pp_load_job"]


def pp_train_job(model_name: str, plan: str, opt_name: str, overrides: dict, steps: int = 3,
                 split: tuple | None = None, batch: int = BATCH):
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, batch, SEQ, steps, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name], pipeline_split=split)
    losses = train_guarded(pm, batches[:steps])
    comm = pm.comm_stats()
    state = pm.state_dict()
    return {
        "losses": losses,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()},
        "comm": comm,
        "layers": [list(c.layers) for c in pm.program.pipeline.chunks],
    }


def pp_load_job(model_name: str, plan: str, overrides: dict):
    """Round trip after a step is exact on every rank; loading another model's (seed 5) state
    dict gives that model's loss.  Returns (round trip exact, first loss after loading, code)."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, 2, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    pm.train_step(*batches[0])
    before = pm.state_dict()
    pm.load_state_dict(before)
    after = pm.state_dict()
    exact = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    other, _, _ = build(model_name, overrides, seed=5)
    pm.load_state_dict(other.state_dict())
    return exact, pm.train_step(*batches[1]), pm.code(stage=1)
