"""Error type and message helpers shared by every part of autopar.

Every user-facing error starts with ``autopar:``, says what was found and what was
expected, and suggests a fix.  Graph problems also name the node, the module it came
from and the source line (see :func:`describe_node`).
"""
from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["AutoparError", "describe_node"]


class AutoparError(ValueError):
    """A problem with the user's model, plan or input (never an internal bug)."""

    def __init__(self, message: str):
        if not message.startswith("autopar:"):
            message = "autopar: " + message
        super().__init__(message)


def describe_node(node) -> str:
    """Human-readable location of an FX node: name, op, module path and source line."""
    meta = getattr(node, "meta", {}) or {}
    parts = [f"node '{node.name}' ({node.op} {getattr(node.target, '__name__', node.target)})"]
    stack = meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        parts.append(f"in module '{path}' ({cls_name.split('.')[-1]})")
    trace = meta.get("stack_trace")
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
        frames = [(lines[i][5:], lines[i + 1] if i + 1 < len(lines) else "")
                  for i in range(len(lines)) if lines[i].startswith("File ")]
        # The innermost frame outside torch itself (and the Hugging Face kernels hub's dispatch
        # wrapper, which forwards a model's own function: a mixer's convolution) is the user's line.
        user = [f for f in frames if not any(d in f[0] for d in _library_dirs())] or frames
        if user:
            parts.append(f"at {user[-1][0]}: {user[-1][1]}")
    return ", ".join(parts)


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """torch's directory, and the ``kernels`` package's where it is installed (found without importing)."""
    spec = importlib.util.find_spec("kernels")
    hub = os.path.dirname(spec.origin) + os.sep if spec and spec.origin else None
    return (_torch_dir(),) + ((hub,) if hub else ())


@functools.lru_cache(maxsize=1)
def _torch_dir() -> str:
    """Where torch is installed, found without importing it (offline planning never loads torch)."""
    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) if spec and spec.origin else os.sep + "torch" + os.sep
