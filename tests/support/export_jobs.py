"""Per-rank jobs for tests/dist/test_export.py (run on every rank by tests/support/harness.py).

Not a test module.  :func:`export_job` trains one step under a plan (so the weights are no
longer the initial ones), exports them with ``pm.export_weights`` and returns the full
state dict the export should hold, and whether the file existed on this rank once the call
returned.  :func:`meta_export_cases_job` builds each case's model on the meta device, loads a
``save_pretrained`` directory with ``pm.load_pretrained``, exports it at once (sharded), trains
one step and exports again, and returns rank 0's state dict after the step.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, _parallelize, build

__all__ = ["export_job", "meta_export_cases_job", "SHARD_SIZE"]

SHARD_SIZE = "40KB"  # the tiny models' exports come out in several shards


def export_job(model_name: str, plan: str, overrides: dict, path: str, **options):
    pm, batches = _parallelize(model_name, plan, "adamw", overrides)
    pm.train_step(*batches[0])
    written = pm.export_weights(path, **options)
    return {
        "path": written,
        "exists": os.path.exists(written),
        "state": {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()},
    }


def meta_export_job(model_name: str, overrides: dict, plan: str, source: str, out: str) -> dict:
    """Exports to ``out/loaded`` (right after loading ``source``) and ``out/trained`` (after a step)."""
    with torch.device("meta"):
        model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    pm.load_pretrained(source)
    loaded = pm.export_weights(os.path.join(out, "loaded"), max_shard_size=SHARD_SIZE)
    pm.train_step(*batches[0])
    trained = pm.export_weights(os.path.join(out, "trained"), max_shard_size=SHARD_SIZE)
    state = pm.state_dict()  # collective: every rank
    return {"paths": (loaded, trained),
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None}


def meta_export_cases_job(cases: list) -> list:
    """:func:`meta_export_job` for each ``(model_name, overrides, plan, source, out)`` in one pool call."""
    return [meta_export_job(*case) for case in cases]
