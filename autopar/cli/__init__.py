"""Command-line entry point: ``autopar inspect | plan | explain | report | verify | calibrate``.

``inspect`` (autopar/cli/inspect_cmd.py) prints a rank's generated program; ``plan`` and
``explain`` (autopar/cli/plan_cmd.py, their tables in cost_tables.py) run the offline cost model and search, and
``explain --measure`` (autopar/cli/measure_cmd.py) sets the memory one step measures on local
gloo processes against the prediction; ``report`` (autopar/cli/report_cmd.py) writes one plan's
page as self-contained HTML (``plan --report DIR`` the top plans' index too); ``verify``
(autopar/cli/verify_cmd.py) proves a plan on CPU gloo processes against one process; ``calibrate``
(autopar/cli/calibrate_cmd.py, its one-rank kernels in calibrate_kernels.py) measures this machine
(matrix products, memory bandwidth, collectives on local ranks) and writes a hardware profile,
which ``plan --hardware PROFILE`` and ``explain --hardware PROFILE`` use instead of a GPU preset's
published figures.  An ``autopar:`` error ends a command with one line on stderr and exit status 2
(once per job under torchrun: autopar/error_report.py).
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main", "version"]

_DESCRIPTION = ("autopar: turn an unmodified PyTorch model into a distributed training program. "
                "Plan and explain need no GPU and no torch, report no GPU; inspect and verify compile the "
                "model on this machine's CPU.")


def version() -> str:
    """The installed distribution's version (importlib.metadata), or a note that none is installed."""
    from importlib import metadata

    try:
        return metadata.version("autopar")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    """The ``autopar`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="autopar", description=_DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"autopar {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from autopar.cli import calibrate_cmd, inspect_cmd, plan_cmd, report_cmd, verify_cmd

    inspect_cmd.register(sub)
    plan_cmd.register(sub)
    report_cmd.register(sub)
    verify_cmd.register(sub)
    calibrate_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # AutoparError and plan validation errors
        from autopar.error_report import report_error

        return report_error(exc)


if __name__ == "__main__":
    sys.exit(main())
