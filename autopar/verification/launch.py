"""Local ranks: the one launcher product code starts processes on this machine with.

Two entries, one for each kind of caller:

* :func:`run_spawned` (``explain --measure``, ``calibrate``): a Python function on ``world``
  spawned processes (``torch.multiprocessing``, a free TCP port for their process group), each
  returning its result or posting progress through one queue; the first failure, a dead rank or
  the timeout is an ``autopar:`` error naming the rank.  Spawning is safe there: the caller is the
  ``autopar`` command, whose main module is guarded.
* :func:`start_ranks` / :func:`wait_ranks` (``autopar verify`` and ``autopar.verify(...)``): the
  worker module as ``python -m`` subprocesses, because ``autopar.verify`` is public API called from
  users' scripts, which a spawned child would import and run again (a script without a
  ``__main__`` guard would then recurse), and each rank's output goes to its own log.

:func:`start_ranks` launches ``world`` processes of :mod:`autopar.verification.worker` at once
(one launch for the whole run, localhost, a free TCP port, one CPU thread each, output to
``WORKDIR/rank-R.log``); :func:`wait_ranks` waits for them and returns rank 0's result, or
raises: :class:`~autopar.errors.AutoparError` when the ranks refused the plan (an ``autopar:``
error from ``parallelize``), :class:`RankFailure` when a rank crashed or the run timed out.
The first failing rank stops the others (they would wait in a collective until gloo's timeout).
"""
from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from typing import Any, Callable

import torch

from autopar.errors import AutoparError

__all__ = ["RankFailure", "free_port", "stop_processes", "run_spawned", "start_ranks", "stop_ranks", "wait_ranks",
           "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 600.0
_GRACE_S = 3.0  # after the first failure, how long the other ranks get to report theirs
_POLL_S = 0.1


class RankFailure(RuntimeError):
    """A rank of the parallel run crashed or did not finish (not a refusal of the plan)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_processes(procs, grace: float = 10.0) -> None:
    """Join spawned processes; end (SIGTERM, each by its own handle) those still running after ``grace``
    seconds in all."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join()


def _spawned_rank(fn: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    """One spawned rank: ``fn(rank, world, port, *args, post=...)``, its result or its failure put on
    ``results``; the process group it joined is destroyed whatever happens."""
    import torch.distributed as dist

    try:
        payload = fn(rank, world, port, *args, post=lambda kind, value: results.put((kind, rank, value)))
        results.put(("ok", rank, payload))
    except BaseException as exc:  # reported to the parent, which raises a clear error
        results.put(("err", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawned(fn: Callable, world: int, args: tuple = (), *, what: str, timeout: float = DEFAULT_TIMEOUT_S,
                on_post: Callable[[str, int, Any], None] | None = None) -> list[Any]:
    """Each rank's result of ``fn(rank, world, port, *args, post=post)`` run on ``world`` spawned local
    processes (``fn`` importable at module level; it joins the process group on ``port`` itself).
    ``post(kind, value)`` sends progress to the parent, handed to ``on_post(kind, rank, value)``.
    ``what`` says what the ranks do, for the errors."""
    import torch.multiprocessing as mp

    if world < 1:
        raise AutoparError(f"autopar: --world must be >= 1, got {world}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_spawned_rank, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world:
            try:
                kind, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead or time.monotonic() > deadline:
                    why = (f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}" if dead
                           else f"the ranks did not finish within {timeout:.0f} s")
                    raise AutoparError(f"autopar: {what} on {world} local ranks failed: {why}; try a smaller "
                                       "model, batch or --world") from None
                continue
            if kind == "err":
                raise AutoparError(f"autopar: rank {rank} failed while {what}: {payload.splitlines()[0]}\n{payload}")
            if kind == "ok":
                done[rank] = payload
            elif on_post is not None:
                on_post(kind, rank, payload)
    finally:
        stop_processes(procs)
    return [done[r] for r in range(world)]


def start_ranks(workdir: str, world: int) -> list[subprocess.Popen]:
    """Launch every rank's worker; returns the processes, rank order."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # The ranks import what this process can (a MODULE:FUNCTION given by module name, say).
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in sys.path if p and os.path.isdir(p)])
    procs = []
    for rank in range(world):
        log = open(os.path.join(workdir, f"rank-{rank}.log"), "wb")
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autopar.verification.worker", workdir, str(rank), str(world), str(port)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd()))
        finally:
            log.close()
    return procs


def stop_ranks(procs: list[subprocess.Popen]) -> None:
    """Kill the ranks still running (only these processes, started here) and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _errors(workdir: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(workdir)):
        if name.startswith("error-") and name.endswith(".json"):
            with open(os.path.join(workdir, name), encoding="utf-8") as fh:
                out.append(json.load(fh))
    return sorted(out, key=lambda e: e["rank"])


def _log_tail(workdir: str, rank: int, lines: int = 15) -> str:
    try:
        with open(os.path.join(workdir, f"rank-{rank}.log"), encoding="utf-8", errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


def wait_ranks(procs: list[subprocess.Popen], workdir: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Rank 0's result once every rank exited 0; raise on a refusal, a crash or the timeout."""
    deadline = time.monotonic() + timeout
    failed_at, first = None, None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None:
                first = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                failed_at = now if first is not None else None
            if failed_at is not None and now - failed_at > _GRACE_S:
                break
            if now > deadline:
                raise RankFailure(f"autopar: the {len(procs)} ranks did not finish within {timeout:.0f} s; "
                                  "try fewer --steps or --layers, or a larger timeout.\n"
                                  f"rank 0's output ends:\n{_log_tail(workdir, 0)}")
            time.sleep(_POLL_S)
    finally:
        stop_ranks(procs)
    errors = _errors(workdir)
    refused = [e for e in errors if e["refused"]]
    if refused:
        raise AutoparError(refused[0]["message"])
    if errors:  # the rank that failed first; the others often fail because it left
        e = next((e for e in errors if e["rank"] == first), errors[0])
        raise RankFailure(f"autopar: rank {e['rank']} of the parallel run raised {e['type']}: {e['message']}\n"
                          f"{e['traceback']}")
    bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        rank, code = bad[0]
        raise RankFailure(f"autopar: rank {rank} of the parallel run exited with status {code} without a "
                          f"report (killed, or out of memory?); its output ends:\n{_log_tail(workdir, rank)}")
    return torch.load(os.path.join(workdir, "result.pt"), weights_only=True)
