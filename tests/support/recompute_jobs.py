"""Per-rank jobs for the activation-recompute tests (run on every rank by tests/support/harness.py).

Not a test module.  :func:`recompute_plans_job` trains several plans of one model in one job
(one gloo start-up for all of them) and returns, per plan, the losses, the full state dict
(rank 0), the last step's comm records and the memory report.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import SEQ, VOCAB, build
from tests.support.wire import train_guarded

__all__ = ["recompute_plans_job", "BATCH"]

BATCH = 4


def recompute_plans_job(model_name: str, plans: list[str], opt_name: str, overrides: dict, steps: int = 3,
                        batch: int = BATCH) -> dict:
    out = {}
    for plan in plans:
        model, loss_fn, kwargs = build(model_name, overrides)
        batches = make_batches(VOCAB, batch, SEQ, steps, seed=1)
        torch.manual_seed(7)  # the dropout streams' base seed, the same for every plan
        pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                                 loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name])
        losses = train_guarded(pm, batches[:steps])
        comm = pm.comm_stats()
        state = pm.state_dict()
        out[plan] = {
            "losses": losses,
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None,
            "comm": comm,
            "memory": pm.memory_report(),
            "regions": sorted(n for n, _ in pm.gm.named_children() if n.startswith("recompute_")),
            "recomputed": pm.step_context.counters["recomputed_regions"],  # the last step's, on this rank
        }
    return out
