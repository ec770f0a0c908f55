"""An ``autopar:`` error that ends a program: one line, once per job, also under torchrun.

Under ``torchrun`` every rank meets the same bad plan, and each printing its traceback buries the one line
that matters under N copies and torchrun's ``ChildFailedError``.  :func:`report_error` makes it one line:
the first rank of the node to report an error (it creates a marker file named after its torchrun agent)
is the one that speaks; the others exit quietly with the same status.  Under torchrun the line goes into
the rank's error file (``$TORCHELASTIC_ERROR_FILE``, the format of torch's elastic ``ErrorHandler``), so
torchrun's summary names it as the root cause; the other ranks' error files say that they stopped too,
one second later, so that torchrun picks the first as the root cause.  Outside torchrun the line goes to
stderr.  A rank whose error differs from the first one's prints its own line as well.

:func:`exit_on_error` runs a script's ``main`` under this rule (examples/*.py); the ``autopar`` command
(autopar/cli/__init__.py) calls :func:`report_error` itself.  Torch-free: the offline commands use it.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Callable

__all__ = ["report_error", "exit_on_error", "EXIT_STATUS"]

EXIT_STATUS = 2
"""The exit status of a program ended by an ``autopar:`` error (the CLI's too)."""


def _message(exc: BaseException) -> str:
    msg = str(exc).strip()
    return msg if msg.startswith("autopar:") else f"autopar: {msg}"


def _marker() -> str:
    """A file shared by the ranks of one torchrun agent and attempt (they are its children)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.path.join(tempfile.gettempdir(), f"autopar-error-{os.getppid()}-{run}-{attempt}.json")


def _claim(marker: str, message: str, stamp: int) -> dict | None:
    """Create the marker with this rank's error; None when this rank is first, else the first's record."""
    rank = os.environ.get("RANK", "0")
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        for _ in range(50):  # the first rank writes its record right after creating the file
            try:
                with open(marker, encoding="utf-8") as f:
                    return json.load(f)
            except (OSError, ValueError):
                time.sleep(0.01)
        return {"rank": "?", "message": "", "timestamp": stamp}
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "message": message, "timestamp": stamp}, f)
    return None


def _write_error_file(path: str, message: str, stamp: int) -> None:
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(stamp)}}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def report_error(exc: BaseException) -> int:
    """Report ``exc`` as one ``autopar:`` line (once per job under torchrun) and return the exit status."""
    message = _message(exc)
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in os.environ:
        print(message, file=sys.stderr, flush=True)
        return EXIT_STATUS
    stamp = int(time.time())
    first = _claim(_marker(), message, stamp)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if first is None:
        if error_file:
            _write_error_file(error_file, message, stamp)
        else:
            print(message, file=sys.stderr, flush=True)
        return EXIT_STATUS
    if first.get("message") != message:  # a different error: it is news, say it too
        print(f"rank {os.environ['RANK']}: {message}", file=sys.stderr, flush=True)
    if error_file:
        _write_error_file(error_file, f"stopped after rank {first.get('rank')}'s error (the root cause)",
                          max(stamp, int(first.get("timestamp", stamp))) + 1)
    return EXIT_STATUS


def exit_on_error(main: Callable[[], int | None]) -> int:
    """Run ``main()``; an ``autopar:`` error (``AutoparError``, or a ``ValueError`` saying ``autopar:``)
    ends it through :func:`report_error`.  Returns the exit status for ``sys.exit``."""
    from autopar.errors import AutoparError

    try:
        return int(main() or 0)
    except ValueError as exc:
        if not isinstance(exc, AutoparError) and not str(exc).startswith("autopar:"):
            raise
        return report_error(exc)
