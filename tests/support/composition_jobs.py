"""Per-rank job for tests/dist/test_composition.py: several plans trained in one pool job.

Not a test module.  :func:`plans_job` trains each plan of a list for 3 steps (one process
group, no start-up per plan) and returns, per plan, the losses, rank 0's final state dict
and the last step's communication records, for comparison with the single-device reference
and with the cost model's ``comm_table``.
"""
from __future__ import annotations

import torch.distributed as dist

from tests.support.jobs import _parallelize

__all__ = ["plans_job"]


def plans_job(model_name: str, plans: list[str], opt_name: str, overrides: dict, steps: int = 3):
    out = {}
    for plan in plans:
        pm, batches = _parallelize(model_name, plan, opt_name, overrides)
        losses = [pm.train_step(inputs, target) for inputs, target in batches[:steps]]
        state = pm.state_dict()
        out[plan] = {
            "losses": losses,
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None,
            "comm": pm.comm_stats(),
            "pp_rank": pm.coords().get("pp", (0, 1))[0],
        }
        del pm
    return out
