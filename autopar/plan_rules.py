"""The rules of plan options that more than one part of autopar needs: their one home.

The option names (:data:`SCHEDULES`, :data:`CP_VARIANTS`, :data:`RECOMPUTE_MODES`), how many
model chunks a pipeline rank holds and where each chunk runs, which micro-batch counts each
pipeline schedule runs, and which head counts Ulysses can split.  :mod:`autopar.plan`
re-exports all of it; the cost model (``autopar.cost``), the search
(:mod:`autopar.planning.search`), the graph passes and the runtime ops import it from there
(or from here) instead of restating it.

Torch-free and numpy-free: the offline tools import it.  Where a docstring says so, a rule
also takes numpy arrays (it uses only arithmetic, comparisons and ``&``).

An integer code of a name (as the vectorised cost model and search store plans) is its
index in the tuple that lists it, e.g. ``SCHEDULES.index("zbv")``.
"""
from __future__ import annotations

from autopar.errors import AutoparError

__all__ = ["CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "V_SCHEDULES", "MULTI_CHUNK_SCHEDULES",
           "SPLIT_BACKWARD_SCHEDULES",
           "chunks_per_rank", "chunk_rank", "micro_batches_ok", "valid_micro_batches",
           "check_micro_batches", "ulysses_heads_ok", "ulysses_fits"]

CP_VARIANTS = ("ring", "allgather", "ulysses")
"""Context-parallel attention variants (``cp=N:<variant>``)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
"""Pipeline schedules (``pp=N:<schedule>``)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation modes (``recompute=<mode>``)."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that run exactly two model chunks per rank, placed in a "V"."""
MULTI_CHUNK_SCHEDULES = ("interleaved",) + V_SCHEDULES
"""Schedules that hold several model chunks per rank (the others hold one)."""
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that split a backward into input gradients, then weight gradients: two autograd
passes per chunk and micro-batch (each recomputes a checkpointed region again)."""


def chunks_per_rank(schedule: str, vpp: int) -> int:
    """Model chunks each pipeline rank holds: ``vpp`` for interleaved, 2 for zbv and
    dualpipev (the V shape), else 1."""
    if schedule == "interleaved":
        return vpp
    return 2 if schedule in V_SCHEDULES else 1


def chunk_rank(c: int, pp: int, schedule: str) -> int:
    """Pipeline rank of model chunk ``c``: looped (``c % pp``), or for zbv / dualpipev
    V-shaped (rank ``c`` going down, ``2pp - 1 - c`` coming back, so rank 0 holds the first
    and the last chunk)."""
    if schedule in V_SCHEDULES:
        return c if c < pp else 2 * pp - 1 - c
    return c % pp


# ---- micro-batch counts the schedules accept (torch.distributed.pipelining 2.13) -----------

def micro_batches_ok(schedule: str, pp, mb):
    """Whether ``schedule`` on ``pp > 1`` stages runs ``mb`` micro-batches per step.

    At least one micro-batch; 1f1b needs ``mb >= pp``; interleaved a multiple of its rounds
    (``max(1, mb // pp)``, as torch's ScheduleInterleaved1F1B runs them); dualpipev
    ``mb >= 2 pp`` (one per chunk); gpipe and zbv run any count. ``pp`` and ``mb`` may be
    numpy integer arrays (the result is then a boolean array).
    """
    some = mb >= 1
    if schedule == "1f1b":
        return some & (mb >= pp)
    if schedule == "interleaved":
        rounds = mb // pp
        rounds = rounds + (rounds == 0)  # max(1, mb // pp), for ints and arrays alike
        return some & (mb % rounds == 0)
    if schedule == "dualpipev":
        return some & (mb >= 2 * pp)
    return some


def valid_micro_batches(schedule: str, pp: int, mb: int) -> list[int]:
    """The nearest micro-batch counts below and above ``mb`` that ``schedule`` runs."""
    out = []
    below = next((m for m in range(mb - 1, 0, -1) if micro_batches_ok(schedule, pp, m)), None)
    above = next(m for m in range(mb + 1, mb + 4 * pp + 2) if micro_batches_ok(schedule, pp, m))
    if below is not None:
        out.append(below)
    out.append(above)
    return out


def check_micro_batches(plan) -> None:
    """Raise an ``autopar:`` error naming the nearest valid counts when ``plan``'s pipeline
    schedule does not run ``plan.mb`` micro-batches (:func:`micro_batches_ok`)."""
    if plan.pp > 1 and not micro_batches_ok(plan.schedule, plan.pp, plan.mb):
        rule = {"1f1b": f"at least pp={plan.pp} micro-batches",
                "interleaved": f"a micro-batch count that is a multiple of its rounds (mb // pp = {max(1, plan.mb // plan.pp)})",
                "dualpipev": f"at least 2*pp={2 * plan.pp} micro-batches (one per chunk)"}[plan.schedule]
        near = " or ".join(f"mb={m}" for m in valid_micro_batches(plan.schedule, plan.pp, plan.mb))
        raise AutoparError(f"autopar: schedule '{plan.schedule}' with pp={plan.pp} needs {rule}, "
                           f"got mb={plan.mb}; use {near}.")


# ---- Ulysses head split ------------------------------------------------------------------

def ulysses_heads_ok(num_heads: int, tp: int, cp: int) -> bool:
    """Whether Ulysses can split ``num_heads`` heads (query or key/value) of a layer.

    Its all-to-all hands each cp rank whole heads of the heads a tp rank holds, so
    ``tp * cp`` must divide the count; for heads already local to a tp rank pass ``tp=1``.
    """
    return num_heads % (tp * cp) == 0


def ulysses_fits(num_heads: int, num_kv_heads: int, tp: int, cp: int) -> bool:
    """Whether ``cp=N:ulysses`` under ``tp`` splits both the query and the KV heads
    (:func:`ulysses_heads_ok` for each)."""
    return ulysses_heads_ok(num_heads, tp, cp) and ulysses_heads_ok(num_kv_heads, tp, cp)
