"""Spawning gloo ranks for a benchmark: one call runs a worker on every rank and returns rank 0's result.

Not a benchmark.  A multi-rank benchmark (``ep_dispatch.py``, ``sp_slices.py``) writes its
measurement as ``worker(rank, world, *args) -> result`` at module level (it is pickled into the
spawned processes); :func:`run_ranks` spawns the ranks once, each with one compute thread, a gloo
process group over this machine's loopback and the repository root on ``sys.path`` (benchmarks
import ``tests.support`` models), and hands back what rank 0 returned.  Steps timed across ranks
use :func:`slowest`: a barrier, the call, then the slowest rank's wall time.
"""
from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "run_ranks", "slowest"]


def _entry(rank: int, world: int, port: int, worker, args: tuple, out_path: str) -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = worker(rank, world, *args)
        if rank == 0:
            Path(out_path).write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(worker, world: int, *args):
    """``worker(rank, world, *args)`` on ``world`` spawned gloo ranks; rank 0's return value."""
    from autopar.verification.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pickle")
        mp.spawn(_entry, args=(world, free_port(), worker, args, out), nprocs=world, join=True)
        return pickle.loads(Path(out).read_bytes())


def slowest(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``: started after a barrier, timed as the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return out, float(elapsed)
