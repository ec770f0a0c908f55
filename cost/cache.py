"""The on-disk cache of the lambdified cost formulas (model.py), so that a warm process skips sympy's work.

Lambdifying the cost model -- building the sympy formulas of comm.py, flops.py, memory.py,
pipeline.py and time.py, eliminating common subexpressions and ``lambdify``-ing them --
is most of what ``autopar plan`` spends before its search. What it produces is plain
Python source over numpy (``inspect.getsource`` of each lambdified function) plus the
names of its inputs and outputs. model.py stores that here, once per lambdified variant
(``model_formulas("derived", True)``, ``memory_formulas(...)``, ...), and a later process
executes the stored source (milliseconds) instead of lambdifying the formulas; the sympy expressions
themselves are rebuilt only when asked for (``Formulas.exprs``: ``Cost.breakdown()``'s
formulas, ``autopar explain --formulas``).

Key: a SHA-256 of every ``*.py`` file of this package (the formulas, the symbols, the way
model.py lambdifies them, this file) and of the autopar modules the formulas read
(``autopar/plan.py``, ``autopar/plan_space/``: schedule and variant names, the plan encoding), with the
Python, numpy and sympy versions and :data:`FORMAT`. Any edit to those files gives a new key, so
a stale entry is never read; an entry's file name carries its key and the file repeats
the whole key, which is checked on load.

Where: ``$AUTOPAR_CACHE_DIR`` (``off`` disables the cache), else
``$XDG_CACHE_HOME/autopar``, else ``~/.cache/autopar``. Entries are written to a temporary
file and moved into place with ``os.replace``, so concurrent processes (test pools) read
either a whole entry or none. Nothing here ever fails a run: an unwritable or missing
directory, a corrupt or foreign entry all fall back to compiling in the process. The
entries are Python source that is executed on load: keep the directory private to its
user, as the default one is.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "cache_dir", "source_key", "load", "store", "dump_functions", "load_functions"]

FORMAT = 1
"""Bump when the layout of an entry changes."""

_STALE_SECONDS = 7 * 24 * 3600  # entries under another key are removed once this old


def cache_dir() -> Path | None:
    """The cache directory (not created), or None when ``AUTOPAR_CACHE_DIR=off``."""
    override = os.environ.get("AUTOPAR_CACHE_DIR")
    if override:
        return None if override.strip().lower() == "off" else Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autopar"


def _key_files() -> list[Path]:
    import autopar.plan
    import autopar.plan_space

    here = Path(__file__).resolve().parent
    space = Path(autopar.plan_space.__file__).parent
    return sorted(here.glob("*.py")) + [Path(autopar.plan.__file__)] + sorted(space.glob("*.py"))


@functools.lru_cache(maxsize=1)
def source_key() -> str | None:
    """The key of this cost model's lambdified formulas (module docstring), or None if a source is unreadable."""
    import sympy

    h = hashlib.sha256()
    h.update(f"format {FORMAT}; python {sys.version}; numpy {np.__version__}; sympy {sympy.__version__}\n".encode())
    try:
        for path in _key_files():
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    except OSError:
        return None
    return h.hexdigest()


def _path(entry: str, key: str) -> Path | None:
    root = cache_dir()
    return None if root is None else root / f"{entry}-{key[:24]}.json"


def load(entry: str, key: str | None) -> dict | None:
    """The payload stored for ``entry`` under ``key``, or None (missing, unreadable, another key)."""
    path = _path(entry, key) if key else None
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("entry") != entry:
        return None
    return data.get("payload")


def store(entry: str, key: str | None, payload: dict) -> None:
    """Write ``payload`` for ``entry`` atomically; silently does nothing if the directory is unwritable."""
    path = _path(entry, key) if key else None
    if path is None:
        return
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{entry}-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"key": key, "entry": entry, "payload": payload}, fh)
        os.replace(tmp, path)
        tmp = None
        _remove_stale(path.parent, entry, path.name)
    except (OSError, TypeError, ValueError):
        pass
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _remove_stale(root: Path, entry: str, keep: str) -> None:
    """Drop this entry's files under other keys once they are a week old (other checkouts may still use newer ones)."""
    now = time.time()
    for old in root.glob(f"{entry}-*.json"):
        try:
            if old.name != keep and now - old.stat().st_mtime > _STALE_SECONDS:
                old.unlink()
        except OSError:
            pass


# ---------------------------------------------------------------------- lambdified functions
def _global_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _origin(obj, name: str, extra: dict):
    """How to find ``obj`` (the global ``name`` of a lambdified function) again in a fresh process."""
    if extra.get(name) is obj:
        return "extra"
    if obj is np:
        return "module"
    if getattr(np, name, None) is obj:
        return "numpy"
    if getattr(math, name, None) is obj:
        return "math"
    if name == "reduce" and obj is functools.reduce:
        return "functools"
    return None


def dump_functions(functions: dict, extra: dict) -> dict | None:
    """Source, arguments and globals of lambdified ``functions`` ({name: fn}); None if one cannot be stored.

    ``extra`` are the non-numpy functions handed to ``lambdify``'s ``modules``, which
    :func:`load_functions` is given again."""
    import builtins
    import inspect

    out = {}
    for name, fn in functions.items():
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            return None
        globs = {}
        for g in sorted(_global_names(fn.__code__)):
            if g in fn.__globals__:
                origin = _origin(fn.__globals__[g], g, extra)
                if origin is None:
                    return None
                globs[g] = origin
            elif not hasattr(builtins, g):
                return None
        out[name] = {"name": fn.__name__, "source": source, "globals": globs}
    return out


def load_functions(stored: dict, extra: dict) -> dict:
    """The functions of :func:`dump_functions`, compiled from their source."""
    modules = {"numpy": np, "math": math, "functools": functools}
    out = {}
    for name, item in stored.items():
        namespace = {g: (extra[g] if origin == "extra" else np if origin == "module"
                         else getattr(modules[origin], g)) for g, origin in item["globals"].items()}
        exec(compile(item["source"], f"<autopar cost cache: {name}>", "exec"), namespace)  # noqa: S102
        out[name] = namespace[item["name"]]
    return out
