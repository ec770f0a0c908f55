"""Multi-rank test harness: pooled gloo workers that run jobs on every rank.

Every numerical-equivalence and byte-equality test runs its per-rank code through
:func:`run_distributed` (or the ``dist_pool`` fixture in ``tests/conftest.py``).
Starting a gloo world and importing torch costs seconds per process, so one pool of
spawned workers per world size lives for the whole pytest session and runs job
after job; a job is an importable module-level function called on every rank after
the default process group (gloo) is up.  A failing, crashed or hung job kills its
pool, which restarts lazily on next use.  After each job the worker destroys the job's
sub-groups, and a job that leaves a gloo process group alive (something still holds its
program) fails: each live group keeps gloo loop threads that would slow every later job.

The single-process side of the equivalence tests (:func:`reference_train`,
:func:`assert_equivalent`, :func:`make_batches`, :data:`OPTIMIZERS`,
:func:`next_token_loss`) lives in ``tests/support/reference.py`` and is re-exported here, so
``from tests.support.harness import make_batches`` keeps working.  The harness's own tests live
in ``tests/dist/test_harness.py``.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = [
    "RankError",
    "JobTimeout",
    "WorkerPool",
    "get_pool",
    "run_distributed",
    "shutdown_pools",
    "reference_train",
    "assert_equivalent",
    "make_batches",
    "next_token_loss",
    "OPTIMIZERS",
    "DEFAULT_JOB_TIMEOUT",
    "GLOO_TIMEOUT",
    "JOB_SEED",
]

# The reference side, re-exported.
from tests.support.reference import (  # noqa: E402
    OPTIMIZERS,
    _max_abs_diff,
    assert_equivalent,
    make_batches,
    next_token_loss,
    reference_train,
)

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
DEFAULT_JOB_TIMEOUT = 300.0
GLOO_TIMEOUT = 60.0
START_TIMEOUT = 180.0
JOB_SEED = 0
# After the first rank fails, how long to wait for the others' errors before killing.
_ERROR_GRACE_S = 1.0
_POLL_S = 0.5


class RankError(RuntimeError):
    """A job raised (or its process died) on one rank; carries that rank's traceback.

    ``rank`` is the failing rank, ``exception`` the original exception when it could
    be unpickled (else None), ``remote_traceback`` the formatted traceback text.
    """

    def __init__(self, message: str, *, rank: int, exception: BaseException | None,
                 remote_traceback: str):
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = remote_traceback


class JobTimeout(TimeoutError):
    """A job did not finish on every rank within its timeout; the pool was killed."""


# ----------------------------------------------------------------------------- worker side


def _resolve(module: str, qualname: str) -> Callable:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _snapshot_globals() -> dict:
    return {
        "dtype": torch.get_default_dtype(),
        "device": torch.get_default_device(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "gloo_threads": _gloo_threads(),
    }


def _gloo_threads() -> int:
    """This process's gloo loop threads (one per live gloo process group; -1 off Linux)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _seed_job() -> None:
    torch.manual_seed(JOB_SEED)
    random.seed(JOB_SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(JOB_SEED)


_JOBS_SINCE_THAW = [0]
_THAW_EVERY = 32


def _collect_job_garbage() -> None:
    """Free the job's reference cycles; :func:`_reset_after_job` then freezes what survives.

    A worker that served many jobs holds hundreds of thousands of long-lived objects (traced
    programs in the trace memo, imported modules); a full collection walks them all, about a
    third of a second each time, and jobs collect once per job and once per measured step
    (peak_jobs.py).  Frozen, they are skipped, so a collection walks only what the next job makes.
    A frozen object that later becomes cyclic garbage (a trace evicted from the memo) is only
    freed when thawed, so every ``_THAW_EVERY`` jobs the worker thaws and collects everything."""
    _JOBS_SINCE_THAW[0] += 1
    if _JOBS_SINCE_THAW[0] >= _THAW_EVERY:
        _JOBS_SINCE_THAW[0] = 0
        gc.unfreeze()
    gc.collect()


def _reset_after_job(saved: dict) -> None:
    """Drop what a job left in this process so the next job starts clean."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError("the job destroyed the default process group; "
                           "jobs must leave it to the harness")
    world = c10d.GroupMember.WORLD
    # Sub-groups (e.g. from init_device_mesh) hold gloo sockets and threads; the
    # group-name counter keeps advancing identically on every rank, so names agree.
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    del pg  # the loop variable would keep the last group (and its gloo threads) alive
    mesh_module = sys.modules.get("torch.distributed.device_mesh")  # importing it costs ~1 s
    if mesh_module is not None and hasattr(mesh_module, "_mesh_resources"):
        mesh_module._mesh_resources.mesh_stack.clear()
    torch.set_default_dtype(saved["dtype"])
    if torch.get_default_device() != saved["device"]:
        # Passing None removes the device mode instead of stacking another one.
        torch.set_default_device(None if saved["device"].type == "cpu" else saved["device"])
    torch.set_grad_enabled(saved["grad"])
    if torch.are_deterministic_algorithms_enabled() != saved["deterministic"]:
        torch.use_deterministic_algorithms(saved["deterministic"])  # imports inductor: ~1 s
    if torch.is_anomaly_enabled() != saved["anomaly"]:
        torch.autograd.set_detect_anomaly(saved["anomaly"])
    torch.set_num_threads(1)
    if os.environ != saved["environ"]:
        os.environ.clear()
        os.environ.update(saved["environ"])
    if os.getcwd() != saved["cwd"]:
        os.chdir(saved["cwd"])
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    _collect_job_garbage()
    # A process group outliving its job means something still holds the job's program (a
    # reference cycle through a C++ hook, a global cache): every later job would then share
    # the cores with its gloo threads, and a suite slows down job by job until it times out.
    left = _gloo_threads() - saved["gloo_threads"]
    for _ in range(20):  # a destroyed group's loop thread may take a moment to exit: a leak stays
        if saved["gloo_threads"] < 0 or left <= 0:
            break
        time.sleep(0.05)
        gc.collect()  # young objects only: the worker's long-lived ones are frozen
        left = _gloo_threads() - saved["gloo_threads"]
    if saved["gloo_threads"] >= 0 and left > 0:
        raise RuntimeError(f"harness: the job left {left} gloo process group(s) alive after it "
                           "returned (their groups were destroyed, so something still references "
                           "them: a hook on a parameter, a module-level cache); free the program")
    gc.freeze()


def _worker_main(rank: int, world_size: int, init_method: str, task_q, result_q) -> None:
    """Entry point of one spawned rank: init gloo, then serve jobs until told to stop, inside the
    suite's trace memo (each distinct model exported once per worker: tests/support/trace_cache.py)."""
    try:
        for path in (str(REPO_ROOT), str(TESTS_DIR)):
            if path not in sys.path:
                sys.path.insert(0, path)
        torch.set_num_threads(1)
        torch.set_num_interop_threads(1)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=GLOO_TIMEOUT))
        from tests.support import trace_cache
        saved = _snapshot_globals()
    except BaseException:
        result_q.put(("fatal", -1, rank, traceback.format_exc()))
        return
    result_q.put(("ready", -1, rank, None))
    with trace_cache.session():
        _serve(task_q, result_q, rank, saved)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # Skip interpreter teardown (seconds for torch on a busy machine): flush and go.
    sys.stdout.flush()
    sys.stderr.flush()
    result_q.close()
    result_q.join_thread()
    os._exit(0)


def _serve(task_q, result_q, rank: int, saved: dict) -> None:
    """Run the jobs of ``task_q`` until told to stop (or the parent is gone), each reply on ``result_q``."""
    parent = mp.parent_process()
    while True:
        try:
            msg = task_q.get(timeout=2.0)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                break
            continue
        if msg is None:
            break
        job_id, payload = msg
        try:
            module, qualname, args, kwargs = pickle.loads(payload)
            _seed_job()
            result = _resolve(module, qualname)(*args, **kwargs)
            _reset_after_job(saved)
            reply = ("ok", job_id, rank, pickle.dumps(result))
        except BaseException as exc:
            try:
                exc_bytes = pickle.dumps(exc)
                pickle.loads(exc_bytes)
            except Exception:
                exc_bytes = None
            reply = ("err", job_id, rank,
                     (traceback.format_exc(), f"{type(exc).__name__}: {exc}", exc_bytes))
        result_q.put(reply)


# ----------------------------------------------------------------------------- parent side

_ENV_LOCK = threading.Lock()
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
if sys.platform.startswith("linux"):
    # All ranks are local; pinning gloo to loopback avoids hostname-resolution trouble.
    _WORKER_ENV["GLOO_SOCKET_IFNAME"] = "lo"


def _fn_name(fn: Callable | str) -> tuple[str, str]:
    """Return (module, qualname) for an importable module-level function."""
    if isinstance(fn, str):
        module, sep, qualname = fn.partition(":")
        if not sep or not module or not qualname:
            raise ValueError(f"harness: job {fn!r} must be written 'module:qualname'")
    else:
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not module or not qualname:
            raise TypeError(f"harness: job {fn!r} is not a function; pass a module-level "
                            "function or a 'module:qualname' string")
    if module == "__main__" or "<" in qualname:
        raise ValueError(f"harness: job {module}:{qualname} is not importable by the workers; "
                         "define it at module level in an importable module (not a lambda, "
                         "closure or __main__)")
    try:
        _resolve(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"harness: cannot import job {module}:{qualname}: {exc}") from exc
    return module, qualname


class WorkerPool:
    """``world_size`` spawned gloo ranks that run jobs one after another.

    ``start()`` spawns the ranks and waits until each has joined the gloo world;
    ``run(fn, *args, **kwargs)`` returns ``[fn(*args, **kwargs) on rank r for r]``.
    Any failure kills the pool (``alive`` turns False); :func:`get_pool` replaces it.
    """

    def __init__(self, world_size: int, *, start_timeout: float = START_TIMEOUT):
        if world_size < 1:
            raise ValueError(f"harness: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.start_timeout = start_timeout
        self.num_jobs = 0
        self._procs: list = []
        self._task_qs: list = []
        self._result_q = None
        self._tmpdir: str | None = None
        self._alive = False

    @property
    def alive(self) -> bool:
        return self._alive and all(p.exitcode is None for p in self._procs)

    def start(self) -> "WorkerPool":
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix=f"autopar-gloo{self.world_size}-")
        init_method = f"file://{os.path.join(self._tmpdir, 'store')}"
        self._result_q = ctx.Queue()
        self._task_qs = [ctx.Queue() for _ in range(self.world_size)]
        with _ENV_LOCK:
            old = {k: os.environ.get(k) for k in _WORKER_ENV}
            os.environ.update(_WORKER_ENV)
            try:
                for rank in range(self.world_size):
                    p = ctx.Process(target=_worker_main, daemon=True,
                                    name=f"autopar-rank{rank}of{self.world_size}",
                                    args=(rank, self.world_size, init_method,
                                          self._task_qs[rank], self._result_q))
                    p.start()
                    self._procs.append(p)
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        self._alive = True
        ready: set[int] = set()
        deadline = time.monotonic() + self.start_timeout
        while len(ready) < self.world_size:
            msg = self._next_message(deadline)
            if msg is None:
                self.kill()
                missing = sorted(set(range(self.world_size)) - ready)
                raise JobTimeout(f"harness: gloo world of {self.world_size} did not start within "
                                 f"{self.start_timeout:.0f} s (ranks {missing} not ready)")
            kind, _, rank, body = msg
            if kind == "fatal":
                self.kill()
                raise RankError(f"harness: rank {rank} of {self.world_size} failed to start:\n"
                                f"{body}", rank=rank, exception=None, remote_traceback=body)
            if kind == "ready":
                ready.add(rank)
        return self

    def _next_message(self, deadline: float):
        """Next result-queue message, or None at the deadline; raises if a rank died."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                return self._result_q.get(timeout=min(_POLL_S, left))
            except queue.Empty:
                pass
            for rank, p in enumerate(self._procs):
                if p.exitcode is not None:
                    try:  # its last message may have raced with its exit
                        return self._result_q.get(timeout=_POLL_S)
                    except queue.Empty:
                        pass
                    code = p.exitcode
                    self.kill()
                    text = f"rank {rank} process exited with code {code}"
                    raise RankError(f"harness: {text} (world {self.world_size}); pool killed",
                                    rank=rank, exception=None, remote_traceback=text)

    def run(self, fn: Callable | str, *args, timeout: float = DEFAULT_JOB_TIMEOUT,
            **kwargs) -> list:
        module, qualname = _fn_name(fn)
        name = f"{module}:{qualname}"
        try:
            payload = pickle.dumps((module, qualname, args, kwargs))
        except Exception as exc:
            raise TypeError(f"harness: arguments of job {name} cannot be pickled ({exc}); pass "
                            "tensors, plain data, partials and module-level functions") from exc
        if not self.alive:
            raise RuntimeError(f"harness: pool of world {self.world_size} is not running; "
                               "use get_pool() for a fresh one")
        self.num_jobs += 1
        job_id = self.num_jobs
        for q in self._task_qs:
            q.put((job_id, payload))
        results: dict[int, Any] = {}
        errors: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        first_error_at = 0.0
        try:
            while len(results) + len(errors) < self.world_size:
                if errors:  # others may be stuck in a collective: wait briefly, then give up
                    deadline = min(deadline, first_error_at + _ERROR_GRACE_S)
                msg = self._next_message(deadline)
                if msg is None:
                    if errors:
                        break
                    pending = sorted(set(range(self.world_size)) - set(results))
                    self.kill()
                    raise JobTimeout(f"harness: job {name} did not finish within {timeout:g} s on "
                                     f"ranks {pending} of world {self.world_size}; the pool was "
                                     "killed and restarts on next use")
                kind, msg_job, rank, body = msg
                assert msg_job == job_id, (msg_job, job_id)
                if kind == "ok":
                    results[rank] = pickle.loads(body)
                else:
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = body
        except RankError as exc:
            raise RankError(f"{exc} while running {name}", rank=exc.rank, exception=None,
                            remote_traceback=exc.remote_traceback) from None
        except BaseException:
            # Interrupted (Ctrl-C) or a result failed to unpickle: ranks may still be
            # busy with this job, so nothing on the queues can be trusted any more.
            self.kill()
            raise
        if errors:
            self.kill()
            raise self._rank_error(name, errors)
        return [results[r] for r in range(self.world_size)]

    def _rank_error(self, name: str, errors: dict[int, tuple]) -> RankError:
        first = next(iter(errors))  # the first to report is usually the cause
        tb, summary, exc_bytes = errors[first]
        others = [f"rank {r}: {s}" for r, (_, s, _) in errors.items() if r != first]
        lines = [f"harness: job {name} raised on rank {first} of world {self.world_size}: "
                 f"{summary}"]
        if others:
            lines.append("also failed: " + "; ".join(others))
        lines += [f"--- traceback of rank {first} ---", tb.rstrip(),
                  "(the pool was killed and restarts on next use)"]
        try:
            exc = pickle.loads(exc_bytes) if exc_bytes is not None else None
        except Exception:  # a class the worker had but this process cannot import
            exc = None
        err = RankError("\n".join(lines), rank=first, exception=exc, remote_traceback=tb)
        err.__cause__ = exc
        return err

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask ranks to exit cleanly; kill whatever is still running after ``timeout``."""
        self._request_stop()
        self._join_then_kill(time.monotonic() + timeout)

    def _request_stop(self) -> None:
        if self._alive:
            for q in self._task_qs:
                try:
                    q.put(None)
                except (ValueError, OSError):
                    pass

    def _join_then_kill(self, deadline: float) -> None:
        for p in self._procs:
            if p.exitcode is None:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every rank, reap it, and release the queues and store directory."""
        self._alive = False
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join()
            p.close()
        self._procs = []
        for q in [*self._task_qs, self._result_q]:
            if q is not None:
                q.cancel_join_thread()
                q.close()
        self._task_qs, self._result_q = [], None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


_POOLS: dict[int, WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(world_size: int) -> WorkerPool:
    """The session's running pool for ``world_size``, started (or restarted) on demand."""
    with _POOLS_LOCK:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.kill()
            pool = _POOLS[world_size] = WorkerPool(world_size)
            try:
                pool.start()
            except BaseException:
                del _POOLS[world_size]
                raise
        return pool


def run_distributed(fn: Callable | str, *args, world: int,
                    timeout: float = DEFAULT_JOB_TIMEOUT, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world``-rank gloo pool.

    Every rank is seeded with ``torch.manual_seed(JOB_SEED)`` before the job and reset
    after it (sub-groups and meshes dropped, torch defaults and ``os.environ``
    restored).  Results are pickled: return CPU tensors (``.detach().clone()`` views,
    else their whole storage travels), floats instead of graph-attached losses.
    Returns the per-rank results in rank order.  Raises :class:`RankError` (naming the
    rank, with its traceback) if a rank raises or dies, :class:`JobTimeout` after
    ``timeout`` seconds; both kill the pool, which restarts on next use.
    """
    return get_pool(world).run(fn, *args, timeout=timeout, **kwargs)


def shutdown_pools() -> None:
    """Stop every pool (registered with atexit; the session fixture calls it too)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
        for pool in pools:  # stop all worlds at once, then wait
            pool._request_stop()
        deadline = time.monotonic() + 10.0
        for pool in pools:
            pool._join_then_kill(deadline)


atexit.register(shutdown_pools)
