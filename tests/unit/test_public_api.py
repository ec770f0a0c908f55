"""The public API's shape: the top-level names, what type checkers see, and the signatures.

``autopar/__init__.py`` imports its names lazily (the offline tools never load torch:
tests/e2e/test_offline_imports.py); its ``TYPE_CHECKING`` block names the same objects for type
checkers and IDEs, and must not drift from the lazy map.  ``parallelize`` takes the model and
the example inputs positionally and everything else by keyword; ``verify`` has no testing hook.
"""
from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import autopar

INIT = Path(autopar.__file__)


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """``{name: (module, attribute)}`` imported under ``if TYPE_CHECKING:`` in autopar/__init__.py."""
    tree = ast.parse(INIT.read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If)
              and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    assert len(blocks) == 1
    return {alias.asname or alias.name: (node.module, alias.name)
            for node in blocks[0].body if isinstance(node, ast.ImportFrom) for alias in node.names}


def test_every_public_name_is_lazy_and_visible_to_type_checkers():
    lazy = autopar._LAZY
    assert set(autopar.__all__) == set(lazy)
    seen = _type_checking_imports()
    assert set(seen) == set(lazy)
    for name, (module, attr) in lazy.items():
        value = getattr(autopar, name)
        assert value is getattr(importlib.import_module(module), attr), name
        assert value is getattr(importlib.import_module(seen[name][0]), seen[name][1]), name


def test_top_level_data_and_checkpoint_helpers():
    from autopar.runtime.weights.checkpoint import load_model_state_dict
    from autopar.runtime.stepping.data import BatchSlice, DistributedBatchSampler

    assert autopar.DistributedBatchSampler is DistributedBatchSampler
    assert autopar.BatchSlice is BatchSlice
    assert autopar.load_model_state_dict is load_model_state_dict


def test_parallelize_takes_everything_after_the_example_inputs_by_keyword():
    params = list(inspect.signature(autopar.parallelize).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "example_inputs"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:2])
    assert {"example_kwargs", "plan", "loss_fn", "optimizer"} <= {p.name for p in params[2:]}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), [str(p) for p in params[2:]]


def test_verify_has_no_testing_hook_in_its_signature():
    assert "corrupt" not in inspect.signature(autopar.verify).parameters
