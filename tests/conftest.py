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

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

_TESTS_DIR = Path(__file__).resolve().parent
# Test modules import `tests.support.harness` / `tests.support.models`, examples import from the repo root.
for _path in (str(_TESTS_DIR.parent), str(_TESTS_DIR)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tests.support.harness import run_distributed, shutdown_pools  # noqa: E402
from tests.support import trace_cache, trace_disk  # noqa: E402

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


def pytest_configure(config):
    """Under ``pytest -n 2`` each worker has a core: one thread for torch in it and in the
    processes it starts (two threads each on two busy cores spin against one another).

    The session's folder of traces (tests/support/trace_disk.py) is made here, by the process that
    starts the session (xdist's controller, or the one pytest process), before any worker or pool:
    they inherit it through the environment.  A folder already named there is someone else's
    (a pytest inside a test): used, not removed."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        torch.set_num_threads(1)
    elif not os.environ.get(trace_disk.ENV) and os.environ.get("AUTOPAR_TEST_TRACE_CACHE", "1") != "0":
        config._autopar_trace_dir = tempfile.mkdtemp(prefix="autopar-traces-")
        os.environ[trace_disk.ENV] = config._autopar_trace_dir


def pytest_unconfigure(config):
    folder = getattr(config, "_autopar_trace_dir", None)
    if folder is not None:
        os.environ.pop(trace_disk.ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


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


def pytest_collection_finish(session):
    """Freeze what collection made (torch, transformers and every test module, imported for good):
    the interpreter's full collections, many in a session that makes programs by the thousand,
    then walk only what the tests make (about 15 CPU-s of the unit tier otherwise).  The pool
    workers freeze what outlives each job the same way (tests/support/harness.py)."""
    gc.collect()
    gc.freeze()


# tests/dist files that run on either worker with pools of its own: their cost is mostly their own
# (models no other file traces, torch.compile, the profiler), so they balance the two workers
# without tracing much twice.
_DIST_ON_THEIR_OWN = frozenset(f"tests/dist/{name}.py" for name in (
    "test_architectures", "test_compile", "test_memory_peak", "test_fused_kv_replication", "test_sliding_window"))


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent without it
def pytest_xdist_make_scheduler(config, log):
    """``pytest -n 2`` (the README's and CI's command: two workers, one per core, each with its own
    pools and trace memo, sharing the session's folder of traces) hands each worker whole scopes, in the order collected (tests/dist,
    then tests/e2e, then the many small files of tests/unit, which fill in at the end): all of
    ``tests/dist`` but :data:`_DIST_ON_THEIR_OWN` is one scope (its pools trace each model once
    for the tier; split, both workers' pools would trace every shared model on every rank), and
    otherwise a test file is one (its module-scoped fixtures are computed once)."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/dist" if path.startswith("tests/dist/") and path not in _DIST_ON_THEIR_OWN else path

    config.option.loadscopereorder = False  # not by test count: the big scopes are collected first
    return TierScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    shutdown_pools()
