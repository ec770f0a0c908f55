"""Where the user's model comes from: ``MODULE:FUNCTION`` on the command line.

:func:`load_function` imports ``MODULE`` (a file path such as ``examples/model.py`` or an
importable module name) and returns ``FUNCTION``; :func:`load_target` calls it and checks
that it returned ``(model, example_inputs)`` or ``(model, example_inputs, example_kwargs)``.
``autopar inspect`` / ``explain --measure`` (autopar/cli/) and ``autopar verify``
(autopar/verification/, which also accepts a bare ``nn.Module``) load models this way; the
tracer that runs next is :mod:`autopar.frontend.trace`.  No torch import here.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Callable

from autopar.errors import AutoparError

__all__ = ["load_function", "load_target", "split_target"]

_FILE_MODULE = "_autopar_inspect_target"


def load_function(spec: str) -> Callable:
    """Import ``MODULE`` of ``MODULE:FUNCTION`` and return ``FUNCTION`` (not called)."""
    if ":" not in spec:
        raise AutoparError(f"autopar: expected MODULE:FUNCTION (e.g. examples/model.py:build_tiny), got '{spec}'.")
    module_name, func_name = spec.rsplit(":", 1)
    if module_name.endswith(".py") or os.path.sep in module_name:
        if not os.path.exists(module_name):
            raise AutoparError(f"autopar: no such file '{module_name}'; give a path to a Python file or a module name.")
        loaded = importlib.util.spec_from_file_location(_FILE_MODULE, module_name)
        module = importlib.util.module_from_spec(loaded)
        sys.modules[loaded.name] = module  # dataclasses in the target look their module up here
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        loaded.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise AutoparError(f"autopar: cannot import module '{module_name}': {exc}") from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise AutoparError(f"autopar: '{module_name}' has no function '{func_name}'.")
    return func


def split_target(result, func_name: str, allow_module: bool = False):
    """``(model, example_inputs, example_kwargs)`` from what ``FUNCTION()`` returned.

    ``allow_module``: a bare model is accepted too (its inputs are then ``None``)."""
    if allow_module and not isinstance(result, tuple) and callable(result):
        return result, None, {}
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        also = ", a model alone" if allow_module else ""
        raise AutoparError(f"autopar: {func_name}() must return (model, example_inputs) or "
                           f"(model, example_inputs, example_kwargs){also}; got {type(result).__name__}.")
    model, inputs = result[0], tuple(result[1])
    kwargs = dict(result[2]) if len(result) == 3 else {}
    return model, inputs, kwargs


def load_target(spec: str):
    """Call ``MODULE:FUNCTION`` and return ``(model, example_inputs, example_kwargs)``."""
    func = load_function(spec)
    return split_target(func(), spec.rsplit(":", 1)[1])
