"""The runtime's parts behind their interfaces: both gradient-sync strategies implement
:class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`, both executors
:class:`autopar.runtime.stepping.executors.Executor`, with signatures that accept the protocol's calls (the attributes, ``optimizer`` and ``zero_stage``,
are set per instance)."""
from __future__ import annotations

import inspect

import pytest

from autopar.runtime.stepping.executors import Executor, FlatExecutor
from autopar.runtime.gradients.grad_sync import GradSync
from autopar.runtime.stepping.pipelined import PipelineExecutor
from autopar.runtime.gradients.sync_protocol import GradientSynchronizer
from autopar.runtime.gradients.zero_fsdp import FullyShardedSync
from autopar.runtime.gradients.zero_optimizer import DistributedOptimizer


def _methods(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]


@pytest.mark.parametrize("protocol, cls", [(GradientSynchronizer, GradSync), (GradientSynchronizer, DistributedOptimizer),
                                           (GradientSynchronizer, FullyShardedSync),
                                           (Executor, FlatExecutor), (Executor, PipelineExecutor)])
def test_class_implements_protocol(protocol, cls):
    for name in _methods(protocol):
        wanted = list(inspect.signature(getattr(protocol, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got[:len(wanted)] == wanted, f"{cls.__name__}.{name}{got} does not take {wanted}"
        extra = [inspect.signature(getattr(cls, name)).parameters[p] for p in got[len(wanted):]]
        assert all(p.default is not inspect.Parameter.empty for p in extra), f"{cls.__name__}.{name}: {extra}"
    assert all(getattr(protocol, name).__doc__ for name in _methods(protocol))
