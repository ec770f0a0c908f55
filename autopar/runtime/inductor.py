"""``parallelize(..., compile=...)``: ``torch.compile`` of each rank's program.

:func:`torch_compile_options` checks the user's argument; :func:`torch_compiled_program` returns what the
flat executor (:mod:`autopar.runtime.executors`) calls instead of the rewritten graph.

What is compiled, and what is not:

* the computation between autopar's inserted calls -- every aten op of the user's model --
  goes through ``torch.compile`` (TorchDynamo, AOTAutograd and the chosen backend, Inductor
  by default), forward and backward;
* every call the passes inserted (the collectives of :mod:`autopar.ops.collectives`, CP
  attention, MoE dispatch, ZeRO-3's gather: any ``call_function`` whose
  target lives in ``autopar``) runs eagerly between compiled regions
  (``torch.compiler.disable``).  Those calls are ``torch.autograd.Function``\\ s around
  ``torch.distributed`` that record each collective's bytes (the measured side of "predicted
  equals measured", forward and backward) and look their process group up in the running
  step; traced, their recording would run once at compile time and not on every step.  So
  the communication, its bytes and its duals are exactly those of the eager program, and the
  graph breaks sit where the collectives are;
* the saved-tensor pack hooks of the memory meter, SP's re-gather and ZeRO-3, which autograd's
  C++ calls inside compiled regions, are marked for TorchDynamo to run eagerly
  (:func:`autopar.compat.never_traced`).

The compiled program is a second ``GraphModule`` over the same parameter and buffer objects
(built after the parameters are this rank's shards), so ``pm.code()``, the views and
the state dict read the original; in-place updates (the optimizer, checkpoint loads, ZeRO's
``.data`` swaps) reach both.  Numerics: ``backend="aot_eager"`` runs the same aten ops as the
eager program; Inductor fuses them and agrees within floating-point reassociation
(tests/unit/test_compile.py, tests/dist/test_compile.py).

Refused with ``compile`` (:func:`torch_compile_options`, before tracing): activation recompute (its
regions are checkpoints with autopar's own context, which TorchDynamo cannot trace) and
pipeline parallelism (torch's stages run the split input/weight backward of zero-bubble
schedules through ``torch.autograd.grad`` on parts of a chunk's graph, which one compiled
backward cannot provide).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch

from autopar.compat import never_traced
from autopar.errors import AutoparError
from autopar.ops.regather import SavedGathers
from autopar.runtime.memory import MemoryMeter
from autopar.runtime.zero_params import ShardedParameters

__all__ = ["torch_compile_options", "torch_compiled_program"]

_ALLOWED = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def torch_compile_options(value: Any, plan=None) -> dict | None:
    """None for ``compile=False``; else the keyword arguments for ``torch.compile`` (``plan``:
    refused under pp; None: not known yet)."""
    if value is None or value is False:
        return None
    if value is True:
        options: dict = {}
    elif isinstance(value, dict):
        unknown = sorted(set(value) - _ALLOWED)
        if unknown:
            raise AutoparError(f"autopar: compile={value!r} has {', '.join(map(repr, unknown))}, which "
                               f"torch.compile does not take; expected True or a dict of torch.compile's "
                               f"keyword arguments ({', '.join(sorted(_ALLOWED))}).")
        options = dict(value)
    else:
        raise AutoparError(f"autopar: compile={value!r}; expected False, True or a dict of torch.compile's "
                           "keyword arguments, e.g. compile={'backend': 'aot_eager'}.")
    if plan is not None and plan.pp > 1:
        raise AutoparError(f"autopar: compile is not supported with pipeline parallelism (plan '{plan}'): "
                           "torch's pipeline stages differentiate parts of each chunk's graph (the split "
                           "backward of zero-bubble schedules), which one compiled backward cannot provide. "
                           "Drop compile, or choose a plan without pp.")
    if plan is not None and plan.recompute != "none":
        raise AutoparError(f"autopar: compile is not supported with activation recompute (plan '{plan}'): "
                           "a recomputed region is a torch.utils.checkpoint with autopar's own context "
                           "(random state, memory accounting), which TorchDynamo cannot trace, and a compiled "
                           "body recomputed in backward saved other tensors than its forward in our tests. "
                           "Drop compile, or drop recompute.")
    return options


def _inserted(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (getattr(node.target, "__module__", None) or "").startswith("autopar.")


def torch_compiled_program(gm: torch.fx.GraphModule, options: dict) -> Callable:
    """``torch.compile`` of a copy of ``gm`` whose autopar calls run eagerly (module docstring)."""
    for hook in (MemoryMeter._pack, ShardedParameters._pack, SavedGathers.pack):  # run inside compiled forwards
        never_traced(hook)
    graph = copy.deepcopy(gm.graph)  # FX copies node by node, metadata shallowly (fake values shared)
    disabled: dict[Callable, Callable] = {}
    for node in graph.nodes:
        if _inserted(node):
            if node.target not in disabled:
                disabled[node.target] = torch.compiler.disable(node.target)
            node.target = disabled[node.target]
    program = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    program.meta = gm.meta
    return torch.compile(program, **options)
