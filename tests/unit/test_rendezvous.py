"""The attempt token of autopar/runtime/rendezvous.py, in one process: ranks as threads on one TCPStore.

A store that outlives its workers (torchrun's agent store) holds every earlier attempt's keys.
Each attempt's ranks must agree on one token, never an earlier attempt's, whatever order they
start in, and even when a rank of the earlier attempt died before answering.  The restart
under torchrun itself (gloo's mesh connecting after the workers were restarted) is
tests/e2e/test_fault_tolerance.py.
"""
from __future__ import annotations

import datetime
import random
import threading
import time

import pytest
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.rendezvous import as_timedelta, attempt_token

TIMEOUT = datetime.timedelta(seconds=20)


def _attempt(port: int, world: int, delays: list[float]) -> list[str]:
    """Every rank's token, rank r starting after ``delays[r]`` seconds, each with its own client."""
    tokens: list = [None] * world
    errors: list = []

    def rank(r: int) -> None:
        try:
            time.sleep(delays[r])
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
            tokens[r] = attempt_token(store, r, world, TIMEOUT)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return tokens


def test_every_attempt_agrees_on_a_fresh_token():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    rng = random.Random(0)
    seen = set()
    # Rank 0 first, rank 0 last, shuffled: the earlier attempts' hellos and echoes are in the store.
    for delays in ([0.0, 0.2, 0.4, 0.1], [0.5, 0.0, 0.1, 0.0], [rng.uniform(0, 0.3) for _ in range(4)],
                   [0.0, 0.0, 0.0, 0.0]):
        tokens = _attempt(server.port, 4, delays)
        assert len(set(tokens)) == 1, tokens
        assert tokens[0] not in seen  # never an earlier attempt's token
        seen.add(tokens[0])
    # A smaller world after a node was lost, on the same store: its ranks agree too.
    tokens = _attempt(server.port, 2, [0.3, 0.0])
    assert len(set(tokens)) == 1 and tokens[0] not in seen


def test_a_rank_that_never_comes_fails_within_the_timeout():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    start = time.monotonic()
    with pytest.raises(AutoparError, match=r"^autopar: the ranks did not meet within init_distributed's timeout: "
                                           r"rank 0 heard from 0 of the 1 other ranks"):
        attempt_token(store, 0, 2, datetime.timedelta(seconds=1))
    assert time.monotonic() - start < 10


def test_timeouts():
    assert as_timedelta(None) == datetime.timedelta(minutes=10)
    assert as_timedelta(2.5) == datetime.timedelta(seconds=2.5)
    with pytest.raises(AutoparError, match=r"^autopar: init_distributed\(timeout=0\); expected a positive"):
        as_timedelta(0)
