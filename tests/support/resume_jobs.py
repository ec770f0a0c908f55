"""Resuming from a checkpoint, in one process or on every rank of tests/support/harness.py's pool.

Not a test module.  :func:`resume_job` trains the example decoder on batches a
:class:`autopar.DistributedBatchSampler` hands out (local batches, as a user loading only its
part would), with a learning-rate schedule and, with ``overrides``, dropout: once without
interruption, and once saved after ``before`` steps (with the sampler's position) and resumed
into a fresh program of other weights under another plan.  :func:`read_checkpoint` is every
tensor a checkpoint holds, for bit-for-bit comparisons.  :func:`async_job` compares a
checkpoint written in the background, while training went on, with a blocking one of the same
state; :func:`damaged_job` has every rank load a checkpoint whose shard file rank 0 cut short.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import autopar
from autopar.runtime.weights.checkpoint import read_entries
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.training_jobs import SCHEDULER

__all__ = ["read_checkpoint", "resume_job", "async_job", "damaged_job", "DATASET_LEN"]

DATASET_LEN = 40  # 10 global batches of BATCH rows: a run of a few steps stays inside epoch 0


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor entry of the checkpoint at ``path`` (collective under a process group)."""
    return read_entries(path)


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (DATASET_LEN, SEQ + 1), generator=gen, dtype=torch.int64)


def _program(plan: str, overrides: dict, seed: int):
    model, loss_fn, kwargs = build("example", overrides, seed)
    example = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)[0][0]
    pm = autopar.parallelize(model, example_inputs=example, example_kwargs=kwargs, plan=plan, loss_fn=loss_fn,
                             optimizer=OPTIMIZERS["adamw"], lr_scheduler=SCHEDULER)
    sampler = autopar.DistributedBatchSampler(DATASET_LEN, BATCH, pm, shuffle=True, seed=3)
    return pm, sampler


def _train(pm, sampler, steps: int) -> tuple[list[float], list[list[int]]]:
    """``steps`` steps on the sampler's batches: the losses and each step's global sample indices."""
    tokens = _tokens()
    loader = DataLoader(TensorDataset(torch.arange(DATASET_LEN)), batch_sampler=sampler)
    slc = pm.batch_slice(BATCH, seq_len=SEQ)
    losses, seen = [], []
    for _, (rows,) in zip(range(steps), loader):  # range first: zip would draw one batch too many
        ids, target = tokens[rows, :-1], tokens[rows, 1:]
        losses.append(pm.train_step((slc.take_positions(ids),), slc.take_positions(target), local=True))
        seen.append(_global_rows(pm, rows.tolist()))
    return losses, seen


def _global_rows(pm, rows: list[int]) -> list[int]:
    """The global batch's sample indices from each rank's rows (every dp rank's, in dp order)."""
    if not _distributed():
        return rows
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (pm.coords().get("dp", (0, 1))[0], rows))
    return [i for _, r in sorted(dict(parts).items()) for i in r]


def resume_job(plan_a: str, plan_b: str, path: str, overrides: dict, before: int = 2, after: int = 2,
               blocking: bool = True) -> dict:
    """The uninterrupted run under ``plan_a`` and the one saved after ``before`` steps, resumed
    under ``plan_b`` from other weights: losses, sample indices, steps taken, learning rates."""
    pm, sampler = _program(plan_a, overrides, seed=0)
    losses, seen = _train(pm, sampler, before + after)
    uninterrupted = {"losses": losses, "seen": seen, "lr": pm.optimizer.param_groups[0]["lr"]}
    del pm
    pm, sampler = _program(plan_a, overrides, seed=0)
    losses, seen = _train(pm, sampler, before)
    pm.save(path, blocking=blocking, data=sampler)
    pm.wait_checkpoint()
    del pm
    pm, sampler = _program(plan_b, overrides, seed=7)
    pm.load(path, data=sampler)
    steps_loaded = pm.num_steps_taken
    more, more_seen = _train(pm, sampler, after)
    return {"uninterrupted": uninterrupted, "losses": losses + more, "seen": seen + more_seen,
            "steps_loaded": steps_loaded, "steps": pm.num_steps_taken, "lr": pm.optimizer.param_groups[0]["lr"]}


def async_job(plan: str, directory: str) -> dict:
    """A blocking save and a background save of the same state, the second written while two more
    steps change every tensor: the entries of the two checkpoints that differ (bit for bit), and
    whether training moved the weights meanwhile."""
    pm, batches = _program(plan, {}, seed=0)[0], make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm.train_step(*batches[0])
    pm.save(os.path.join(directory, "blocking"))
    pm.save(os.path.join(directory, "background"), blocking=False)
    before = pm.state_dict()
    for inputs, target in batches[1:]:
        pm.train_step(inputs, target)
    moved = not all(torch.equal(v, pm.state_dict()[k]) for k, v in before.items())
    pm.wait_checkpoint()
    a, b = (read_checkpoint(os.path.join(directory, name)) for name in ("blocking", "background"))
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    return {"differ": differ, "entries": len(a), "moved": moved,
            "latest": autopar.latest_checkpoint(directory)}


def damaged_job(plan: str, path: str) -> dict:
    """Save, cut rank 1's shard file short (rank 0 does it), load on every rank: each rank's error,
    and whether its program kept the state it had (nothing half-loaded)."""
    pm, batches = _program(plan, {}, seed=0)[0], make_batches(VOCAB, BATCH, SEQ, 2, seed=1)
    pm.train_step(*batches[0])
    pm.save(path)
    shard = os.path.join(os.path.realpath(path), "__1_0.distcp")
    if dist.get_rank() == 0:
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    dist.barrier()
    pm.train_step(*batches[1])
    kept = pm.state_dict()
    try:
        pm.load(path)
        error = None
    except autopar.AutoparError as exc:
        error = str(exc)
    unchanged = all(torch.equal(v, pm.state_dict()[k]) for k, v in kept.items())
    return {"error": error, "unchanged": unchanged, "shard": shard, "steps": pm.num_steps_taken}
