"""Worker scripts for tests/e2e/test_fault_tolerance.py, run under torchrun.  Not a test module.

    python -m torch.distributed.run ... tests/support/fault_worker.py restart autopar|torch
        init the default group (autopar's init_distributed, or torch's own init_process_group), build
        a mesh of the world's ranks, all-reduce, then fail on every rank in the first attempt; the restarted workers
        print ``attempt 1 connected`` (torch's own init cannot: they read the dead workers' addresses).
        (with torch's own init the restarted ranks other than 0 wait until rank 0's init is over: it
        can only find the dead workers' keys, whatever the timing)
    ... fault_worker.py hang
        2 ranks under dp=2 with init_distributed(timeout=5); rank 1 stops answering before step 3, rank 0
        must raise within the timeout, naming itself and the collective.
    ... fault_worker.py stall-save STEP RANK -- <examples/train_elastic.py arguments>
        examples/train_elastic.py, except that in the first attempt rank RANK's background write of the
        checkpoint of step STEP stops after writing part of its data (``stalled in the save of step N``),
        for the test to kill it there.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _line(text: str) -> None:
    """One line in one write (the ranks share torchrun's stdout; see examples/train_elastic.py)."""
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def _restart(which: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    import autopar

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if which == "autopar":
        if attempt > 0 and rank > 0:
            time.sleep(2)  # the restarted rank 0 comes first: it must not take an earlier attempt's keys
        autopar.init_distributed(timeout=60)
    elif attempt > 0 and rank > 0:
        # torch's own init, restarted: the other ranks hold back until rank 0's init is over, so that
        # rank 0 finds only what the dead workers left in torchrun's store (deterministically; in a
        # race the live ranks may overwrite the dead ones' addresses in time, or not).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        store.wait([f"control/rank0-done/{attempt}"])
        return 1
    else:
        try:  # bounded: a dead worker's port may have been taken by another listener, and then it waits
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
        except Exception as e:
            # Written before the other ranks are released: once they exit, torchrun may SIGTERM this
            # rank before its traceback reaches the log (seen on a loaded CI machine).
            _line(f"rank 0 init failed: {type(e).__name__}: {e}")
            raise
        finally:
            if attempt > 0:
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
                store.set(f"control/rank0-done/{attempt}", "1")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t.tolist() == [world * world] * 4
    if attempt == 0:
        time.sleep(0.5)
        return 1  # every worker fails: torchrun restarts them all
    _line(f"attempt {attempt} connected")
    dist.destroy_process_group()
    return 0


def _hang() -> int:
    import autopar
    from tests.support.harness import OPTIMIZERS, make_batches
    from tests.support.jobs import BATCH, SEQ, VOCAB, build

    autopar.init_distributed(timeout=5)
    model, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="dp=2",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    for step, batch in enumerate(batches):
        if step == 2 and dist.get_rank() == 1:
            _line("rank 1 stops answering")
            time.sleep(300)
        if dist.get_rank() == 0:
            _line(f"step {step + 1} starts at {time.time():.3f}")
        pm.train_step(*batch)
    return 0


def _stall_save(step: int, rank: int, argv: list[str]) -> int:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def stalling(self, plan, planner):
        future = write_data(self, plan, planner)
        if (f"step-{step:08d}" in str(self.path) and dist.get_rank() == rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"):
            future.wait()  # this rank's files are written; its results are not reported: the save hangs
            _line(f"stalled in the save of step {step}")
            time.sleep(600)
        return future

    FileSystemWriter.write_data = stalling
    spec = importlib.util.spec_from_file_location("train_elastic", REPO / "examples" / "train_elastic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def main(argv: list[str]) -> int:
    if argv[0] == "restart":
        return _restart(argv[1])
    if argv[0] == "hang":
        return _hang()
    if argv[0] == "stall-save":
        return _stall_save(int(argv[1]), int(argv[2]), argv[4:] if argv[3] == "--" else argv[3:])
    raise SystemExit(f"unknown mode {argv[0]!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
