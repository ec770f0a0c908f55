"""``parallelize(..., init_weights=fn)``: a program built on the meta device initialised from scratch.

``fn(module)`` initialises one module in place (for a transformers model ``model._init_weights``).
It is applied module by module in the order ``nn.Module.apply`` visits them (children first, then
the module), each time to a stand-in of the module whose own parameters and buffers are fresh
full tensors on the CPU (its children stay as they are); what ``fn`` wrote is cut to this rank's
shards and written into the program, and the full tensors are dropped.  Every rank runs the same
sequence of ``fn`` calls from the same generator state, so after ``torch.manual_seed(s)`` the
values equal ``model.apply(fn)`` on one device after the same seed, and a rank's peak host
memory is about one module.  A tensor ``fn`` leaves untouched keeps the value it had (a model
on the CPU), or stays without one and is refused before the first step.

The same walk gives a meta-built transformers model its non-persistent buffers (rotary
frequencies), which no checkpoint holds, from ``model._init_weights`` (:func:`initialize_buffers`).

Neighbours: :mod:`autopar.runtime.weights.pretrained` (weights from a checkpoint),
:class:`autopar.runtime.weights.parameters.RankParameters` (``write_local``, the names of the program's tensors).
"""
from __future__ import annotations

import copy
import sys
from typing import Callable, Iterator

import torch
import torch.nn as nn

from autopar.errors import AutoparError

__all__ = ["initialize", "initialize_buffers"]


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """The modules in the order ``module.apply(fn)`` calls ``fn`` on them."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _stand_in(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are fresh CPU tensors: a meta tensor's stand-in
    is NaN (floating) or zero, so what ``fn`` leaves untouched is seen; a real one's is its copy."""
    def fresh(t: torch.Tensor) -> torch.Tensor:
        if not t.is_meta:
            return t.detach().to("cpu", copy=True)
        value = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return value.fill_(float("nan")) if value.is_floating_point() else value.zero_()

    clone = copy.copy(module)
    clone._parameters = {k: None if p is None else nn.Parameter(fresh(p), requires_grad=p.requires_grad)
                         for k, p in module._parameters.items()}
    clone._buffers = {k: None if b is None else fresh(b) for k, b in module._buffers.items()}
    clone._modules = dict(module._modules)
    return clone


def _untouched(original: torch.Tensor, value: torch.Tensor) -> bool:
    return original.is_meta and value.is_floating_point() and value.numel() > 0 and bool(value.isnan().all())


def initialize(params, model: nn.Module, fn: Callable[[nn.Module], None], *, only: set[str] | None = None) -> None:
    """Apply ``fn`` to ``model``'s modules as ``model.apply(fn)`` would and write the results into
    ``params`` (see the module docstring); ``only``: graph names to write (the rest is left alone)."""
    names = {id(t): name for name, t in list(model.named_parameters(remove_duplicate=False))
             + list(model.named_buffers(remove_duplicate=False))}
    for module in _apply_order(model):
        own = list(module._parameters.items()) + list(module._buffers.items())
        stand_in = _stand_in(module)
        fn(stand_in)
        for key, original in own:
            if original is None:
                continue
            value = stand_in._parameters.get(key) if key in module._parameters else stand_in._buffers.get(key)
            name = params.graph_name(names[id(original)])
            if name is None or (only is not None and name not in only) or _untouched(original, value):
                continue
            if params.holds(name):
                params.write_local(name, params.local(value.detach(), name))
        del stand_in


def initialize_buffers(params, model: nn.Module) -> None:
    """A meta-built transformers model's non-persistent buffers from ``model._init_weights`` (the
    generator state is restored afterwards: loading weights draws no random numbers)."""
    transformers = sys.modules.get("transformers")  # a transformers model has imported it already
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return  # another model's buffers come from init_weights
    init = model._init_weights
    persistent = set(model.state_dict())
    wanted = {params.graph_name(n) for n, b in model.named_buffers(remove_duplicate=False)
              if b.is_meta and n not in persistent} - {None}
    if not wanted or not callable(init):
        return
    with torch.random.fork_rng(devices=[]):
        initialize(params, model, init, only=wanted)


def check_initialized(params) -> None:
    """Refuse a step on a program some of whose tensors never got values."""
    missing = params.unset_names()
    if not missing:
        return
    raise AutoparError(
        f"autopar: the model was built on the meta device and {len(missing)} of its tensors have no values yet "
        f"({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}); expected weights from one of: "
        "pm.load_pretrained(hf_model_dir) (a Hugging Face safetensors checkpoint), "
        "autopar.parallelize(..., init_weights=model._init_weights) (training from scratch), or "
        "pm.load(checkpoint) / pm.load_state_dict(state_dict).")
