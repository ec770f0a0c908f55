"""Trace an unmodified model, with its loss, to an aten-level FX graph.

First stage of the pipeline (docs/architecture.md): ``torch.export.export(..., strict=False)`` of a
small wrapper that calls the user's model and then the user's loss function, so the loss
lives in the same graph as the model and the tensor-parallel pass can compute it
vocab-parallel.  Batch and sequence dimensions are traced symbolically so the same graph
runs on the local shards that data, sequence and context parallelism give each rank.

Neighbours: :mod:`autopar.frontend.analyze` reads the graph this module returns; the passes in
``passes/`` rewrite it; :mod:`autopar.runtime` runs it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.export import Dim

from autopar.compat import map_tensors, sym_expr
from autopar.errors import AutoparError
from autopar.frontend import custom_functions, stamp, stamp_behaviour

log = logging.getLogger("autopar.trace")

__all__ = ["Traced", "trace_model", "trace_memo", "default_target", "model_device", "on_device", "MODEL_PREFIX"]

# The memo trace_model consults, if a caller entered one (trace_memo); None: every call exports.
_MEMO: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("autopar_trace_memo", default=None)


@contextlib.contextmanager
def trace_memo(memo: Callable):
    """Within the block, every :func:`trace_model` call of this thread is answered by
    ``memo(export, model, example_inputs, example_kwargs, loss_fn, example_target, upcast_outputs,
    stamp_layers)``, where ``export`` is the real trace (same arguments): a caller that traces the
    same model many times (the test suite, for hundreds of plans) may return a copy of an earlier
    trace instead.  The memo is explicit and scoped; outside a block nothing is memoised."""
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)

# The wrapper registers the user's model under this attribute, so every parameter of
# the traced graph is named "model.<original name>".
MODEL_PREFIX = "model."


class _TrainWrapper(nn.Module):
    """Calls ``loss_fn(model(*inputs, **kwargs), target)``; holds no state of its own."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, num_inputs: int, kwargs: dict,
                 upcast_outputs: bool = False):
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn
        self._num_inputs = num_inputs
        self._kwargs = kwargs
        self._upcast = upcast_outputs

    def forward(self, *args):
        inputs = args[: self._num_inputs]
        out = self.model(*inputs, **self._kwargs)
        if self._loss_fn is None:
            return out
        if self._upcast:  # mixed precision: the loss of fp32 outputs (Megatron's fp32 cross-entropy)
            out = map_tensors(out, lambda t: t.float() if t.is_floating_point() else t)
        return self._loss_fn(out, args[self._num_inputs])


@dataclasses.dataclass
class Traced:
    """The traced training graph and what the later stages need to know about it."""

    gm: torch.fx.GraphModule
    num_inputs: int  # model inputs; the target (if any) is the next placeholder
    has_target: bool
    batch_symbol: Any  # sympy symbol of the batch dimension (None if specialised)
    seq_symbol: Any  # sympy symbol of the sequence dimension (None if specialised)
    example_inputs: tuple
    example_target: Any
    log: tuple[str, ...] = ()  # how the graph was traced (layers exported and stamped), for the program log
    device: torch.device = torch.device("cpu")  # where the model's tensors were when it was traced
    # torch.export's checks of the shapes the graph holds for (``_guards_fn``), called with the
    # example's structure: cleanup drops them from the graph, the runtime checks each step's global
    # shapes with them (:func:`autopar.runtime.stepping.batching.check_guards`).
    input_guards: Callable | None = None

    @property
    def placeholders(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]


def _dynamic_spec(t: Any, batch: Any, seq: Any) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return None
    spec = {0: batch}
    if t.dim() >= 2:
        spec[1] = seq
    return spec


def _symbol(size: Any) -> Any:
    return sym_expr(size)


def _export_failure(model: nn.Module, exc: Exception) -> AutoparError:
    cause = str(exc).strip().splitlines()
    first = cause[0] if cause else type(exc).__name__
    return AutoparError(
        f"autopar: torch.export (non-strict) could not trace {type(model).__name__}: "
        f"{type(exc).__name__}: {first}\n"
        "  expected: a model whose forward(*example_inputs, **example_kwargs) runs under "
        "torch.export with symbolic batch and sequence sizes.\n"
        "  try: pass example_kwargs that disable caches and optional outputs (for Hugging Face "
        "models: {'use_cache': False}); use an example batch and sequence of at least 2; make "
        "data-dependent Python control flow depend on configuration instead of tensor values; "
        "check that the model runs eagerly on the example inputs."
    )


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters and buffers (the CPU for a model without any).

    A model spread over several devices is refused: one rank's program runs on one device."""
    devices = {t.device for t in list(model.parameters()) + list(model.buffers())}
    if len(devices) > 1:
        raise AutoparError(
            f"autopar: the model's parameters and buffers are on several devices ({', '.join(sorted(map(str, devices)))}); "
            "expected one device (cpu, meta or cuda): autopar places each rank's shards on that rank's device "
            "itself. Build the model on one device, e.g. under `with torch.device('meta'):` for a large model.")
    return devices.pop() if devices else torch.device("cpu")


def on_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` on ``device``; example inputs only stand for shapes and dtypes, so a
    meta tensor moved to a real device becomes zeros (valid token ids and masks for a trace)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            return t
        if t.is_meta:
            return torch.zeros(t.shape, dtype=t.dtype, device=device)
        return t.to(device)
    return map_tensors(tree, move)


def default_target(example_inputs: tuple, loss_fn: Callable | None, example_target: Any) -> Any:
    """The target the loss is traced with: ``example_target``, or with a loss and none given a tensor
    shaped and typed like the first example input (next-token labels of a language model)."""
    if loss_fn is not None and example_target is None:
        return torch.zeros_like(example_inputs[0])
    return example_target


def trace_model(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
                loss_fn: Callable | None = None, example_target: Any = None, upcast_outputs: bool = False,
                stamp_layers: bool = True) -> Traced:
    """Export ``loss_fn(model(*example_inputs, **example_kwargs), example_target)`` (through the
    memo of an enclosing :func:`trace_memo`, if any).

    ``example_target`` defaults to a tensor shaped and typed like the first example input
    (next-token labels of a language model).  ``upcast_outputs``: the loss function sees
    the model's floating outputs in fp32 (mixed precision).  ``stamp_layers``: export only
    the first layers of a repeated layer list and copy the rest (:mod:`autopar.frontend.stamp`;
    the same graph, in time flat in depth); False exports every layer.  The model itself is
    not modified.
    """
    args = (model, example_inputs, example_kwargs, loss_fn, example_target, upcast_outputs, stamp_layers)
    memo = _MEMO.get()
    return memo(export_model, *args) if memo is not None else export_model(*args)


def export_model(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict | None = None,
                 loss_fn: Callable | None = None, example_target: Any = None, upcast_outputs: bool = False,
                 stamp_layers: bool = True) -> Traced:
    """:func:`trace_model` itself, never memoised (a memo's ``export``)."""
    example_inputs = tuple(example_inputs)
    example_kwargs = dict(example_kwargs or {})
    if not example_inputs or not isinstance(example_inputs[0], torch.Tensor):
        raise AutoparError(
            "autopar: example_inputs must be a non-empty tuple whose first element is a tensor "
            f"(found {type(example_inputs[0]).__name__ if example_inputs else 'an empty tuple'}); "
            "pass e.g. example_inputs=(input_ids,)."
        )
    # The example tensors go where the model is: they only stand for shapes and dtypes, and an
    # export mixing devices fails in fake-tensor propagation (a CPU embedding of CUDA ids).
    device = model_device(model)
    example_inputs = on_device(example_inputs, device)
    example_kwargs = on_device(example_kwargs, device)
    example_target = on_device(default_target(example_inputs, loss_fn, example_target), device)
    args = example_inputs + ((example_target,) if loss_fn is not None else ())
    export = _Exporter(model, args, loss_fn, len(example_inputs), example_kwargs, upcast_outputs)
    gm, notes = export.stamped() if stamp_layers else (None, [])
    if gm is None:
        gm = export.full()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shape = placeholders[0].meta["val"].shape
    batch_symbol = _symbol(shape[0])
    seq_symbol = _symbol(shape[1]) if len(shape) >= 2 else None
    return Traced(
        gm=gm,
        num_inputs=len(example_inputs),
        has_target=loss_fn is not None,
        batch_symbol=batch_symbol,
        seq_symbol=seq_symbol,
        example_inputs=example_inputs,
        example_target=example_target,
        log=tuple(notes),
        device=device,
        input_guards=export.guards,
    )


class _Exporter:
    """``torch.export`` of the training wrapper, of the whole model or of its first layers."""

    def __init__(self, model, args, loss_fn, num_inputs, kwargs, upcast):
        self._model, self._args = model, args
        self._wrap = lambda m: _TrainWrapper(m, loss_fn, num_inputs, kwargs, upcast)
        self._dynamic = (tuple(_dynamic_spec(a, Dim.AUTO, Dim.AUTO) for a in args),)
        self.guards: Callable | None = None

    def _export(self, model: nn.Module) -> torch.fx.GraphModule:
        """The exported graph; its ``_guards_fn`` (checks of the shapes it holds for) kept in ``self.guards``."""
        with warnings.catch_warnings(), custom_functions.capture() as unkept:
            warnings.simplefilter("ignore")
            ep = torch.export.export(self._wrap(model), self._args, strict=False, dynamic_shapes=self._dynamic)
        custom_functions.refuse(self._model, unkept)
        gm = ep.module()
        custom_functions.check_kept(gm)
        self.guards = getattr(gm, "_guards_fn", None)
        return gm

    def full(self) -> torch.fx.GraphModule:
        try:
            return self._export(self._model)
        except AutoparError:
            raise
        except Exception as exc:  # any export failure becomes an actionable autopar error
            raise _export_failure(self._model, exc) from exc

    def stamped(self) -> tuple[torch.fx.GraphModule | None, list[str]]:
        """Export the first layers and stamp out the rest; (None, why not) to export everything."""
        plan = stamp.plan_stamping(self._model)
        if plan is None:
            return None, []
        num_layers = len(plan.layers)
        start = time.perf_counter()
        try:
            with stamp_behaviour.InputCapture(plan) as capture:
                gm = self._export(stamp.shallow_model(self._model, plan))
            stamp_behaviour.check_behaviour(plan, capture.inputs)
            added = stamp.stamp_layers(gm, plan, MODEL_PREFIX)
        except Exception as exc:  # CannotStamp, or the shallow copy does not export: the full export decides
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            note = (f"trace: exporting all {num_layers} layers of {plan.path} (not stamped: {why})")
            log.info(note)
            return None, [note]
        num_kinds = len(set(plan.kinds))
        note = (f"trace: exported {plan.num_traced} of {num_layers} layers of {plan.path} "
                f"({num_kinds} kind{'s' if num_kinds > 1 else ''}), stamped {num_layers - plan.num_traced} "
                f"(+{added} nodes) in {time.perf_counter() - start:.1f} s")
        log.info(note)
        return gm, [note]
