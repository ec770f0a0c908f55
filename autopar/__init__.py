"""autopar: an auto-parallelization compiler for unmodified PyTorch models.

The pipeline (docs/architecture.md draws it and the package layers):
  trace and analyze (autopar.frontend) -> plan (autopar.plan) -> passes (autopar.passes,
  inserting the operators of autopar.ops) -> emit/run (autopar.runtime),
a plan proved on CPU processes before a cluster runs it (autopar.verification, ``verify``)
and, offline, the symbolic cost model (autopar.cost) and plan search (autopar.planning).

The modules of this package's top level (layer 0, imported by everything above):
``errors`` (``AutoparError`` and message helpers), ``plan`` (``Plan``: degrees and options,
its text syntax), ``plan_space`` (every rule about which plans are valid and which the
runtime runs, option names and codes, the mesh axes), ``support`` (the runtime rules of
``plan_space`` asked about a plan), ``compat`` (every private PyTorch API autopar uses).
The sub-packages: ``frontend`` (trace, analyze), ``passes`` (folder ``passes/``: the graph
passes and ``compile_program``), ``ops`` (the operators a program calls), ``runtime``
(``parallelize``, ``ParallelModule``), ``cost`` (folder ``cost/``), ``planning`` (search,
``plan="auto"``), ``views`` (readable programs and schedules), ``verification``
(``autopar verify``), ``cli`` (the ``autopar`` command).

Public names are imported lazily so that the offline tools (`autopar plan`) start
fast and never touch torch.distributed; type checkers and IDEs see them through the
``TYPE_CHECKING`` imports below, which never run.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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
    "BatchSlice",
    "DistributedBatchSampler",
    "load_model_state_dict",
    "latest_checkpoint",
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
    "BatchSlice": ("autopar.runtime.stepping.data", "BatchSlice"),
    "DistributedBatchSampler": ("autopar.runtime.stepping.data", "DistributedBatchSampler"),
    "load_model_state_dict": ("autopar.runtime.weights.checkpoint", "load_model_state_dict"),
    "latest_checkpoint": ("autopar.runtime.weights.checkpoint_files", "latest_checkpoint"),
    "verify": ("autopar.verification", "verify"),
    "VerifyResult": ("autopar.verification", "VerifyResult"),
    "AutoparError": ("autopar.errors", "AutoparError"),
}


if TYPE_CHECKING:  # the names of _LAZY, for type checkers and IDEs (never imported at run time)
    from autopar.cost import Cluster, Cost, ModelSpec, estimate
    from autopar.errors import AutoparError
    from autopar.plan import Plan
    from autopar.planning.search import search
    from autopar.runtime import ParallelModule, init_distributed, parallelize
    from autopar.runtime.weights.checkpoint import load_model_state_dict
    from autopar.runtime.weights.checkpoint_files import latest_checkpoint
    from autopar.runtime.stepping.data import BatchSlice, DistributedBatchSampler
    from autopar.verification import VerifyResult, verify


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
