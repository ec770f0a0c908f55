"""Per-rank jobs for tests/dist/test_export.py (run on every rank by tests/harness.py).

Not a test module.  :func:`export_job` trains one step under a plan (so the weights are no
longer the initial ones), exports them with ``pm.export_weights`` and returns the full
state dict the export should hold, and whether the file existed on this rank once the call
returned.
"""
from __future__ import annotations

import os

from tests.jobs import _parallelize

__all__ = ["export_job"]


def export_job(model_name: str, plan: str, overrides: dict, path: str):
    pm, batches = _parallelize(model_name, plan, "adamw", overrides)
    pm.train_step(*batches[0])
    written = pm.export_weights(path)
    return {
        "path": written,
        "exists": os.path.exists(written),
        "state": {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()},
    }
