"""How gradients pack into the buckets of their collectives, and how the runtime holds them.

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations

from typing import Sequence


__all__ = ["DEFAULT_BUCKET_BYTES", "pack_buckets", "grads_kept", "ZERO_SCATTERS_IN_FLIGHT"]


# ---- gradient buckets -------------------------------------------------------------------------

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""The default cap on a gradient bucket's local bytes (``parallelize(bucket_bytes=)``,
``estimate(bucket_bytes=)``)."""


def pack_buckets(sizes: Sequence[int], cap: int) -> list[range]:
    """The gradient buckets of tensors of ``sizes`` local bytes, in the order they are packed
    (backward's: reverse parameter order), as ranges of their indices.

    Greedy and in order: a bucket takes the next tensor unless that would take it past ``cap``
    bytes, then the next bucket starts with that tensor (a tensor bigger than ``cap`` is a bucket
    of its own).  ``passes/data_parallel.py`` packs the program's buckets with it and
    ``cost/buckets.py`` counts them from a ``ModelSpec``."""
    out: list[range] = []
    start, size = 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and size + nbytes > cap:
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if len(sizes) > start:
        out.append(range(start, len(sizes)))
    return out


def grads_kept(zero, dp, cp):
    """Whether a rank keeps its whole gradients all step, the forward before the first backward
    included: plain data parallelism (``dp*cp >= 2``) accumulates into persistent bucket buffers of
    which the gradients are views (DDP's ``gradient_as_bucket_view``; runtime/gradients/grad_sync.py).
    Otherwise backward makes the gradients and the step frees them (one rank, tp or pp alone;
    ZeRO-1's flat buffers are made at each unit's first gradient, runtime/gradients/zero_grads.py ``KeptGrads``;
    ZeRO-2/3 keep only their shards').  The cost model's peak timeline (cost/memory.py) and the
    runtime's flat optimizer (runtime/gradients/grad_sync.py, runtime/gradients/fused_step.py) ask it."""
    return (zero == 0) & (dp * cp >= 2)


ZERO_SCATTERS_IN_FLIGHT = 1
"""ZeRO-1/2: gradient reduce-scatters in flight at once; starting another first waits for the
oldest (runtime/gradients/zero_grads.py), so backward holds at most that many units' buffers beyond the one
being filled (ZeRO-2), and a backend that copies a collective's buffer (gloo) that many copies
(cost/memory.py ``zero_sync_buffer``, ``collective_copies``).  One, as FSDP2 (which waits for a
reduce-scatter before it issues the next): the one in flight runs while backward computes the
next unit's gradients, and a second would hold another unit's buffer for no more overlap once
the collective takes less than a unit's backward."""
