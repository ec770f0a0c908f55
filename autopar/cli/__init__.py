"""Command-line entry point: ``autopar inspect | plan | explain | verify | calibrate``.

``inspect`` (autopar/cli/inspect_cmd.py) prints a rank's generated program; ``plan`` and
``explain`` (autopar/cli/plan_cmd.py, their tables in cost_tables.py) run the offline cost model and search, and
``explain --measure`` (autopar/cli/measure_cmd.py) sets the memory one step measures on local
gloo processes against the prediction; ``verify`` (autopar/cli/verify_cmd.py) proves a plan
on CPU gloo processes against one process; ``calibrate`` (autopar/cli/calibrate_cmd.py, its
one-rank kernels in calibrate_kernels.py) measures this machine (matrix products, memory
bandwidth, collectives on local ranks) and writes a hardware profile, which ``plan --hardware
PROFILE`` and ``explain --hardware PROFILE`` use instead of a GPU preset's published figures.
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from autopar.cli import calibrate_cmd, inspect_cmd, plan_cmd, verify_cmd

    inspect_cmd.register(sub)
    plan_cmd.register(sub)
    verify_cmd.register(sub)
    calibrate_cmd.register(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # AutoparError and plan validation errors
        msg = str(exc)
        print(msg if msg.startswith("autopar:") else f"autopar: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
