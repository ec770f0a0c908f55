"""Start the ranks of ``autopar verify`` as local gloo processes, and collect what they wrote.

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
import socket
import subprocess
import sys
import time

import torch

from autopar.errors import AutoparError

__all__ = ["RankFailure", "free_port", "stop_processes", "start_ranks", "stop_ranks", "wait_ranks", "DEFAULT_TIMEOUT_S"]

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
