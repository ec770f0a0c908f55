"""The trace cache's second level: one export per model for the whole test session, shared by
every process of it through files.

Not a test module.  :mod:`tests.support.trace_cache` keeps traces per process; but the suite runs
its plans on pools of 2, 4 and 8 ranks (tests/support/harness.py), each rank a process, and under
``pytest -n 2`` two pytest processes with pools of their own: without this file every rank of
every pool exports every model it trains, on two cores (a world-8 pool: eight exports at once,
each 1.5 s on an idle core and 30 s on a loaded one).  Here the first process to need a model
exports it and writes the trace to the session's folder; the others wait for it and read it back
(a tenth of the export's time).

How, and why a trace read back is the one the export would give:
  * the folder is the session's own (``AUTOPAR_TEST_TRACE_DIR``, made by tests/conftest.py and
    removed at the session's end; each pool worker inherits it), so no trace outlives the code
    that made it;
  * the file's name is a digest of the in-process cache's key written out stably
    (:func:`digest`): classes and functions by module and qualified name, a library's class made
    by a factory also by what its methods close over; a key holding anything whose text names an
    address, a lambda, or a class or function local to the project's own code (a lambda loss, a
    test's local model class, a bound method) has no digest and is not shared;
  * the graph is written with torch's ``GraphPickler``, node metadata included (fake tensors,
    symbolic shapes, module stacks, source lines), and read back under a fresh fake mode; the
    model's tensors stay meta stand-ins, named, and the reader binds its own model's (as an
    in-process hit does);
  * torch.export's ``_guards_fn`` (a shape check whose ``forward`` is a closure, which pickle
    cannot write) is written as :class:`NoGuards`, which checks nothing, and the trace's
    ``input_guards`` (the same check, which the runtime calls each new shape) as None: the suite's
    inputs are those of the trace, and ``tests/unit/test_shape_guards.py`` traces outside the cache;
  * one process exports a key at a time (an exclusive ``flock`` on ``<digest>.lock``; the kernel
    releases it if the holder dies), and a file appears whole or not at all (``os.replace``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import hashlib
import os
import pickle
import re
import sys
import types
import warnings

import torch
from torch.fx._graph_pickler import GraphPickler, Options

from autopar.frontend import custom_functions

__all__ = ["ENV", "folder", "digest", "exclusive", "read", "write", "NoGuards"]

ENV = "AUTOPAR_TEST_TRACE_DIR"
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_OPTIONS = Options(ops_filter=None, node_metadata_key_filter=None)  # every op and every metadata key


class NoGuards(torch.nn.Module):
    """What a trace read back calls in place of torch.export's ``_guards_fn`` (module docstring)."""

    def forward(self, *args, **kwargs):
        return None


class _Unstable(Exception):
    """A part of a key whose text is not the same in every process."""


def folder() -> str | None:
    """The session's folder of traces, or None: no sharing (``ENV`` unset)."""
    return os.environ.get(ENV) or None


def digest(key) -> str | None:
    """A name for ``key`` that every process of the session computes alike, or None."""
    try:
        text = _stable(key)
    except _Unstable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ours(module: str) -> bool:
    """Whether ``module`` is the project's own code (a test, an example, ``__main__``), not a library's."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return True
    path = os.path.abspath(path)  # an installed library may sit inside the checkout (.venv/): not ours
    return path.startswith(_REPO + os.sep) and f"{os.sep}site-packages{os.sep}" not in path


def _name(obj) -> str:
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    module = getattr(obj, "__module__", None)
    if not qualname or not module:
        raise _Unstable(repr(obj))
    if "<" not in qualname:
        return f"{module}.{qualname}"
    if isinstance(obj, type) and "<lambda>" not in qualname and not _ours(module):
        return f"{module}.{qualname}[{_closures(obj)}]"
    raise _Unstable(repr(obj))  # a lambda, a test's local class or function: not one object per name


def _closures(cls: type) -> str:
    """What a library's class made by a factory is made of (transformers' kernel wrappers,
    ``kernels``' ``_create_func_module``): the values its methods close over, by name."""
    cells = []
    for key, value in sorted(vars(cls).items()):
        for cell in getattr(value, "__closure__", None) or ():
            cells.append(f"{key}:{_stable(cell.cell_contents)}")
    return ",".join(cells)


def _stable(value) -> str:
    if isinstance(value, str) and _ADDRESS.search(value):  # a repr kept as text (trace_cache._freeze)
        raise _Unstable(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ",".join(_stable(v) for v in value) + ")"
    if isinstance(value, type):
        return f"type:{_name(value)}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"fn:{_name(value)}"
    if isinstance(value, enum.Enum):
        return f"enum:{_name(type(value))}.{value.name}"
    text = repr(value)
    if _ADDRESS.search(text):
        raise _Unstable(text)
    return f"{_name(type(value))}:{text}"


@contextlib.contextmanager
def exclusive(name: str):
    """Hold the session-wide lock of trace ``name`` (one exporter at a time)."""
    with open(os.path.join(folder(), f"{name}.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _path(name: str) -> str:
    return os.path.join(folder(), f"{name}.trace")


def read(name: str):
    """``(graph, tensor names, traced)`` as :func:`write` stored them, or None if not written."""
    try:
        with open(_path(name), "rb") as f:
            stored = pickle.load(f)
    except FileNotFoundError:
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    with warnings.catch_warnings():  # torch's pytree spec pickling warns about its own deprecation
        warnings.simplefilter("ignore", FutureWarning)
        gm = GraphPickler.loads(stored["graph"], FakeTensorMode(shape_env=ShapeEnv()))
    custom_functions.register(gm)  # the custom autograd Functions the graph calls
    return gm, stored["names"], stored["traced"]


def write(name: str, gm: torch.fx.GraphModule, names: dict, traced) -> bool:
    """Store ``gm`` (its lent tensors meta stand-ins), ``names`` (where each stand-in sits in
    ``gm`` -> the model's name for it) and ``traced`` (the trace without its graph); False if
    something in them cannot be written (the trace then stays this process's own)."""
    if getattr(traced, "input_guards", None) is not None:
        traced = dataclasses.replace(traced, input_guards=None)
    guards = gm._modules.get("_guards_fn")
    if guards is not None:
        gm._modules["_guards_fn"] = NoGuards()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            data = pickle.dumps({"graph": GraphPickler.dumps(gm, _OPTIONS), "names": names, "traced": traced})
    except Exception:  # a closure, a lock, an unpicklable constant: not shared
        return False
    finally:
        if guards is not None:
            gm._modules["_guards_fn"] = guards
    partial = f"{_path(name)}.{os.getpid()}.tmp"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, _path(name))
    return True
