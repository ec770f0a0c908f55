"""The default process group under torchrun, fresh on every start of the workers, with a timeout.

:func:`autopar.runtime.api.init_distributed` calls :func:`init_process_group` here.

**Why a restart failed** (``Gloo connectFullMesh failed ... Connection refused`` after
``torchrun --max-restarts=N --rdzv-backend=c10d`` restarted its workers).  Under the c10d
rendezvous, torchrun's agent of node rank 0 hosts one TCPStore server for the workers and keeps
it for the whole job: every restart hands the new workers the same ``MASTER_PORT`` with
``TORCHELASTIC_USE_AGENT_STORE=True``, and torch's ``env://`` rendezvous then connects them to
that store without a per-attempt prefix (torch 2.13, ``rendezvous._create_c10d_store``: "we
create a new TCPStore for every retry", which the dynamic rendezvous no longer does: it
creates the server once, ``_shared_tcp_store_server``).  The dead workers' keys are still
there: gloo's listening address of every rank (``default_pg/0//cpu//0/<rank>``; NCCL's unique
id likewise).  A restarted rank finds its peer's key at once, as the dead peer left it, and
connects to a port nobody listens on: connection refused.  (Seen by listing the store's keys
in a restarted worker before ``init_process_group``: the previous attempt's 12 keys were there.)

``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each agent counts its own restarts,
and an agent restarting its workers because another node failed or joined keeps its count,
so the ranks of one attempt may hold different counts and one agent's new workers the count
of its old ones.

**The fix**: the ranks of an attempt agree on a fresh random token and the process group
lives under ``autopar/<token>/`` in the store, where no earlier attempt wrote.  Agreeing
through a store full of old keys needs care, since any key may be stale: each rank ``r > 0``
writes a fresh random nonce under ``hello/r``; rank 0 (one per attempt) draws the token and
answers every rank with ``echo/r = <the hello it read>:<token>``, re-reading and re-answering
until every rank acknowledged.  A rank takes the token only from an echo carrying its own
fresh nonce, which no earlier attempt can have written; it then counts itself in
``<token>/acks``, a key of the fresh namespace, which rank 0 waits on.  Outside torchelastic
(``MASTER_ADDR``/``MASTER_PORT`` of one's own, rank 0 hosting a new store) this is not needed
and torch's own ``env://`` rendezvous runs.  Launching torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids the stale store too (a new store each round).

**Timeout**: every collective of the default group and of the groups made after it raises
after ``timeout`` instead of waiting forever on a dead or stuck peer (``new_group`` would not
inherit it: :func:`autopar.compat.set_default_group_timeout` makes it the default of the groups
made later); :mod:`autopar.runtime.faults` turns that into an ``autopar:`` error naming the rank
and the collective.
"""
from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

from autopar.compat import set_default_group_timeout
from autopar.errors import AutoparError

__all__ = ["DEFAULT_TIMEOUT", "init_process_group", "attempt_token", "as_timedelta"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective waits for its peers before raising (torch's NCCL default; gloo's is 30 min)."""

_ROOT = "autopar/attempt"
_POLL_S = 0.02


def as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    """``timeout`` (seconds, a timedelta, or None for :data:`DEFAULT_TIMEOUT`) as a positive timedelta."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    value = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise AutoparError(f"autopar: init_distributed(timeout={timeout!r}); expected a positive number of "
                           "seconds or a datetime.timedelta.")
    return value


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group(backend)`` from torchrun's environment, under a fresh store
    namespace when the store is torchrun's agent store (the module docstring)."""
    set_default_group_timeout(timeout)  # the mesh's groups too, not only the default group
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)
    token = attempt_token(store, rank, world_size, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/{token}/", store), rank=rank,
                            world_size=world_size, timeout=timeout)


def attempt_token(store, rank: int, world_size: int, timeout: datetime.timedelta) -> str:
    """A token drawn by rank 0 of this attempt, the same on every rank, never one an earlier
    attempt used in ``store`` (collective over the store: every rank calls it)."""
    if world_size == 1:
        return uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        return _lead(store, world_size, uuid.uuid4().hex, deadline)
    nonce = uuid.uuid4().hex
    store.set(f"{_ROOT}/hello/{rank}", nonce)
    echo = f"{_ROOT}/echo/{rank}"
    while True:
        if store.check([echo]):
            seen, _, token = store.get(echo).decode().partition(":")
            if seen == nonce:  # rank 0 answered this process, not an earlier one
                store.add(f"{_ROOT}/{token}/acks", 1)
                return token
        _wait_or_fail(deadline, lambda: f"rank {rank} got no answer from rank 0")


def _lead(store, world_size: int, token: str, deadline: float) -> str:
    """Rank 0: answer every rank's hello with the token until all ``world_size - 1`` acknowledged."""
    hellos = [f"{_ROOT}/hello/{r}" for r in range(1, world_size)]
    answered: dict[str, bytes] = {}
    acks = f"{_ROOT}/{token}/acks"
    while store.add(acks, 0) < world_size - 1:
        present = [k for k in hellos if store.check([k])]
        values = store.multi_get(present) if present else []
        # Answer what was read, stale or fresh: only a fresh nonce's owner will accept it.
        fresh = [(k, v) for k, v in zip(present, values) if answered.get(k) != v]
        if fresh:
            store.multi_set([k.replace("/hello/", "/echo/") for k, _ in fresh],
                            [v + b":" + token.encode() for _, v in fresh])
            answered.update(fresh)
        _wait_or_fail(deadline, lambda: f"rank 0 heard from {store.add(acks, 0)} of the {world_size - 1} other ranks")
    return token


def _wait_or_fail(deadline: float, what) -> None:
    if time.monotonic() > deadline:
        raise AutoparError(f"autopar: the ranks did not meet within init_distributed's timeout: {what()}; "
                           "expected every rank of the job to start; check that all torchrun agents run, "
                           "or raise init_distributed(timeout=...).")
    time.sleep(_POLL_S)
