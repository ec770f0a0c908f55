"""Shared pytest setup: import paths and the session-wide multi-rank pool fixture.

The pools themselves live in ``tests/harness.py``; this file only exposes them as the
``dist_pool`` fixture and shuts them down when the session ends.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS_DIR = Path(__file__).resolve().parent
# Test modules import `tests.harness` / `tests.models`, examples import from the repo root.
for _path in (str(_TESTS_DIR.parent), str(_TESTS_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests.harness import run_distributed, shutdown_pools  # noqa: E402

__all__ = ["dist_pool"]


@pytest.fixture(scope="session")
def dist_pool():
    """``run(fn, *args, world=N, timeout=300, **kwargs) -> [result of rank r, ...]``.

    Pools start lazily on first use of each world size and are reused by every test.
    """
    yield run_distributed
    shutdown_pools()


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
