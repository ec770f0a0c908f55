"""autopar: an auto-parallelization compiler for unmodified PyTorch models.

The pipeline (docs/architecture.md draws it and the package layers):
  trace and analyze (autopar.frontend) -> plan (autopar.plan) -> passes (autopar.passes,
  inserting the operators of autopar.ops) -> emit/run (autopar.runtime),
a plan proved on CPU processes before a cluster runs it (autopar.verification, ``verify``)
and, offline, the symbolic cost model (autopar.cost) and plan search (autopar.planning).

Public names are imported lazily so that the offline tools (`autopar plan`) start
fast and never touch torch.distributed.
"""
from __future__ import annotations

import importlib

__all__ = [
    "Plan",
    "ModelSpec",
    "Cluster",
    "Cost",
    "estimate",
    "search",
    "init_distributed",
    "parallelize",
    "ParallelModule",
    "verify",
    "VerifyResult",
    "AutoparError",
]

_LAZY = {
    "Plan": ("autopar.plan", "Plan"),
    "ModelSpec": ("autopar.cost", "ModelSpec"),
    "Cluster": ("autopar.cost", "Cluster"),
    "Cost": ("autopar.cost", "Cost"),
    "estimate": ("autopar.cost", "estimate"),
    "search": ("autopar.planning.search", "search"),
    "init_distributed": ("autopar.runtime", "init_distributed"),
    "parallelize": ("autopar.runtime", "parallelize"),
    "ParallelModule": ("autopar.runtime", "ParallelModule"),
    "verify": ("autopar.verification", "verify"),
    "VerifyResult": ("autopar.verification", "VerifyResult"),
    "AutoparError": ("autopar.errors", "AutoparError"),
}


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
