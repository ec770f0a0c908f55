"""A test-session cache of traces: each distinct model is exported once per process.

Not a test module.  ``torch.export`` of even a two-layer model costs seconds on two cores
and is almost all of a tiny plan's compile time, yet the suite compiles the same handful of
models for hundreds of plans, on every rank.  The trace does not depend on the plan (the
plan enters only in the passes after it), so the suite runs inside :func:`session` -- the pytest
process (tests/conftest.py's session fixture) and each pool worker (tests/support/harness.py)
-- which enters :func:`autopar.frontend.trace.trace_memo` with :func:`memo`: every
``trace_model`` call, wherever it is imported from, asks the memo; nothing is patched.

Why a hit is the trace the real call would return:
  * the key is the model's structure as the export sees it -- every module's class, its
    training flag and every non-tensor attribute (an HF config by its ``to_dict()``), the
    names, shapes, dtypes and requires_grad of parameters and buffers, the *values* of
    tensor attributes that are neither (the export bakes those in as constants) -- and the
    call's example inputs and target (shape, dtype), example kwargs (tensors by value: the
    wrapper captures them as constants), loss function, flags and default dtype;
  * parameter and buffer values are not in the key because the export treats them as
    inputs; the stored graph holds a meta stand-in for every tensor the first model lent it
    (no model's memory stays alive), and the graph a hit returns is a deep copy in which each
    stand-in is replaced by the same-named tensor of this model (``copy.deepcopy``'s memo),
    so the program aliases this model's tensors exactly as a fresh export would;
  * a failing export is not cached, and a model with anything the key cannot see (a
    tensor attribute the graph holds that is not the first model's) is traced afresh.
The cache is a test-suite device, not product behaviour: the product traces on every
call.  ``AUTOPAR_TEST_TRACE_CACHE=0`` turns it off (:func:`session` then memoises nothing);
tests/unit/test_trace_cache.py checks that a hit is the same program bound to the new model.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import os
import warnings

import torch

from autopar.frontend.trace import default_target, trace_memo
from tests.support import trace_disk

__all__ = ["session", "memo", "model_key", "clear", "STATS"]

_CACHE: dict = {}
STATS = {"hits": 0, "misses": 0, "loaded": 0}
_MAX_ENTRIES = 64
_SKIP = frozenset({"_parameters", "_buffers", "_modules", "training"})


def _freeze(value, depth: int = 0):
    """A hashable stand-in for ``value`` that is equal exactly when the export would see the same."""
    if depth > 6:
        return ("deep", repr(value))
    if value is None or isinstance(value, (bool, int, float, str, bytes, complex)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return (type(value).__name__, str(value))
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":  # no values to see: the export sees shapes and dtypes only
            return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad, "meta")
        data = value.detach().cpu().contiguous()
        digest = hashlib.sha1(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad, digest)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_freeze(v, depth + 1)) for v in value)))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _freeze(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, torch.nn.Module):  # held as a plain attribute (transformers >= 5.25:
        return ("module", _module_key(value, depth + 1))  # each attention's own kernel wrappers)
    if hasattr(value, "to_dict") and callable(value.to_dict):  # a transformers PretrainedConfig
        # to_dict() leaves out the attention implementation, which changes the graph (eager, sdpa)
        return (type(value), _freeze(value.to_dict(), depth + 1), getattr(value, "_attn_implementation", None))
    try:
        hash(value)
    except TypeError:
        return ("repr", type(value), repr(value))
    return value  # functions, classes, enums: equal only to themselves


def model_key(model: torch.nn.Module) -> tuple:
    """Everything about ``model`` the export can see except parameter and buffer values."""
    return _module_key(model, 0)


def _module_key(model: torch.nn.Module, depth: int) -> tuple:
    parts = []
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = tuple((k, _freeze(v, depth)) for k, v in sorted(module.__dict__.items()) if k not in _SKIP)
        params = tuple((k, tuple(p.shape), str(p.dtype), str(p.device), p.requires_grad)
                       for k, p in module._parameters.items() if p is not None)
        buffers = tuple((k, tuple(b.shape), str(b.dtype), str(b.device))
                        for k, b in module._buffers.items() if b is not None)
        parts.append((name, type(module), module.training, attrs, params, buffers))
    return tuple(parts)


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _graph_tensors(gm: torch.nn.Module) -> list[torch.Tensor]:
    return list(_tensor_slots(gm).values())


def _lent(gm, model) -> dict[int, str] | None:
    """id of each graph tensor the model lent it -> its model name; None if the graph holds
    a tensor the model did not lend (a copy: its values are not in the key)."""
    names = {id(t): k for k, t in _model_tensors(model).items()}
    lent = {}
    for t in _graph_tensors(gm):
        if id(t) not in names:
            return None
        lent[id(t)] = names[id(t)]
    return lent


def _call_key(model, example_inputs, example_kwargs, loss_fn, example_target, upcast_outputs, stamp_layers):
    def meta(t):
        return ("tensor", tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else _freeze(t)
    return (model_key(model), tuple(meta(t) for t in example_inputs), _freeze(dict(example_kwargs or {})),
            loss_fn, meta(example_target), upcast_outputs, stamp_layers, torch.get_default_dtype())


def memo(export, model, example_inputs, example_kwargs=None, loss_fn=None, example_target=None,
         upcast_outputs=False, stamp_layers=True):
    """What ``export(model, ...)`` returns (the trace), from the cache when the key matches: this
    process's, else the session's files (tests/support/trace_disk.py), else a fresh export."""
    args = (model, example_inputs, example_kwargs, loss_fn, example_target, upcast_outputs, stamp_layers)
    try:
        key = _call_key(model, tuple(example_inputs), example_kwargs, loss_fn, example_target,
                        upcast_outputs, stamp_layers)
        hash(key)
    except Exception:  # something unhashable or unreadable: trace as usual
        key = None
    if key is not None and key in _CACHE:
        return _hit(_CACHE[key], model, example_inputs, loss_fn, example_target)
    name = trace_disk.digest(key) if key is not None and trace_disk.folder() else None
    if name is None:
        return _miss(key, export, args)
    with trace_disk.exclusive(name):
        stored = trace_disk.read(name)
        if stored is None:
            traced = _miss(key, export, args)
            if key in _CACHE:
                pristine, lent, meta = _CACHE[key]
                slots = _tensor_slots(pristine)
                trace_disk.write(name, pristine, {slot: lent[id(t)] for slot, t in slots.items()}, meta)
            return traced
    gm, names, meta = stored
    STATS["loaded"] += 1
    _store(key, (gm, {id(t): names[slot] for slot, t in _tensor_slots(gm).items()}, meta))
    return _hit(_CACHE[key], model, example_inputs, loss_fn, example_target)


def _hit(entry, model, example_inputs, loss_fn, example_target):
    pristine, lent, traced = entry
    current = _model_tensors(model)
    gm = _deepcopy(pristine, {tid: current[name] for tid, name in lent.items()})
    STATS["hits"] += 1
    inputs = tuple(example_inputs)
    target = default_target(inputs, loss_fn, example_target)
    return dataclasses.replace(traced, gm=gm, example_inputs=inputs, example_target=target)


def _miss(key, export, args):
    """A fresh export, kept (its lent tensors as meta stand-ins) when the key sees everything."""
    STATS["misses"] += 1
    traced = export(*args)
    model = args[0]
    lent = _lent(traced.gm, model) if key is not None else None
    if lent is not None:
        own = {id(t): t for t in _graph_tensors(traced.gm)}
        stand_ins = {tid: _stand_in(own[tid]) for tid in lent}
        pristine = _deepcopy(traced.gm, dict(stand_ins))  # the graph copied, the lent tensors on meta
        _store(key, (pristine, {id(stand_ins[tid]): name for tid, name in lent.items()},
                     dataclasses.replace(traced, gm=None)))
    return traced


def _store(key, entry) -> None:
    if len(_CACHE) >= _MAX_ENTRIES:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = entry


def _tensor_slots(gm) -> dict[tuple[str, str], torch.Tensor]:
    """Where each tensor of ``gm`` sits (what :func:`_graph_tensors` lists, by name)."""
    slots = {("param", k): t for k, t in gm.named_parameters(remove_duplicate=False)}
    slots.update({("buffer", k): t for k, t in gm.named_buffers(remove_duplicate=False)})
    slots.update({("attr", k): v for k, v in gm.__dict__.items() if isinstance(v, torch.Tensor)})
    return slots


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor in the place of a tensor the model lent the graph: the stored graph keeps no
    model's values or memory alive (the peak-memory jobs meter the allocator with the cache on), and
    a hit replaces it by the new model's tensor of the same name."""
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_(t.requires_grad)


def _deepcopy(gm, memo: dict):
    with warnings.catch_warnings():  # torch's pytree spec pickling warns about its own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, memo)


def clear() -> None:
    _CACHE.clear()


def session():
    """The context the suite runs in: ``trace_model`` memoised by :func:`memo` (no-op with
    ``AUTOPAR_TEST_TRACE_CACHE=0``)."""
    if os.environ.get("AUTOPAR_TEST_TRACE_CACHE", "1") == "0":
        return contextlib.nullcontext()
    return trace_memo(memo)
