"""What one call of ``init_weights`` reads and writes: a dispatch mode over ``fn(stand_in)``.

:mod:`autopar.runtime.weights.initialize` runs ``fn`` module by module, as ``model.apply(fn)`` does,
on a stand-in of the module's subtree (``initialize.StandIn``).  This
``TorchDispatchMode`` sees every aten op the call runs and sorts the tensors it touches by storage
(so ``p.data``, ``p[0]`` and ``p.view(...)`` count as ``p``):

* a **stand-in** (a fresh CPU tensor the call may write) is free, unless it is *pending*: this rank
  lacks its value (the model was built on meta, or an earlier call wrote it and this rank holds
  only its shard).  What is computed from a pending value is followed as NaN would be, until a
  whole overwrite from known values (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ``copy_``,
  ``out=`` ... on all of it) ends it; such a value written to a stand-in (a part written and the
  rest left, ``mul_`` before a whole write, a parent's tensor computed from it) or turned into a
  Python number is refused;
* a **placeholder** (a meta tensor standing for a descendant's parameter or buffer that this call was
  not expected to touch, e.g. ``c_proj.weight`` when GPT-2's ``_init_weights`` runs on the attention
  block): a write to it is set aside and a read stops the call; either way it is recorded (``needed``),
  and the caller runs the call again from the same random state with it stood in, so the random stream
  is consumed as ``model.apply(fn)`` consumes it on one process;
* a tensor of the **user's model** itself (reached some other way than through the module ``fn`` was
  given, e.g. through ``self`` of a bound ``_init_weights``) or a **tensor attribute** that is no
  parameter or buffer: its write cannot be placed in the program and is refused before it runs, so
  the user's model is never written.

A refusal is raised where it happens and kept in ``failure`` (``fn`` may catch exceptions).

Neighbours: :mod:`autopar.runtime.weights.initialize` (the walk, the stand-ins, what is written where).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.errors import AutoparError

__all__ = ["Rerun", "Tracked", "WriteTracker", "refusal", "storage_key"]

aten = torch.ops.aten

# In-place ops whose result does not depend on the value they overwrite (the first operand).
_OVERWRITES = frozenset({aten.normal_, aten.uniform_, aten.zero_, aten.fill_, aten.copy_, aten.random_,
                         aten.bernoulli_, aten.exponential_, aten.geometric_, aten.log_normal_, aten.cauchy_})
# Ops that take a tensor for its shape, dtype and device only.
_NO_DATA = frozenset({aten.new_empty, aten.new_empty_strided, aten.new_zeros, aten.new_ones, aten.new_full,
                      aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like,
                      aten.randn_like, aten.randint_like, aten.sym_size, aten.sym_stride, aten.sym_numel,
                      aten.sym_storage_offset})

_FIX = ("initialise each tensor in the call of the module that owns it, writing it whole; or build the "
        "model on the CPU, run model.apply(fn) there and pass it to parallelize without init_weights")


def refusal(where: str, found: str, expected: str, fix: str = _FIX) -> AutoparError:
    """The error for a call of ``fn`` whose result autopar cannot reproduce on this rank."""
    return AutoparError(f"autopar: init_weights on {where} {found}; expected {expected}. Fix: {fix}.")


def storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    """What views of one tensor share (None: a tensor without strided storage)."""
    if t.layout != torch.strided:
        return None
    return StorageWeakRef(t.untyped_storage())


class Rerun(Exception):
    """Raised inside ``fn`` to stop a call that has to be run again with more stand-ins."""


@dataclass
class Tracked:
    """The tensors one call is watched over, by storage key: ``stand_ins`` -> the original's name
    (``pending``: those whose value this rank lacks), ``placeholders`` -> name, ``model`` -> (name,
    whether its value is the one ``model.apply(fn)`` would see now): the user's own tensors,
    ``attributes`` -> the path of a plain tensor attribute."""
    stand_ins: dict = field(default_factory=dict)
    pending: set = field(default_factory=set)
    placeholders: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    attributes: dict = field(default_factory=dict)


def _operands(func, args, kwargs) -> tuple[list, list, bool]:
    """(written, read, overwrite): the tensors ``func`` writes (``Tensor(a!)`` in its schema), the
    tensors it only reads, and whether it overwrites what it writes regardless of its value."""
    written, out = [], False
    for index, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or index >= len(args) else args[index]
        written += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
        out = out or arg.name == "out"
    ids = {id(t) for t in written}
    read = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and id(t) not in ids]
    return written, read, out or func.overloadpacket in _OVERWRITES


def _whole(t: torch.Tensor) -> bool:
    """Whether ``t`` covers all of its storage (a stand-in's storage is exactly its tensor)."""
    return t.numel() * t.element_size() == t.untyped_storage().nbytes() and is_non_overlapping_and_dense_or_false(t)


class WriteTracker(TorchDispatchMode):
    """Watches one call of ``fn`` on module ``where`` (see the module docstring).  After the call:
    ``written`` (stand-in keys written), ``needed`` (placeholder keys -> names: stand them in and run
    again), ``failure``; :meth:`check` refuses a written value that depends on one this rank lacks.

    ``unknown`` follows the values this rank lacks as NaN would: storage key -> (the pending tensor
    it comes from, the op that made it); a whole overwrite from known values clears it, and a value
    derived from one is refused only where it is written to a stand-in or turned into a Python value
    (a temporary that is dropped, or overwritten whole, as ``orthogonal_`` does, is harmless)."""

    def __init__(self, where: str, tracked: Tracked):
        super().__init__()
        self.where, self.tracked = where, tracked
        self.unknown = {key: (tracked.stand_ins[key], None) for key in tracked.pending}
        self.written: set = set()
        self.needed: dict = {}
        self.failure: AutoparError | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func.overloadpacket in _NO_DATA:
            return func(*args, **kwargs)  # aliases share the storage; no values read
        written, read, overwrite = _operands(func, args, kwargs)
        sources = [self._read(t) for t in read]
        sources += [] if overwrite else [self.unknown.get(storage_key(t)) for t in written]
        source = next((s for s in sources if s is not None), None)
        if any([self._write(t, func, overwrite, source) for t in written]):
            return self._set_aside(func, written)
        out = func(*args, **kwargs)
        if source is not None:  # what the op made depends on a value this rank lacks
            for leaf in pytree.tree_leaves(out):
                if not isinstance(leaf, torch.Tensor):
                    self._refuse(f"read {source[0]} into a Python value ({func}) before writing all of it",
                                 "a tensor written whole before it is read")
                self.unknown[storage_key(leaf)] = (source[0], source[1] or func)  # the op that read it
        return out

    def _read(self, t: torch.Tensor) -> tuple | None:
        """What ``t``'s value comes from, if this rank lacks it (None: known)."""
        key, tracked = storage_key(t), self.tracked
        if key in tracked.placeholders:
            self.needed[key] = tracked.placeholders[key]
            raise Rerun  # run again with it stood in: a copy of the user's value, or pending a whole write
        if key in tracked.model and not tracked.model[key][1]:
            self._refuse(f"read {tracked.model[key][0]} through a reference to the user's model, whose value "
                         "there is not the one an earlier init call wrote", "fn to reach tensors through the "
                         "module it is given", "reach the tensor through fn's argument (module.<child>.weight)")
        return self.unknown.get(key)

    def _write(self, t: torch.Tensor, func, overwrite: bool, source: tuple | None) -> bool:
        """Record a write; True: set the op aside (a placeholder's)."""
        key, tracked = storage_key(t), self.tracked
        if key in tracked.placeholders:
            self.needed[key] = tracked.placeholders[key]
            return True
        if key in tracked.model:
            self._refuse(f"wrote {tracked.model[key][0]} ({func}) through a reference to the user's model, "
                         "not through the module fn was given, so autopar cannot place it (nor leave the "
                         "user's model untouched)", "fn to write only the module it is given and its descendants",
                         "reach the tensor through fn's argument (module.<child>.weight), not through the model "
                         "or a closure")
        if key in tracked.attributes:
            self._refuse(f"wrote {tracked.attributes[key]} ({func}), a tensor attribute that is neither a "
                         "parameter nor a buffer, so the program does not hold it",
                         "writes to parameters and buffers", "register it with register_buffer, or leave it out of fn")
        if key in tracked.stand_ins:
            self.written.add(key)
        if source is not None:
            self.unknown[key] = (source[0], source[1] or func)
        elif overwrite and _whole(t):
            self.unknown.pop(key, None)
        elif key in self.unknown:  # a part overwritten: the rest still lacks its value
            self.unknown[key] = (self.unknown[key][0], func)
        return False

    def _set_aside(self, func, written: list):
        """The result of an op skipped for writing a placeholder (the call runs again)."""
        if not func._schema.returns:
            return None
        if len(func._schema.returns) == 1 and len(written) == 1:
            return written[0]  # an in-place op's result: its operand, left as it was
        self._refuse(f"ran {func} on a descendant's tensor it was not given, an op autopar cannot set aside",
                     "in-place ops on one tensor at a time")

    def check(self, key, name: str) -> None:
        """Refuse stand-in ``name`` (storage ``key``), written by the call, if its value depends on one
        this rank lacks."""
        if key not in self.unknown:
            return
        source, func = self.unknown[key]
        found = (f"wrote only part of {name}, or changed it in place ({func}), before writing all of it"
                 if source == name else f"wrote {name} from {source} ({func}), which it read before writing "
                 "all of it")
        self._refuse(f"{found}; the value there is an earlier init call's (or none: the model was built on the "
                     "meta device), of which this rank holds only its shard", "a tensor written whole before "
                     "it is read")

    def _refuse(self, found: str, expected: str, fix: str = _FIX) -> None:
        self.failure = refusal(self.where, found, expected, fix)
        raise self.failure
