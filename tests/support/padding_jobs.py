"""Per-rank jobs for tests/dist/test_padding.py: padded batches (targets ``-100``) under several plans.

Not a test module.  :func:`padded_batches` pads every row of a batch by a different amount
(and masks a few scattered positions), so each dp rank, cp chunk and micro-batch holds a
different number of valid targets; :func:`padded_plans_job` trains each plan of a list in
one pool job (no process start-up per plan) on those batches, with AdamW, and returns
losses, an eval loss and rank 0's state for each.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import SEQ, VOCAB, build

__all__ = ["padded_batches", "padded_plans_job", "STEPS", "IGNORE"]

STEPS, IGNORE = 3, -100


def padded_batches(batch: int, steps: int = STEPS + 1):
    """Batches whose row ``r`` ends with ``(3 r + step) % SEQ`` ignored targets, plus a
    scattered ignored position in every third row: uneven valid counts everywhere."""
    out = []
    for step, (inputs, target) in enumerate(make_batches(VOCAB, batch, SEQ, steps, seed=3)):
        target = target.clone()
        for r in range(batch):
            pad = (3 * r + step) % SEQ
            if pad:
                target[r, SEQ - pad:] = IGNORE
            if r % 3 == 0:
                target[r, (r + step) % SEQ] = IGNORE
        out.append((inputs, target))
    return out


def padded_plans_job(model_name: str, plans: list[str], batch: int, overrides: dict):
    """Train each plan on the padded batches: {plan: {"losses", "eval", "state" (rank 0)}}."""
    batches = padded_batches(batch)
    out = {}
    for plan in plans:
        model, loss_fn, kwargs = build(model_name, overrides)
        pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                                 loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
        losses = [pm.train_step(*b) for b in batches[:STEPS]]
        result = {"losses": losses, "eval": pm.eval_step(*batches[STEPS])}
        state = pm.state_dict()
        result["state"] = {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None
        out[plan] = result
    return out


def reference_padded(model_name: str, batch: int, overrides: dict):
    """One device: the same batches, the loss's own mean over valid targets."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = padded_batches(batch)
    optimizer = OPTIMIZERS["adamw"](model.parameters())
    losses = []
    for inputs, target in batches[:STEPS]:
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs, **kwargs), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        evaluated = float(loss_fn(model(*batches[STEPS][0], **kwargs), batches[STEPS][1]))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "eval": evaluated, "state": state}
