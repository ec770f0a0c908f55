"""One rank of ``autopar verify``: ``python -m autopar.verification.worker WORKDIR RANK WORLD PORT``.

Started by :mod:`autopar.verification.launch`, once per rank, all ranks at once.  It does what a
user's training script does: join the gloo world, build the model (the parent's initial
weights, from ``WORKDIR/init.pt``), ``parallelize`` it for the plan, and ``train_step`` the
shared batches (:mod:`autopar.verification.sources`).  After ``parallelize`` and after every
step it takes ``pm.state_dict()`` (full tensors, collective); rank 0 writes the losses and
those state dicts to ``WORKDIR/result.pt``.  A rank that fails writes ``WORKDIR/error-RANK.json``
(``refused`` when the error is an ``autopar:`` refusal) and exits 1.

The ``corrupt`` testing hook (``autopar verify --corrupt NAME``) doubles the gradient of
parameter ``NAME`` on the lowest rank that holds it, before gradient synchronisation, so that
a test can watch verify catch a wrong program.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.verification.sources import OPTIMIZERS, make_batches, next_token_loss, seeded_steps

__all__ = ["main", "GLOO_TIMEOUT_S", "CORRUPT_FACTOR"]

GLOO_TIMEOUT_S = 120.0
CORRUPT_FACTOR = 2.0


def _graph_parameter(pm, name: str) -> str | None:
    """The compiled program's name for the user's parameter ``name``: the traced module holds the
    model under a prefix (``model.<name>``), so the one graph parameter whose name ends in it."""
    found = [g for g, _ in pm.gm.named_parameters() if g == name or g.endswith("." + name)]
    return found[0] if len(found) == 1 else None


def _corrupt(pm, name: str) -> int | None:
    """Double ``name``'s gradient on the lowest rank holding it; returns that rank (None: no rank)."""
    graph_name = _graph_parameter(pm, name)
    holds = [False] * dist.get_world_size()
    dist.all_gather_object(holds, graph_name is not None and pm.holds(graph_name))
    if True not in holds:
        return None
    rank = holds.index(True)
    if dist.get_rank() == rank:
        pm.gm.get_parameter(graph_name).register_hook(lambda grad: grad * CORRUPT_FACTOR)
    return rank


def _log(what: str, start: float) -> None:
    print(f"[verify rank {dist.get_rank()}] {what} at {time.perf_counter() - start:.1f} s", flush=True)


def run(job: dict, init: dict, rank: int, start: float) -> dict | None:
    """Parallelize and train as the job says; rank 0 returns the losses and state dicts."""
    from autopar.runtime import parallelize  # what a user calls, once the process group is up

    model, kwargs = job["source"].build(job["seed"])
    model.load_state_dict(init)
    _log("model built", start)
    batches = make_batches(job["vocab"], job["batch"], job["seq"], job["steps"], job["seed"])
    pm = parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=job["plan"],
                     loss_fn=next_token_loss, optimizer=OPTIMIZERS[job["optimizer"]])
    _log("parallelized", start)
    corrupted = _corrupt(pm, job["corrupt"]) if job.get("corrupt") else None
    if job.get("corrupt") and corrupted is None:
        raise AutoparError(f"autopar: --corrupt {job['corrupt']} is no parameter of the compiled program "
                           "(a weight tied to another is stored once, under the first name); give another name "
                           "from the model's named_parameters().")
    states = [_cpu(pm.state_dict())]
    losses = []
    with seeded_steps(job["seed"]):  # the reference's random draws (api._reference)
        for inputs, target in batches:
            losses.append(pm.train_step(inputs, target))
            states.append(_cpu(pm.state_dict()))
    _log(f"{len(batches)} steps done", start)
    if rank != 0:
        return None
    return {"losses": losses, "states": states, "corrupted_rank": corrupted}


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def main(argv: list[str]) -> int:
    workdir, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    start = time.perf_counter()  # after torch's import: the log's times are from here
    try:
        torch.set_num_threads(1)
        job = torch.load(os.path.join(workdir, "job.pt"), weights_only=False)
        init = torch.load(os.path.join(workdir, "init.pt"), weights_only=True)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        _log("joined the gloo world", start)
        result = run(job, init, rank, start)
        if result is not None:
            torch.save(result, os.path.join(workdir, "result.tmp"))
            os.replace(os.path.join(workdir, "result.tmp"), os.path.join(workdir, "result.pt"))
        dist.barrier()
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which explains it
        refused = isinstance(exc, AutoparError) or str(exc).startswith("autopar:")
        with open(os.path.join(workdir, f"error-{rank}.json"), "w", encoding="utf-8") as fh:
            json.dump({"rank": rank, "refused": refused, "message": str(exc) or type(exc).__name__,
                       "type": type(exc).__name__, "traceback": traceback.format_exc()}, fh)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
