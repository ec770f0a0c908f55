"""A collective that failed because a peer died or hangs, reported as an ``autopar:`` error.

With ``init_distributed(timeout=...)`` (:mod:`autopar.runtime.rendezvous`) no collective waits
forever: gloo raises at once when a peer's process is gone (its connection closes) and after
the timeout when a peer is alive but never comes; NCCL's watchdog aborts the process after the
timeout.  Torch's message names neither this rank nor the collective; :func:`named_failures`,
around ``train_step``, ``eval_step``, ``save`` and ``load`` of a
:class:`autopar.runtime.module.ParallelModule`, re-raises it saying which rank, in which step
and which collective (the last one the step recorded, :mod:`autopar.ops.collectives`), and
what to do.  The process then exits non-zero, and ``torchrun --max-restarts`` restarts the
workers, which resume from the newest checkpoint (docs/fault-tolerance.md).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from autopar.errors import AutoparError

__all__ = ["is_peer_failure", "named_failures"]

# What torch's backends say when a peer is gone or late (gloo's transport, NCCL, the store).
_MARKERS = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe",
            "Timed out", "timed out", "Socket Timeout", "NCCL", "Watchdog", "gloo/transport")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing on a dead, stuck or unreachable peer."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _MARKERS)


def _last_collective(pm) -> str:
    records = pm.step_context.recorder.records
    if not records:
        return "before any collective this step records (a process-group call of the runtime)"
    r = records[-1]
    return f"in or after {r.op} on axis '{r.axis}' ({r.group_size} ranks; {r.tag or r.phase})"


@contextlib.contextmanager
def named_failures(pm, action: str) -> Iterator[None]:
    """Re-raise a peer failure inside the block as an ``autopar:`` error naming this rank, the
    step and the collective; any other error passes unchanged."""
    try:
        yield
    except RuntimeError as exc:
        if not is_peer_failure(exc):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AutoparError(
            f"autopar: rank {rank} of {world} lost a peer in {action} (step {pm.num_steps_taken + 1}), "
            f"{_last_collective(pm)}: {first}; expected every rank of the group to reach the collective "
            "within init_distributed's timeout: a peer process died or hangs (its own log says why). "
            "This process exits; under torchrun --max-restarts the workers restart and resume from "
            "autopar.latest_checkpoint(dir) (docs/fault-tolerance.md).") from exc
