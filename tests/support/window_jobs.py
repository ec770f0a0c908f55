"""Pool job of tests/dist/test_sliding_window.py: each (model, plan) trained, or refused when compiled.

A plan either trains exactly or is refused with an ``autopar:`` error before its first step
(the standard every windowed model is held to); :func:`train_or_refuse_job` records which, so
one pool call covers the plans a model runs and those it refuses.
"""
from __future__ import annotations

import torch.distributed as dist

from autopar.errors import AutoparError
from tests.support.jobs import _parallelize

__all__ = ["train_or_refuse_job"]


def train_or_refuse_job(cases: list, opt_name: str, steps: int = 3) -> list[dict]:
    """For each ``(model_name, plan)``: ``{"refused": message}`` when ``parallelize`` refuses it, else
    the losses of ``steps`` steps and (rank 0) the state dict after them."""
    out = []
    for model_name, plan in cases:
        try:
            pm, batches = _parallelize(model_name, plan, opt_name, {}, wire=False)
        except AutoparError as exc:
            out.append({"refused": str(exc)})
            continue
        losses = [pm.train_step(inputs, target) for inputs, target in batches[:steps]]
        state = pm.state_dict()
        out.append({"losses": losses, "state": {k: v.detach().cpu().clone() for k, v in state.items()}
                    if dist.get_rank() == 0 else None})
    return out
