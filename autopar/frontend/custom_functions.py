"""Custom ``torch.autograd.Function`` s met while tracing: refused, because the trace loses them.

``torch.export`` (non-strict) runs a Function's ``forward`` as ordinary code and records the ops
it runs; its ``backward`` is not recorded.  autopar's program then gets that part's gradient by
autograd through the recorded forward, which is the model's gradient only when the Function's
backward is the exact derivative of its forward -- and a Function exists precisely when it is
not (Reformer's reversible layers recompute under ``torch.no_grad()``; RecurrentGemma bounds a
square root's derivative; PhiMoE's sparse mixer passes a straight-through estimate).  No graph
can tell the two apart, so :func:`watch` records every Function applied to a tensor that needs a
gradient during the export, and :func:`refuse` turns the first into an ``autopar:`` error.
``torch``'s own Functions (activation checkpointing) keep autograd's gradient and are not watched.

Neighbours: :mod:`autopar.frontend.trace` exports under :func:`watch`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import traceback

import torch

from autopar.errors import AutoparError

__all__ = ["AppliedFunction", "watch", "refuse"]


@dataclasses.dataclass(frozen=True)
class AppliedFunction:
    name: str
    backward_at: str  # file:line of its backward
    called_at: str    # file:line of the call to ``apply``


def _where(fn) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return "an unknown place"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("custom_functions.py"):
            return f"{frame.filename}:{frame.lineno}"
    return "an unknown place"


def _needs_grad(args) -> bool:
    flat, _ = torch.utils._pytree.tree_flatten(args)
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)


@contextlib.contextmanager
def watch():
    """Record (into the yielded list) every non-torch Function applied to a tensor that needs a
    gradient inside the block; ``Function.apply`` is restored afterwards."""
    applied: list[AppliedFunction] = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch.") and torch.is_grad_enabled() and _needs_grad((args, kwargs)):
            applied.append(AppliedFunction(cls.__qualname__, _where(cls.backward), _caller()))
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield applied
    finally:
        torch.autograd.Function.apply = original


def refuse(model: torch.nn.Module, applied: list[AppliedFunction]) -> None:
    """An ``autopar:`` error for the first recorded Function, if any."""
    if not applied:
        return
    first = applied[0]
    others = sorted({a.name for a in applied} - {first.name})
    raise AutoparError(
        f"autopar: {type(model).__name__} applies the custom torch.autograd.Function '{first.name}' "
        f"(called at {first.called_at}; its backward at {first.backward_at})"
        + (f", and {', '.join(others)}" if others else "")
        + "; torch.export records a Function's forward only, so the parallel program would take "
        "autograd's derivative of that forward instead of its backward and train differently from the "
        "model. Expected gradients that autograd derives from the forward: write that part with "
        "ordinary torch ops (or its eval-mode path, if the model has one), or train this model without autopar.")
