"""Condition 2 of layer stamping: every copied layer behaves like the exported twin it is copied from.

:mod:`autopar.frontend.stamp` copies an untraced layer's subgraph from an exported layer of
the same kind.  Their attributes are equal except the layer's position, so what could still
differ is code that reads the position (``config.layer_types[self.layer_idx]``) or makes a
different constant.  Here each copied layer is run eagerly on the inputs its twin received
during the export (recorded by :class:`InputCapture` as shapes), as is the twin, and their
aten calls are compared: op, arguments, dataflow (which call's output, which input, which
parameter by its name in the layer), small constants by value.  The runs use the meta device
(no memory, microseconds a call) or, for code without meta kernels, fake tensors, under
``torch.export``'s own "compiling" flags so model code takes the branch it takes under export.

Neighbours: :mod:`autopar.frontend.stamp` (the plan, conditions 1 and 3, the copy) and
:mod:`autopar.frontend.trace`, which runs the export inside :class:`InputCapture`.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
# torch.export's own "compiling" flags (private: torch has no public way to set them).
from torch._export.utils import _compiling_state_context
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.frontend.stamp import CannotStamp, StampPlan

__all__ = ["InputCapture", "check_behaviour"]


def _hint(size: Any) -> int:
    return size if isinstance(size, int) else int(size.node.hint)


def _describe(value: Any) -> Any:
    """A traced input as plain data (shape hints), safe to keep after the export."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(_hint(s) for s in value.shape), tuple(_hint(s) for s in value.stride()),
                value.dtype, value.device.type)
    if isinstance(value, torch.SymInt):
        return ("int", _hint(value))
    return ("value", value)


class InputCapture:
    """Forward pre-hooks that record what the twins receive while the shallow copy is exported.

    The hooks sit on the user's layer modules for the duration of the export only and are
    removed on exit; they read shapes and touch no tensor.
    """

    def __init__(self, plan: StampPlan):
        self._plan = plan
        self.inputs: dict[int, tuple] = {}
        self._handles: list = []

    def __enter__(self) -> "InputCapture":
        twins = {self._plan.twin(i) for i in range(self._plan.num_traced, len(self._plan.layers))}
        for j in twins:
            def hook(module, args, kwargs, j=j):
                self.inputs.setdefault(j, pytree.tree_map(_describe, (args, kwargs)))
            self._handles.append(self._plan.layers[j].register_forward_pre_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()


def _materialise(described: Any, on_meta: bool) -> Any:
    def build(d):
        if d[0] == "tensor":
            return torch.empty_strided(d[1], d[2], dtype=d[3], device="meta" if on_meta else d[4])
        return d[1]
    return pytree.tree_map(build, described, is_leaf=lambda d: isinstance(d, tuple) and len(d) in (2, 5)
                           and d[0] in ("tensor", "int", "value"))


class _Recorder(TorchDispatchMode):
    """Runs every aten call on the meta device and writes it down with its dataflow."""

    def __init__(self, names: dict[int, Any], on_meta: bool):
        super().__init__()
        self._on_meta = on_meta  # else a FakeTensorMode below this mode runs the calls
        self.calls: list = []
        self._tokens = dict(names)  # id(tensor) -> token
        self._alive: list = []  # keep outputs alive so their ids stay unique

    def token(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            known = self._tokens.get(id(a))
            if known is not None:
                return known
            # A tensor the forward made from Python data (torch.tensor(...)): compared by value.
            value = getattr(a, "constant", None) if isinstance(a, FakeTensor) else (
                a if not a.is_meta and a.numel() <= 64 else None)
            if value is not None and value.numel() <= 64:
                return ("constant", tuple(a.shape), a.dtype, tuple(value.flatten().tolist()))
            return ("unnamed", tuple(a.shape), a.dtype)
        if isinstance(a, torch.device):
            return "device"
        return a

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        self.calls.append((func, spec, [self.token(a) for a in flat]))
        if self._on_meta and any(isinstance(a, torch.Tensor) and not a.is_meta for a in flat):  # real parameters
            args, kwargs = pytree.tree_unflatten(
                [a.to("meta") if isinstance(a, torch.Tensor) and not a.is_meta else a for a in flat], spec)
        out = func(*args, **kwargs)
        position = len(self.calls) - 1
        for k, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self._tokens[id(t)] = ("op", position, k)
                self._alive.append(t)
        return out


def _record(layer: nn.Module, described: tuple, on_meta: bool) -> list:
    """The layer's aten calls on the twin's inputs: on the meta device, or (``on_meta=False``,
    for layers whose eager code has no meta kernels, e.g. grouped expert GEMMs) under fake
    tensors, where Hugging Face takes the path it takes under export."""
    fake = contextlib.nullcontext() if on_meta else FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        args, kwargs = _materialise(described, on_meta)
    names = {id(t): ("param", n) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
    for k, t in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(t, torch.Tensor):
            names[id(t)] = ("input", k)
    rec = _Recorder(names, on_meta)
    # torch.export's own "compiling" flags, so model code takes the branch it takes under export
    # (Hugging Face's MoE experts pick their GEMM by torch.compiler.is_compiling()).
    with torch.no_grad(), _compiling_state_context(), fake, rec:
        out = layer(*args, **kwargs)
    return rec.calls + [("output", pytree.tree_map(rec.token, out))]


def _records(plan: StampPlan, i: int, j: int, described: tuple, expected: dict) -> tuple[list, list]:
    """Layer ``i``'s and its twin ``j``'s calls, on meta if both run there, else under fake tensors."""
    for on_meta in (True, False):
        try:
            if (j, on_meta) not in expected:
                expected[j, on_meta] = _record(plan.layers[j], described, on_meta)
            return _record(plan.layers[i], described, on_meta), expected[j, on_meta]
        except Exception as exc:
            error = exc
    raise CannotStamp(f"layer {i} could not be run on meta or fake tensors to compare it with layer {j} "
                      f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")


def check_behaviour(plan: StampPlan, inputs: dict[int, tuple]) -> None:
    """Condition 2: each untraced layer's aten calls equal its twin's on the twin's inputs."""
    expected: dict[tuple, list] = {}
    for i in range(plan.num_traced, len(plan.layers)):
        j = plan.twin(i)
        if j not in inputs:
            raise CannotStamp(f"layer {j} was not called during the export")
        got, want = _records(plan, i, j, inputs[j], expected)
        if got != want:
            first = next((n for n, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise CannotStamp(f"layer {i} runs differently from layer {j} of the same kind "
                              f"(aten call {first} differs)")
