"""Spawning gloo ranks for a benchmark: one call runs a worker on every rank and returns rank 0's result.

Not a benchmark.  A multi-rank benchmark (``ep_dispatch.py``, ``sp_slices.py``) writes its
measurement as ``worker(rank, world, *args) -> result`` at module level (it is pickled into the
spawned processes); :func:`run_ranks` spawns the ranks once (autopar's local launcher,
:func:`autopar.verification.launch.run_spawned`), each with one compute thread and a gloo process
group over this machine's loopback, and hands back what rank 0 returned.  Steps timed across ranks
use :func:`slowest`: a barrier, the call, then the slowest rank's wall time.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "run_ranks", "slowest"]


def _entry(rank: int, world: int, port: int, worker, args: tuple, *, post):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return worker(rank, world, *args)


def run_ranks(worker, world: int, *args, timeout: float | None = None):
    """``worker(rank, world, *args)`` on ``world`` spawned gloo ranks; rank 0's return value (the
    one local launcher: :func:`autopar.verification.launch.run_spawned`; ``timeout``: its default)."""
    from autopar.verification.launch import run_spawned

    limit = {} if timeout is None else {"timeout": timeout}
    return run_spawned(_entry, world, (worker, args), what=f"running {worker.__name__}", **limit)[0]


def slowest(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``: started after a barrier, timed as the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return out, float(elapsed)


def size_arguments(parser, **defaults: int):
    """Integer options ``--NAME`` (dashes for underscores) with their defaults, for a benchmark's
    model and run sizes: ``size_arguments(parser, steps=20, hidden=256)``."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    return parser
