"""``parallelize(..., compile=...)``: ``torch.compile`` of each rank's program.

:func:`torch_compile_options` checks the user's argument; :func:`torch_compiled_program` returns what
the executors (:mod:`autopar.runtime.stepping.executors`, :mod:`autopar.runtime.stepping.pipelined`) call instead of
the rewritten graph.  Every plan compiles.

What is compiled, and what is not:

* the computation between autopar's inserted calls -- every aten op of the user's model --
  goes through ``torch.compile`` (TorchDynamo, AOTAutograd and the chosen backend, Inductor
  by default), forward and backward;
* every call the passes inserted (the collectives of :mod:`autopar.ops.collectives`, CP
  attention, MoE dispatch, ZeRO-3's gather, dropout: any ``call_function`` whose
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

Pipeline parallelism: each of this rank's chunks is compiled as above (the executor gives
torch's stage the chunk's parameters around its Inductor program); the P2P between stages is
``torch.distributed.pipelining``'s, eager.  The split input / weight backward of zbv and
dualpipev still works: torch's stage walks the chunk's autograd graph, where a compiled region
is one node with the activations and the parameters as inputs; the input backward hooks that
node's output gradients (retaining the graph) and the weight backward runs the node again from
them to the parameters.  So the weight gradients are exactly the full backward's, but the
compiled region's backward runs twice (a compiled backward computes every input's gradient;
the eager one, op by op, only the needed ones), and its saved buffers must not be donated
(:func:`autopar.compat.retained_compiled_backward`).  The collectives between regions are not
run again: the weight backward only follows edges that lead to the parameters.

Activation recompute: a region's :class:`autopar.ops.recompute.Recompute` call stays eager (a
graph break): the checkpoint with autopar's context (dropout streams, the recompute counter,
comm phases, the memory meter's working set) runs as in the eager program, around the region's
body compiled on its own, so forward runs the compiled body and backward runs it again.  The
body gets plain views of the parameters it reads: the checkpoint hands its inputs back to the
recomputation as plain tensors, and a body compiled for Parameters would be recompiled there,
into a graph that saves other tensors than forward's (torch's checkpoint refuses that).

The Inductor program is a second ``GraphModule`` over the same parameter and buffer objects
(built after the parameters are this rank's shards), so ``pm.code()``, the views and
the state dict read the original; in-place updates (the optimizer, checkpoint loads, ZeRO's
``.data`` swaps) reach both.  Numerics: ``backend="aot_eager"`` runs the same aten ops as the
eager program, so it trains bitwise the same where no graph break splits a sum of gradients; a
graph break (a collective, dropout, a recomputed region) can change the order in which a
tensor's gradients add up (one compiled backward node sums some of them before autograd adds
the rest).  Inductor fuses the ops and agrees within floating-point reassociation
(tests/unit/test_compile.py, tests/dist/test_compile.py, tests/e2e/test_compile_inductor.py).
"""
from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch

from autopar.compat import never_traced
from autopar.errors import AutoparError
from autopar.ops.recompute import Recompute, checkpointed
from autopar.ops.regather import SavedGathers
from autopar.runtime.stepping.memory import MemoryMeter
from autopar.runtime.gradients.zero_fsdp import FullyShardedSync

__all__ = ["torch_compile_options", "torch_compiled_program"]

_ALLOWED = frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def torch_compile_options(value: Any) -> dict | None:
    """None for ``compile=False``; else the keyword arguments for ``torch.compile`` (every plan compiles)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        unknown = sorted(set(value) - _ALLOWED)
        if unknown:
            raise AutoparError(f"autopar: compile={value!r} has {', '.join(map(repr, unknown))}, which "
                               f"torch.compile does not take; expected True or a dict of torch.compile's "
                               f"keyword arguments ({', '.join(sorted(_ALLOWED))}).")
        return dict(value)
    raise AutoparError(f"autopar: compile={value!r}; expected False, True or a dict of torch.compile's "
                       "keyword arguments, e.g. compile={'backend': 'aot_eager'}.")


def _inserted(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (getattr(node.target, "__module__", None) or "").startswith("autopar.")


class _EagerRecompute(Recompute):
    """A recomputed region of a Inductor program: the checkpoint (with autopar's context) runs
    eagerly, a graph break, around the region's body compiled on its own."""

    @torch.compiler.disable
    def forward(self, *inputs):
        # The recomputation gets the body's inputs back from the checkpoint as plain tensors;
        # given Parameters in forward, the compiled body's guards would fail there and a
        # recompiled graph save other tensors.  So the body sees plain views of the parameters
        # in forward too (the gradient flows through the view to the parameter).
        inputs = tuple(x.view_as(x) if isinstance(x, torch.nn.Parameter) else x for x in inputs)
        return checkpointed(self.body, *inputs)


def _eager_calls(gm: torch.fx.GraphModule, options: dict) -> torch.fx.GraphModule:
    """A copy of ``gm`` over the same parameters whose autopar calls run eagerly, and whose
    recomputed regions run their checkpoint eagerly around a compiled copy of their body."""
    graph = copy.deepcopy(gm.graph)  # FX copies node by node, metadata shallowly (fake values shared)
    disabled: dict[Callable, Callable] = {}
    for node in graph.nodes:
        if _inserted(node):
            if node.target not in disabled:
                disabled[node.target] = torch.compiler.disable(node.target)
            node.target = disabled[node.target]
    program = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    program.meta = gm.meta
    for node in graph.nodes:
        region = program.get_submodule(node.target) if node.op == "call_module" else None
        if isinstance(region, Recompute):  # GraphModule() shares the submodule: replace, not modify
            body = torch.compile(_eager_calls(region.body, options), **options)
            program.set_submodule(node.target, _EagerRecompute(body, region.kind, region.module))
    return program


def torch_compiled_program(gm: torch.nn.Module, options: dict) -> torch.nn.Module:
    """``torch.compile`` of a copy of ``gm`` whose autopar calls run eagerly (module docstring)."""
    for hook in (MemoryMeter._pack, FullyShardedSync.pack, SavedGathers.pack):  # run inside compiled forwards
        never_traced(hook)
    return torch.compile(_eager_calls(gm, options), **options)
