"""Per-rank jobs for tests/dist/test_pretrained.py (run on every rank by tests/support/harness.py).

Not a test module.  :func:`meta_cases_job` builds each case's model on the meta device, gives it
values (``pm.load_pretrained`` of a ``save_pretrained`` directory, or ``init_weights`` after a
seed), trains 3 steps and returns the losses, rank 0's state dict, and the state right after
loading or initialising.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

__all__ = ["meta_cases_job", "meta_checkpoint_job", "INIT_SEED"]

INIT_SEED = 1234


def _state(pm) -> dict | None:
    state = pm.state_dict()  # collective (tp/ep gathers, ZeRO-3 gathers, pp broadcasts): every rank
    return {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None


def meta_job(model_name: str, overrides: dict, plan: str, path: str | None, mixed_precision: str | None = None,
             steps: int = 3):
    """``path``: load it; None: ``init_weights=model._init_weights`` after ``torch.manual_seed(INIT_SEED)``;
    ``steps``: how many to train (0: the state after loading or initialising only)."""
    with torch.device("meta"):
        model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    options = {} if path is not None else {"init_weights": model._init_weights}
    if path is None:
        torch.manual_seed(INIT_SEED)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], mixed_precision=mixed_precision,
                             **options)
    if path is not None:
        pm.load_pretrained(path)
    initial = _state(pm)
    losses = [pm.train_step(inputs, target) for inputs, target in batches[:steps]]
    untouched = all(t.is_meta for t in model.state_dict().values())
    return {"losses": losses, "initial": initial, "state": _state(pm) if steps else initial, "untouched": untouched}


def meta_cases_job(cases: list):
    """:func:`meta_job` for each ``(model_name, overrides, plan, path, mixed_precision[, steps])`` in one pool call."""
    return [meta_job(*case) for case in cases]


def meta_checkpoint_job(model_name: str, overrides: dict, plan: str, path: str):
    """A real model trains a step and saves a DCP checkpoint; a meta-built program of another plan
    loads it with ``pm.load``: rank 0's state dicts of both, and the next step's losses of both."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, 2, seed=1)
    trained = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                                  loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    trained.train_step(*batches[0])
    trained.save(path)
    with torch.device("meta"):
        meta, _, _ = build(model_name, overrides)
    other = "dp=2" if plan != "dp=2" else "tp=2"
    pm = autopar.parallelize(meta, example_inputs=batches[0][0], example_kwargs=kwargs, plan=other,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    pm.load(path)
    expected, got = _state(trained), _state(pm)
    return {"expected": expected, "got": got,
            "losses": [trained.train_step(*batches[1]), pm.train_step(*batches[1])]}
