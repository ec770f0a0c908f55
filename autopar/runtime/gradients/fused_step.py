"""The optimizer step over flat tensors: which optimizer, flat or per tensor, fused or not.

A per-tensor optimizer step launches a few kernels per parameter (``foreach`` groups them,
but still walks lists of hundreds of tensors); on a GPU AdamW took a quarter of the step
(issue 30).  Where autopar owns the tensors the optimizer steps, it makes them flat:

* without ZeRO (:class:`autopar.runtime.gradients.grad_sync.GradSync`), the fp32 master weights under
  mixed precision (:class:`autopar.runtime.stepping.precision.MainGrads`), or in the model's own dtype
  the parameters themselves, and their gradients, live in one flat buffer per (param group,
  dtype, device) (:class:`FlatParams`); each per-parameter tensor and gradient is a view of
  it, so accumulation, bucketed all-reduce (a bucket's buffer is a slice of the flat
  gradient where its parameters are contiguous), clipping and state dicts see the same
  tensors as before;
* under ZeRO the shards are flat already (:mod:`autopar.runtime.gradients.zero_layout`).

Flat only where the gradients are kept all step anyway: with data-parallel gradient buckets
(``dp*cp >= 2``; the buckets are views of persistent buffers, DDP's ``gradient_as_bucket_view``),
which is what the cost model's peak assumes (cost/memory.py ``peak_memory``: ``keep``).  Elsewhere
(tp or pp alone, one rank) backward makes the gradients and the step frees them, and a persistent
flat gradient would add a whole gradient copy to the forward's peak: the optimizer then stays
per tensor, with ``fused=True`` (torch's fused kernels take lists of tensors:
:func:`fused_version`).

The optimizer is then rebuilt over the flat tensors with the user's hyper-parameters, and
``fused=True`` where torch has a fused kernel for the class on that device
(:func:`flat_optimizer`).  Only for classes whose update is element-wise (:data:`ELEMENTWISE`,
exact classes, not subclasses): their step on a concatenation equals the step on each piece.
Any other optimizer (a user's class, one with per-tensor norms such as LAMB or Adafactor)
keeps the per-tensor step.  ``parallelize(..., fused_optimizer=False)`` turns all of this off.

Differences from the per-tensor step, documented: every flat parameter is stepped, with a zero
gradient where backward produced none (as the bucketed gradient views already did).  The
state a checkpoint sees is unchanged: :meth:`FlatParams.state_by_name` slices the flat state
into per-parameter views under the graph names, and :meth:`FlatParams.load_state` is its inverse.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn as nn

__all__ = ["ELEMENTWISE", "flat_optimizer", "flat_factory", "fused_version", "place_state", "FlatParams"]

# Optimizer class -> whether torch has a fused kernel for it.  Element-wise updates only.
ELEMENTWISE: dict[type, bool] = {
    torch.optim.Adam: True,
    torch.optim.AdamW: True,
    torch.optim.SGD: True,
    torch.optim.Adagrad: True,
    torch.optim.RMSprop: False,
}


def _fused_devices() -> set[str]:
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # an older torch: CUDA only
        return {"cuda"}


def _use_fused(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> bool | None:
    """True/False: the value of ``fused`` for the flat optimizer; None: keep the user's flags."""
    if not ELEMENTWISE.get(type(optimizer), False):
        return None
    for group in optimizer.param_groups:
        if group.get("fused") is not None or group.get("foreach") or group.get("differentiable"):
            return None  # the user chose; differentiable has no fused kernel
    devices = _fused_devices()
    return all(t.device.type in devices and t.is_floating_point() for t in tensors)


def flat_optimizer(probe: torch.optim.Optimizer, groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """``probe``'s class and hyper-parameters (defaults and each param group's own) over
    ``groups`` (one list of flat tensors per param group of ``probe``), fused where supported."""
    fused = _use_fused(probe, [t for g in groups for t in g])
    # The constructor's own arguments (AdamW's defaults also hold a key it does not take); the
    # groups carry every value, including any the factory set per group.
    accepted = inspect.signature(type(probe)).parameters
    defaults = {k: v for k, v in probe.defaults.items() if k in accepted}
    specs = []
    for group, tensors in zip(probe.param_groups, groups):
        spec = {k: v for k, v in group.items() if k != "params"}
        spec["params"] = tensors
        if fused is not None:
            spec["fused"], spec["foreach"] = fused, None
        specs.append(spec)
    if fused is not None:
        defaults["fused"], defaults["foreach"] = fused, None
    try:
        return type(probe)(specs, **defaults)
    except (TypeError, RuntimeError, ValueError):
        if not fused:
            raise
        for spec in specs:
            spec["fused"] = None
        defaults["fused"] = None
        return type(probe)(specs, **defaults)


def flat_factory(make_optimizer: Callable, enabled: bool = True) -> Callable:
    """``make_optimizer`` for tensors that are flat already (ZeRO's shards): the same optimizer,
    with ``fused=True`` where its class and the tensors' device allow (``enabled``)."""
    if not enabled:
        return make_optimizer

    def make(params):
        return fused_version(make_optimizer(list(params)))
    return make


def fused_version(probe: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``probe`` rebuilt over its own tensors with ``fused=True`` where its class (:data:`ELEMENTWISE`)
    and their device allow; else ``probe`` itself."""
    tensors = [p for g in probe.param_groups for p in g["params"]]
    if _use_fused(probe, tensors) is not True or any(t.device.type == "meta" for t in tensors):
        return probe
    return flat_optimizer(probe, [list(g["params"]) for g in probe.param_groups])


def place_state(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict) -> dict:
    """``state`` (one parameter's, as loaded) where ``optimizer`` steps ``param``: tensors on its
    device in its dtype; the scalar ``step`` float32, on the device under ``fused``/``capturable``."""
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), {})
    on_device = bool(group.get("fused") or group.get("capturable"))
    out = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            out[key] = value
        elif value.dim():
            out[key] = value.to(device=param.device, dtype=param.dtype).clone()
        elif on_device:
            out[key] = value.to(device=param.device, dtype=torch.float32).clone()
        else:
            out[key] = value.clone()
    return out


class FlatParams:
    """Flat buffers of the tensors an optimizer steps, of which those tensors are views.

    ``named``: name -> a leaf tensor (an ``nn.Parameter``: the module's own, or a master);
    ``groups``: the names of each param group, in the order to lay them out (a bucket's
    parameters next to each other).  One flat value and one flat gradient per (group, dtype,
    device); every tensor's ``.data`` and ``.grad`` become views of them."""

    def __init__(self, named: dict[str, torch.Tensor], groups: list[list[str]]):
        self.named = named
        self.flats: list[nn.Parameter] = []
        self.grads: list[torch.Tensor] = []
        self.group_of: list[int] = []  # flat index -> param group index
        self.slots: dict[str, tuple[int, int, int]] = {}  # name -> (flat index, offset, numel)
        self._grad_views: dict[str, torch.Tensor] = {}  # name -> its gradient's view of the flat one
        for gi, names in enumerate(groups):
            keys: dict[tuple, list[str]] = {}
            for name in names:
                t = named[name]
                keys.setdefault((t.dtype, t.device), []).append(name)
            for (dtype, device), members in keys.items():
                self._build(gi, dtype, device, members)

    def _build(self, gi: int, dtype, device, names: list[str]) -> None:
        index, total = len(self.flats), sum(self.named[n].numel() for n in names)
        flat = torch.empty(total, dtype=dtype, device=device)
        grad = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for name in names:
                t, n = self.named[name], self.named[name].numel()
                flat[offset:offset + n].copy_(t.detach().reshape(-1))
                t.data = flat[offset:offset + n].view_as(t)
                t.grad = self._grad_views[name] = grad[offset:offset + n].view_as(t)
                self.slots[name] = (index, offset, n)
                offset += n
        param = nn.Parameter(flat, requires_grad=True)  # its .grad is set for the step only
        self.flats.append(param)
        self.grads.append(grad)
        self.group_of.append(gi)

    def view(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        """``name``'s piece of ``flat`` (a flat tensor laid out as the values), shaped as it."""
        _, offset, n = self.slots[name]
        return flat[offset:offset + n].view_as(self.named[name])

    def grad_view(self, name: str) -> torch.Tensor:
        """``name``'s gradient: its view of the flat gradient (the same object every time)."""
        return self._grad_views[name]

    def grad_span(self, names: list[str]) -> torch.Tensor | None:
        """The slice of the flat gradient holding ``names``'s gradients, in this order, or None
        where they are not next to each other in one flat buffer."""
        slots = [self.slots.get(n) for n in names]
        if not slots or any(s is None for s in slots) or len({s[0] for s in slots}) > 1:
            return None
        for a, b in zip(slots, slots[1:]):
            if a[1] + a[2] != b[1]:
                return None
        return self.grads[slots[0][0]][slots[0][1]:slots[-1][1] + slots[-1][2]]

    def collect_grads(self) -> None:
        """Each gradient into the flat gradient (where it is not a view of it already: a bucket
        reduced out of place, one set to None or assigned), before the step."""
        with torch.no_grad():
            for name, t in self.named.items():
                view, g = self._grad_views[name], t.grad
                if g is view:
                    continue
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                    view.copy_(g)
                t.grad = view
        for flat, grad in zip(self.flats, self.grads):
            flat.grad = grad

    def zero_grads(self) -> None:
        """After the step: the flat gradients zeroed, every gradient a view of them again (the
        flat tensors' own ``.grad`` is None between steps, as after ``zero_grad``)."""
        for flat, grad in zip(self.flats, self.grads):
            grad.zero_()
            flat.grad = None
        for name, t in self.named.items():
            if t.grad is not self._grad_views[name]:
                t.grad = self._grad_views[name]

    def state_by_name(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
        """Name -> {state key: the name's piece of the flat state (a view), or the shared scalar}."""
        out: dict[str, dict] = {}
        for name, (index, _, _) in self.slots.items():
            for key, value in optimizer.state.get(self.flats[index], {}).items():
                if torch.is_tensor(value) and value.dim() and value.numel() == self.flats[index].numel():
                    value = self.view(name, value)
                out.setdefault(name, {})[key] = value
        return out

    def load_state(self, optimizer: torch.optim.Optimizer, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`state_by_name`: each flat's state assembled from its names' entries
        (a name without entries keeps its current state, or zeros)."""
        for index, flat in enumerate(self.flats):
            names = [n for n, s in self.slots.items() if s[0] == index]
            found = [entries[n] for n in names if entries.get(n)]
            if not found:
                continue
            current = optimizer.state.get(flat, {})
            new = {}
            for key in set.intersection(*(set(e) for e in found)):
                first = found[0][key]
                if not torch.is_tensor(first) or not first.dim():
                    new[key] = first
                    continue
                old = current.get(key)
                keep = torch.is_tensor(old) and old.shape == flat.shape
                buf = old.detach().clone() if keep else torch.zeros_like(flat)
                with torch.no_grad():
                    for name in names:
                        if key in entries.get(name, {}):
                            self.view(name, buf).copy_(entries[name][key])
                new[key] = buf
            optimizer.state[flat] = place_state(optimizer, flat, new)
