"""Per-rank jobs for the local-batch tests (run on every rank by tests/support/harness.py).

Not a test module.  :func:`local_vs_global_job` trains the same model twice in one job,
once on the global batches and once on this rank's part of them (``pm.batch_slice(...).take``
and ``train_step(..., local=True)``), and compares; it also checks that a ``DataLoader`` with
``DistributedBatchSampler`` loads exactly the rows ``take`` cuts.  The test is
tests/dist/test_local_batches.py; the single-process rules are tests/unit/test_data.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import autopar
from autopar.runtime.stepping.data import DistributedBatchSampler
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

__all__ = ["local_vs_global_job"]


def _run(model_name: str, plan: str, overrides: dict, batches, local: bool):
    """Train on ``batches[:-1]`` (AdamW), evaluate ``batches[-1]``; losses, eval loss, state (rank 0)."""
    model, loss_fn, kwargs = build(model_name, overrides)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    slc = pm.batch_slice(BATCH, seq_len=SEQ)

    def part(inputs, target):
        return (tuple(slc.take(t) for t in inputs), slc.take(target)) if local else (inputs, target)

    losses = [pm.train_step(*part(inputs, target), local=local) for inputs, target in batches[:-1]]
    eval_loss = pm.eval_step(*part(*batches[-1]), local=local)
    state = {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()}
    return pm, losses, eval_loss, state


def _loader_matches_take(pm, batches) -> bool:
    """The sampler's loader yields, batch by batch, what ``take`` cuts from the global batch."""
    slc = pm.batch_slice(BATCH, seq_len=SEQ)
    ids = torch.cat([inputs[0] for inputs, _ in batches])
    target = torch.cat([t for _, t in batches])
    loader = DataLoader(TensorDataset(ids, target), batch_sampler=DistributedBatchSampler(len(ids), BATCH, pm))
    got = [(slc.take_positions(i), slc.take_positions(t)) for i, t in loader]
    want = [(slc.take(inputs[0]), slc.take(t)) for inputs, t in batches]
    return len(got) == len(want) and all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want))


def local_vs_global_job(model_name: str, plan: str, overrides: dict, steps: int = 3):
    """Three AdamW steps and an eval step, global batches vs this rank's part of them."""
    batches = make_batches(VOCAB, BATCH, SEQ, steps + 1, seed=1)
    _, global_losses, global_eval, global_state = _run(model_name, plan, overrides, batches, local=False)
    pm, local_losses, local_eval, local_state = _run(model_name, plan, overrides, batches, local=True)
    same_state = global_state.keys() == local_state.keys() and all(
        torch.equal(global_state[k], local_state[k]) for k in global_state)
    return {"rank": dist.get_rank(), "global": global_losses, "local": local_losses,
            "global_eval": global_eval, "local_eval": local_eval, "same_state": same_state,
            "slice": pm.batch_slice(BATCH, seq_len=SEQ), "coords": {a: r for a, (r, _) in pm.coords().items()},
            "loader_matches_take": _loader_matches_take(pm, batches)}
