"""Per-rank jobs for tests/dist/test_training.py, and the single-device recipe they are compared with.

Not a test module.  ``recipe_job`` trains under a plan with gradient clipping, a learning-rate
schedule and an evaluation step after the first update; :func:`reference_recipe` does the
same on the unparallelized model with ``torch.nn.utils.clip_grad_norm_`` and the same
scheduler, so every number has a single-device counterpart.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

__all__ = ["recipe_job", "reference_recipe", "schedule_factor", "freed_job", "STEPS"]

STEPS = 3


def schedule_factor(step: int) -> float:
    """Warm-up over two steps, then decay: the lr changes at every step."""
    return min(1.0, (step + 1) / 2) * 0.8 ** step


SCHEDULER = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule_factor)


def _batches():
    return make_batches(VOCAB, BATCH, SEQ, STEPS + 1, seed=1)


def recipe_job(model_name: str, plan: str, opt_name: str, max_grad_norm: float | None, overrides: dict):
    """Losses, gradient norms, learning rates and the eval loss of a parallel run, and rank 0's state."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = _batches()
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name], max_grad_norm=max_grad_norm,
                             lr_scheduler=SCHEDULER)
    out = {"losses": [], "norms": [], "lrs": [], "eval": None, "eval_kept_state": None}
    for step, (inputs, target) in enumerate(batches[:STEPS]):
        out["lrs"].append(pm.optimizer.param_groups[0]["lr"])
        out["losses"].append(pm.train_step(inputs, target))
        out["norms"].append(pm.last_grad_norm)
        if step == 0:
            before = pm.state_dict()
            out["eval"] = pm.eval_step(*batches[STEPS])
            after = pm.state_dict()
            untouched = all(torch.equal(before[k], after[k]) for k in before)
            # no gradient left by the eval: none, or a bucket's gradient zeroed after the step
            no_grads = all(p.grad is None or not p.grad.any() for p in pm.gm.parameters())
            out["eval_kept_state"] = untouched and no_grads
    state = pm.state_dict()
    out["state"] = {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None
    out["stats"] = dict(pm.last_step_stats)
    return out


def reference_recipe(model_name: str, opt_name: str, max_grad_norm: float | None, overrides: dict):
    """The same recipe on one device: clip_grad_norm_, the scheduler, eval after the first step."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = _batches()
    optimizer = OPTIMIZERS[opt_name](model.parameters())
    scheduler = SCHEDULER(optimizer)
    out = {"losses": [], "norms": [], "lrs": [], "eval": None}
    for step, (inputs, target) in enumerate(batches[:STEPS]):
        out["lrs"].append(optimizer.param_groups[0]["lr"])
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs, **kwargs), target)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm else float("inf"))
        optimizer.step()
        scheduler.step()
        out["losses"].append(float(loss.detach()))
        out["norms"].append(float(norm))
        if step == 0:
            model.eval()
            with torch.no_grad():
                out["eval"] = float(loss_fn(model(*batches[STEPS][0], **kwargs), batches[STEPS][1]))
            model.train()
    out["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return out


def freed_job(model_name: str, plan: str) -> bool:
    """Train a step and eval a step, drop the program: is it (and so its process groups) freed?"""
    import gc
    import weakref

    model, loss_fn, kwargs = build(model_name, {})
    batches = _batches()
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    pm.train_step(*batches[0])
    pm.eval_step(*batches[1])
    ref = weakref.ref(pm)
    del pm
    gc.collect()
    return ref() is None
