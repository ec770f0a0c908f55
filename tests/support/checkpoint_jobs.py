"""Per-rank jobs for tests/dist/test_checkpoint.py, and the child process its crash test kills.

Not a test module.  ``reshard_job`` trains under one plan, saves, loads under another plan
and keeps training; ``python tests/support/checkpoint_jobs.py PATH SIDE`` (single process, no
process group) saves a checkpoint, records its state in SIDE, then starts a second save
that stops after the data are written (before the commit) so the test can kill it there.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script by the crash test
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import state_differences

__all__ = ["reshard_job", "full_state", "BATCH", "SEQ", "VOCAB"]


def full_state(pm) -> dict[str, torch.Tensor]:
    """Everything a checkpoint of ``pm`` holds: the union of each rank's ``checkpoint_state()``
    (under pp a rank holds only its stage's entries), the same on every rank."""
    mine = pm.checkpoint_state()
    if not dist.is_initialized():
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return dict(sorted(out.items()))


def _pm(model_name: str, plan: str, seed: int = 0, lr_scheduler=None, mixed_precision=None):
    model, loss_fn, kwargs = build(model_name, {}, seed)
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], lr_scheduler=lr_scheduler,
                             mixed_precision=mixed_precision)
    return pm, batches


def reshard_job(model_name: str, plan_a: str, plan_b: str, path: str, steps_before: int = 1,
                scheduled: bool = False, mixed_precision: str | None = None):
    """Train under ``plan_a``, save, load into a fresh module (other seed) under ``plan_b``, train on.

    ``scheduled``: with tests/support/training_jobs.py's learning-rate schedule (saved and restored too);
    ``mixed_precision``: passed to ``parallelize`` on both sides.
    Returns the losses of all 3 steps, what of the full model+optimizer state after loading differs
    from what was saved, bit for bit (``differences``: lines naming the tensors, empty when the load
    is exact), and rank 0's final state dict.
    """
    from tests.support.training_jobs import SCHEDULER

    scheduler = SCHEDULER if scheduled else None
    pm, batches = _pm(model_name, plan_a, lr_scheduler=scheduler, mixed_precision=mixed_precision)
    losses = [pm.train_step(*b) for b in batches[:steps_before]]
    pm.save(path)
    saved = full_state(pm)
    del pm
    pm, _ = _pm(model_name, plan_b, seed=7, lr_scheduler=scheduler, mixed_precision=mixed_precision)
    pm.load(path)
    loaded = full_state(pm)
    differences = state_differences(saved, loaded)
    losses += [pm.train_step(*b) for b in batches[steps_before:]]
    state = pm.state_dict()
    return {"losses": losses, "differences": differences, "num_optim": sum(k.startswith("optim.") for k in saved),
            "state": {k: v.clone() for k, v in state.items()} if dist.get_rank() == 0 else None}


def _child(path: str, side: str) -> None:
    pm, batches = _pm("example", "none")
    pm.train_step(*batches[0])
    pm.save(path)
    torch.save(full_state(pm), side)
    pm.train_step(*batches[1])
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def stalled_finish(self, metadata, results):
        print("WRITTEN", flush=True)  # the data files are on disk; the metadata and commit are not
        time.sleep(600)

    FileSystemWriter.finish = stalled_finish
    pm.save(path)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
