"""Pipeline: layer placement over stages, micro-batches in flight, P2P calls, bubble.

Placement: the ``pp * chunks`` model chunks (``chunks`` = vpp for interleaved, 2 for the
V-shaped zbv / dualpipev, else 1) take consecutive layers. Chunk ``c`` lives on rank
``c % pp`` (interleaved) or, for V shapes, on rank ``c`` going down and ``2pp - 1 - c``
coming back, so rank 0 holds both the first and the last chunk. Layer counts need not
divide: they are balanced by cost, the LM head (and loss) counting as ``x`` layers on the
last chunk, remaining layers going to the middle chunks first so that the first pp rank,
which holds the most micro-batches in flight, stays light.

Micro-batches of activations in flight on rank ``i`` (in units of the rank's layers):
  gpipe        m
  1f1b         min(pp - i, m)
  interleaved  min((v - 1)*r + 2*(pp - i - 1) + 1, m*v) / v       (Megatron's warm-up, with
               r = m // max(1, m // pp) micro-batches per round: torch's ScheduleInterleaved1F1B
               runs m that pp does not divide in rounds of r; r = pp when pp divides m)
  zbv          min(pp, m)        (ZB-V keeps 1F1B's peak)
  dualpipev    min(pp + 1/2, m)  (2pp half-size chunks warmed up on every rank, + 1 in F&B)
Bubble, with T_f, T_b the per-micro-batch forward and backward time of the slowest rank
(T_w the weight-gradient share of T_b):
  gpipe, 1f1b   (pp - 1)(T_f + T_b)
  interleaved   (pp - 1)(T_f + T_b)/v
  zbv           (pp - 1) * max(T_f + T_b - 3 T_w, 0) / 2      (ZB-V: (p-1)(F + B - 2W) per chunk)
  dualpipev     (pp - 1) * max(T_f + 2 T_b - 3 T_w, 0) / 2    (DualPipe: (F&B + B - 3W) per chunk,
                                                                B a full backward, F&B ~ F + B)
and step = m (T_f + T_b) + bubble.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import sympy

from autopar.plan_space import among, chunk_rank, chunks_per_rank, code

__all__ = ["StageView", "place_layers", "stage_views", "inflight", "bubble_expr", "T_f", "T_b", "T_w"]

T_f, T_b, T_w = sympy.symbols("T_f T_b T_w", nonnegative=True)


@dataclass(frozen=True)
class StageView:
    pp_rank: int       # pipeline rank
    dense: int         # dense layers on the rank
    moe: int           # MoE layers on the rank
    first: int         # holds the embedding
    last: int          # holds the LM head
    sends: int         # forward P2P sends per micro-batch
    recvs: int         # forward P2P receives per micro-batch
    layers: tuple[int, ...]  # layer indices, in model order


def place_layers(num_layers: int, num_chunks: int, head_layers: float) -> list[int]:
    """Layers per chunk, balanced by cost with the head worth ``head_layers`` layers."""
    if num_chunks == 1:
        return [num_layers]
    if num_layers < num_chunks:
        raise ValueError(f"autopar: {num_layers} layers cannot fill {num_chunks} pipeline chunks")
    target = (num_layers + head_layers) / num_chunks
    last = int(min(max(round(target - head_layers), 1), num_layers - (num_chunks - 1)))
    rest = num_layers - last
    base, extra = divmod(rest, num_chunks - 1)
    counts = [base] * (num_chunks - 1)
    # Remainder to the middle chunks first (never the first chunk unless nothing else is left).
    order = list(range(1, num_chunks - 1)) + [0]
    for i in range(extra):
        counts[order[i % len(order)]] += 1
    if min(counts) < 1:
        raise ValueError("autopar: pipeline placement left a chunk without layers")
    return counts + [last]


@lru_cache(maxsize=4096)
def _views(moe_flags: tuple[bool, ...], pp: int, schedule: str, vpp: int, head_layers: float):
    nchunks = pp * chunks_per_rank(schedule, vpp)
    counts = place_layers(len(moe_flags), nchunks, head_layers)
    layers: list[list[int]] = [[] for _ in range(pp)]
    first_rank = chunk_rank(0, pp, schedule)
    last_rank = chunk_rank(nchunks - 1, pp, schedule)
    start = 0
    sends = [0] * pp
    recvs = [0] * pp
    for c, n in enumerate(counts):
        r = chunk_rank(c, pp, schedule)
        layers[r].extend(range(start, start + n))
        start += n
        if c + 1 < nchunks and chunk_rank(c + 1, pp, schedule) != r:
            sends[r] += 1
            recvs[chunk_rank(c + 1, pp, schedule)] += 1
    views = []
    for r in range(pp):
        idx = tuple(sorted(layers[r]))
        moe = sum(1 for i in idx if moe_flags[i])
        views.append(StageView(r, len(idx) - moe, moe, int(r == first_rank), int(r == last_rank),
                               sends[r], recvs[r], idx))
    return tuple(views)


def stage_views(spec, pp: int, schedule: str, vpp: int, head_layers: float) -> tuple[StageView, ...]:
    """One view per pipeline rank (layers, embedding/head, P2P calls)."""
    flags = tuple(spec.is_moe_layer(i) for i in range(spec.num_layers))
    return _views(flags, pp, schedule, vpp, round(float(head_layers), 3))


def inflight(schedule, pp, vpp, pp_rank, m):
    """Micro-batches of pipeline rank ``pp_rank``'s activations held at the peak (see the module
    docstring).

    ``schedule`` is a name or an array of its codes (:func:`autopar.plan_space.encode`); the other
    arguments may be numpy arrays.
    """
    import numpy as np

    pp, vpp, pp_rank, m = (np.asarray(x, dtype=np.float64) for x in (pp, vpp, pp_rank, m))
    codes = np.asarray(code("schedule", schedule) if isinstance(schedule, str) else schedule)
    per_round = np.floor(m / np.maximum(1.0, np.floor(m / pp)))
    interleaved = np.minimum((vpp - 1) * per_round + 2 * (pp - pp_rank - 1) + 1, m * vpp) / vpp
    held = np.select(
        [among(codes, "schedule", (name,)) for name in ("gpipe", "interleaved", "zbv", "dualpipev")],
        [m, interleaved, np.minimum(pp, m), np.minimum(pp + 0.5, m)],
        default=np.minimum(pp - pp_rank, m),
    )
    return np.where(pp == 1, np.minimum(1.0, m), held)


def bubble_expr(schedule: str):
    from .symbols import pp, vpp

    if schedule == "interleaved":
        return (pp - 1) * (T_f + T_b) / vpp
    if schedule == "zbv":
        return (pp - 1) * sympy.Max(T_f + T_b - 3 * T_w, 0, evaluate=False) / 2
    if schedule == "dualpipev":
        return (pp - 1) * sympy.Max(T_f + 2 * T_b - 3 * T_w, 0, evaluate=False) / 2
    return (pp - 1) * (T_f + T_b)
