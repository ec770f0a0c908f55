"""Shared pytest setup: import paths, tier markers and the session-wide multi-rank pool fixture.

Tests live in four tiers, one directory each, and every test gets the marker of its
directory (``pytest -m unit`` / ``-m dist`` / ``-m e2e`` / ``-m gpu``, or select the directory):
  * ``tests/unit``: one process, no process group or subprocess (graphs, passes, plans,
    cost model, search, schedules, layouts, errors);
  * ``tests/dist``: multi-rank equivalence and byte tests on the gloo pools (``dist_pool``);
  * ``tests/e2e``: the ``autopar`` CLI, the examples and the scale simulation;
  * ``tests/gpu``: one CUDA GPU, a real NCCL process group at world 1 (skipped without CUDA;
    run on a lent GPU by ``benchmarks/device_check.sh``).
The support code the tiers share (the harness, the jobs, the models, the reference side)
is the package ``tests/support/``. The pools themselves live in ``tests/support/harness.py``;
this file only exposes them as the ``dist_pool`` fixture and shuts them down when the session ends.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
# Test modules import `tests.support.harness` / `tests.support.models`, examples import from the repo root.
for _path in (str(_TESTS_DIR.parent), str(_TESTS_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests.support.harness import run_distributed, shutdown_pools  # noqa: E402
from tests.support import trace_cache  # noqa: E402

__all__ = ["dist_pool"]


@pytest.fixture(scope="session", autouse=True)
def _trace_memo():
    """The session runs inside the suite's trace memo: each distinct model exported once per
    process (tests/support/trace_cache.py; the pool workers enter their own)."""
    with trace_cache.session():
        yield


@pytest.fixture(scope="session")
def dist_pool():
    """``run(fn, *args, world=N, timeout=300, **kwargs) -> [result of rank r, ...]``.

    Pools start lazily on first use of each world size and are reused by every test.
    """
    yield run_distributed
    shutdown_pools()


TIERS = ("unit", "dist", "e2e", "gpu")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier: the first directory of its path under tests/."""
    for item in items:
        try:
            tier = Path(item.path).resolve().relative_to(_TESTS_DIR).parts[0]
        except ValueError:  # collected from outside tests/
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
