"""Per-rank jobs for tests/dist/test_fused_optimizer.py.

Not a test module.  :func:`fused_pairs_job` trains each case twice, with the flat fused
optimizer step (``fused_optimizer=True``, the default) and with the per-tensor step
(``False``); :func:`cross_checkpoint_job` saves under one and loads into the other.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import autopar
from tests.support.checkpoint_jobs import full_state
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import state_differences

__all__ = ["FUSED_OPTIMIZERS", "fused_pairs_job", "cross_checkpoint_job", "STEPS"]

STEPS = 3
FUSED_OPTIMIZERS = {
    "adamw": OPTIMIZERS["adamw"],
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}


def _program(plan: str, opt_name: str, fused: bool, mixed_precision=None, seed: int = 0):
    model, loss_fn, kwargs = build("example", {}, seed)
    batches = make_batches(VOCAB, BATCH, SEQ, STEPS, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=FUSED_OPTIMIZERS[opt_name],
                             mixed_precision=mixed_precision, fused_optimizer=fused)
    return pm, batches


def _layout(pm) -> dict:
    """How the optimizer steps: how many tensors, whether fused, whether GradSync made them flat."""
    groups = pm.optimizer.param_groups
    return {"tensors": sum(len(g["params"]) for g in groups), "fused": all(g.get("fused") for g in groups),
            "flat": getattr(pm.grad_sync, "flat", None) is not None}


def fused_pairs_job(cases: list) -> list[dict]:
    """For each ``(plan, opt_name, mixed_precision)``: both runs' losses, rank 0's state dicts,
    the checkpoint state (``optim.*`` included) and how the optimizer steps."""
    out = []
    for plan, opt_name, mixed_precision in cases:
        runs = {}
        for fused in (True, False):
            pm, batches = _program(plan, opt_name, fused, mixed_precision)
            losses = [pm.train_step(*b) for b in batches]
            state, ckpt = pm.state_dict(), full_state(pm)
            keep = dist.get_rank() == 0
            runs[fused] = {"losses": losses, "layout": _layout(pm), "memory": pm.memory_report(),
                           "state": {k: v.detach().cpu().clone() for k, v in state.items()} if keep else None,
                           "ckpt": {k: v.clone() for k, v in ckpt.items() if k != "sched.state"} if keep else None}
            del pm
        out.append(runs)
    return out


def cross_checkpoint_job(plan_a: str, fused_a: bool, plan_b: str, fused_b: bool, path: str,
                         mixed_precision=None) -> dict:
    """Train one step under ``(plan_a, fused_a)``, save, load into a program of other weights under
    ``(plan_b, fused_b)``, train two more steps: what differs after loading, the losses, rank 0's state."""
    pm, batches = _program(plan_a, "adamw", fused_a, mixed_precision)
    losses = [pm.train_step(*batches[0])]
    pm.save(path)
    saved = full_state(pm)
    del pm
    pm, _ = _program(plan_b, "adamw", fused_b, mixed_precision, seed=7)
    pm.load(path)
    differences = state_differences(saved, full_state(pm))
    losses += [pm.train_step(*b) for b in batches[1:]]
    state = pm.state_dict()
    return {"losses": losses, "differences": differences, "layout": _layout(pm),
            "num_optim": sum(k.startswith("optim.") for k in saved),
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None}
