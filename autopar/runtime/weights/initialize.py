"""``parallelize(..., init_weights=fn)``: a program built on the meta device initialised from scratch.

``fn(module)`` initialises one module in place (for a transformers model ``model._init_weights``).
It is applied module by module in the order ``nn.Module.apply`` visits them (children first, then
the module), each time to a stand-in of the module's subtree (:class:`StandIn`): every module a
copy, the module's own parameters and buffers fresh full tensors on the CPU, its descendants' meta
placeholders.  :class:`autopar.runtime.weights.init_tracker.WriteTracker` watches the call; when
``fn`` writes a descendant's tensor (GPT-2's ``_init_weights`` on an attention block writes
``c_proj.weight``), the call runs again from the same random state with that tensor stood in too,
so the random stream is consumed exactly as ``model.apply(fn)`` consumes it.  What the call wrote
is cut to this rank's shards and written into the program, and the full tensors are dropped.
Every rank runs the same sequence of calls from the same generator state, so after
``torch.manual_seed(s)`` the values equal ``model.apply(fn)`` on one CPU process after the same
seed, and a rank's peak host memory is about one module (and the descendants' tensors it writes).
A tensor ``fn`` leaves untouched keeps the value it had (a model on the CPU, or an earlier call's), or
stays without one and is refused before the first step. What cannot equal ``model.apply(fn)`` on a rank
that holds shards (a read of a tensor before the call wrote all of it, a write to a tensor the program
does not hold, or one reached around the module ``fn`` was given) is refused with an ``autopar:`` error;
the user's model is never written.

The same walk gives a meta-built transformers model its non-persistent buffers (rotary
frequencies), which no checkpoint holds, from ``model._init_weights`` (:func:`initialize_buffers`).

Neighbours: :mod:`autopar.runtime.weights.init_tracker` (what a call reads and writes),
:mod:`autopar.runtime.weights.pretrained` (weights from a checkpoint),
:class:`autopar.runtime.weights.parameters.RankParameters` (``write_local``, the names of the program's tensors).
"""
from __future__ import annotations

import copy
import sys
from itertools import chain
from typing import Callable, Iterator

import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.runtime.weights.init_tracker import Rerun, Tracked, WriteTracker, refusal, storage_key

__all__ = ["StandIn", "Walk", "initialize", "initialize_buffers", "check_initialized"]

_TABLES = ("_parameters", "_buffers")


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    """The modules in the order ``module.apply(fn)`` calls ``fn`` on them."""
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _own(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in chain(module._parameters.values(), module._buffers.values()) if t is not None]


def _like(original: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the kind of tensor ``original`` is (a parameter or not), with its Python attributes
    (``fn`` may read them: transformers' ``_is_hf_initialized`` makes its init functions skip one)."""
    if isinstance(original, nn.Parameter):
        value = nn.Parameter(value, requires_grad=original.requires_grad)
    value.__dict__.update(original.__dict__)
    return value


def _fresh(original: torch.Tensor, known: bool) -> torch.Tensor:
    """A CPU stand-in: a copy of ``original`` where its value is ``known`` (the user's own), else NaN
    (floating) or zero, pending a whole write."""
    if known:
        return _like(original, original.detach().to("cpu", copy=True))
    value = torch.empty(original.shape, dtype=original.dtype, device="cpu")
    return _like(original, value.fill_(float("nan")) if value.is_floating_point() else value.zero_())


class Walk:
    """What the walk knows across calls: names, the user's tensors by storage, which an earlier call wrote."""

    def __init__(self, params, model: nn.Module, only: set[str] | None):
        self.params, self.only = params, only
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        self.names = {id(t): name for name, t in named}
        self.originals = {id(t): t for _, t in named}
        self.written: set[int] = set()
        self.modules = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        # The user's tensors (name, whether its value there is the one model.apply(fn) would see now).
        self.model = {storage_key(t): (self.names[i], not t.is_meta) for i, t in self.originals.items()}
        self.attributes = {storage_key(v): f"{name}.{attr}".lstrip(".") for name, m in model.named_modules()
                           for attr, v in vars(m).items() if isinstance(v, torch.Tensor)}
        self.model.pop(None, None)  # sparse tensors: no storage to watch
        self.attributes.pop(None, None)

    def known(self, oid: int) -> bool:
        """Whether the user's value of the tensor is the one ``model.apply(fn)`` would have now."""
        return not self.originals[oid].is_meta and oid not in self.written

    def wrote(self, oid: int) -> None:
        self.written.add(oid)
        original = self.originals[oid]
        self.model[storage_key(original)] = (self.names[oid], False)

    def where(self, module: nn.Module) -> str:
        name = self.modules.get(id(module), "")
        return f"'{name}' ({type(module).__name__})" if name else f"the model ({type(module).__name__})"

    def reaches(self, module: nn.Module) -> bool:
        """Whether ``module``'s subtree holds a tensor the walk writes (all, without ``only``)."""
        return self.only is None or any(self.params.graph_name(self.names[id(t)]) in self.only
                                        for t in chain(module.parameters(), module.buffers()))


class StandIn:
    """A copy of ``module``'s subtree for one call of ``fn``: every module a shallow copy (``fn`` may set
    attributes on them), the module's own tensors and those in ``extra`` fresh CPU tensors
    (:func:`_fresh`), every other descendant's a meta placeholder.  Neither the user's modules nor
    their tensors are reachable from ``root``, so ``fn`` cannot write them through it."""

    def __init__(self, module: nn.Module, walk: Walk, extra: set[int]):
        self.walk, self.module = walk, module
        self.replace = {id(t) for t in _own(module)} | extra
        self.tensors: dict[int, torch.Tensor] = {}  # id(original) -> what stands for it
        self.keys: dict[int, object] = {}  # id(original) -> the storage key it had when placed
        self.placeholders: dict[object, int] = {}  # storage key -> id(original)
        self.tracked = Tracked(model=walk.model, attributes=walk.attributes)
        self.slots: list[tuple[nn.Module, str, str, int]] = []  # (copy, table, key, id(original))
        self.copies: dict[int, nn.Module] = {}  # id(user's module) -> its copy
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        self.root = self._copy(module)

    def _copy(self, module: nn.Module) -> nn.Module:
        if id(module) in self.copies:  # a module the subtree holds twice: one copy
            return self.copies[id(module)]
        clone = self.copies[id(module)] = copy.copy(module)
        self.pairs.append((module, clone))
        for table in _TABLES:
            placed = {key: None if t is None else self._tensor(t) for key, t in getattr(module, table).items()}
            clone.__dict__[table] = placed
            self.slots += [(clone, table, key, id(t)) for key, t in getattr(module, table).items() if t is not None]
        clone.__dict__["_modules"] = {k: None if c is None else self._copy(c) for k, c in module._modules.items()}
        return clone

    def _tensor(self, original: torch.Tensor) -> torch.Tensor:
        oid = id(original)
        if oid not in self.tensors:  # tied tensors: one stand-in
            name = self.walk.names[oid]
            if oid in self.replace:
                value = self.tensors[oid] = _fresh(original, self.walk.known(oid))
                self.tracked.stand_ins[storage_key(value)] = name
                if not self.walk.known(oid):
                    self.tracked.pending.add(storage_key(value))
            else:
                value = self.tensors[oid] = _like(original, torch.empty_like(original, device="meta"))
                self.placeholders[storage_key(value)] = oid
                self.tracked.placeholders[storage_key(value)] = name
            self.keys[oid] = storage_key(value)
        return self.tensors[oid]

    def assigned(self) -> dict[int, torch.Tensor]:
        """The tensors ``fn`` assigned anew (``module.w = Parameter(...)``, ``p.data = x``: no op shows
        those): id(original) -> the new value; refused where ``fn`` changed which tensors a module has."""
        if self._restructured():
            raise refusal(self.walk.where(self.module), "added, removed or replaced a parameter, buffer or "
                          "submodule", "fn to write the module's tensors, not to change which it has",
                          "build the structure in the module's __init__ and only write tensors in fn")
        out = {}
        for clone, table, key, oid in self.slots:
            now = clone.__dict__[table][key]
            if now is not self.tensors[oid] or storage_key(now) != self.keys[oid]:
                out[oid] = now
        return out

    def _restructured(self) -> bool:
        for original, clone in self.pairs:
            for table in _TABLES:
                mine, theirs = clone.__dict__[table], getattr(original, table)
                if set(mine) != set(theirs) or any((mine[k] is None) != (t is None) for k, t in theirs.items()):
                    return True
            placed = {k: None if c is None else self.copies[id(c)] for k, c in original._modules.items()}
            if set(clone._modules) != set(placed) or any(clone._modules[k] is not c for k, c in placed.items()):
                return True
        return False

    def results(self, tracker: WriteTracker, assigned: dict) -> Iterator[tuple[int, torch.Tensor]]:
        """(id(original), value) of each stood-in tensor the call wrote (``assigned``: :meth:`assigned`);
        refused where its value depends on one this rank lacks (:meth:`WriteTracker.check`)."""
        for oid in self.replace:
            value = assigned.get(oid, self.tensors.get(oid))
            if value is not None and (oid in assigned or self.keys[oid] in tracker.written):
                tracker.check(storage_key(value), self.walk.names[oid])
                yield oid, value


def _call(walk: Walk, module: nn.Module, fn: Callable[[nn.Module], None]) -> Iterator[tuple[int, torch.Tensor]]:
    """One call of ``fn`` on ``module``, run again from the same random state with every descendant's
    tensor it touched stood in, until it touches only stand-ins (each run stands in at least one more);
    -> (id(original), value) of what the last run wrote."""
    rng = torch.get_rng_state()
    extra: set[int] = set()
    while True:
        stand_in = StandIn(module, walk, extra)
        tracker = WriteTracker(walk.where(module), stand_in.tracked)
        try:
            with tracker:
                fn(stand_in.root)
        except Rerun:
            pass
        except Exception:
            if tracker.failure is None and not tracker.needed:
                raise  # fn's own error (one on a skipped placeholder write is run again instead)
        if tracker.failure is not None:
            raise tracker.failure  # raised inside fn, which may have caught it
        assigned = stand_in.assigned()
        needed = {stand_in.placeholders[key] for key in tracker.needed}
        needed |= {oid for oid in assigned if oid not in stand_in.replace}
        if not needed:
            return stand_in.results(tracker, assigned)
        extra |= needed
        torch.set_rng_state(rng)  # the next run draws what this one drew


def initialize(params, model: nn.Module, fn: Callable[[nn.Module], None], *, only: set[str] | None = None) -> None:
    """Apply ``fn`` to ``model``'s modules as ``model.apply(fn)`` would and write the results into
    ``params`` (see the module docstring); ``only``: graph names to write (the rest is left alone, and
    modules holding none of them are not visited)."""
    walk = Walk(params, model, only)
    for module in _apply_order(model):
        if not walk.reaches(module):
            continue
        for oid, value in _call(walk, module, fn):
            walk.wrote(oid)
            name = params.graph_name(walk.names[oid])
            if name is None or (only is not None and name not in only):
                continue
            if params.holds(name):
                params.write_local(name, params.local(value.detach(), name))


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
