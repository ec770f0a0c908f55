"""Names of the plan options and their integer codes (the encoding the cost model and the search store plans in).

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations

from typing import Mapping

__all__ = ["CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "ZERO_STAGES", "V_SCHEDULES",
           "MULTI_CHUNK_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "INTERLEAVED_VPP", "PLAN_COLUMNS", "code",
           "among", "encode", "decode", "chunks_per_rank"]


# ---- names and their integer codes ----------------------------------------------------------

CP_VARIANTS = ("ring", "allgather", "ulysses")
"""Context-parallel attention variants (``cp=N:<variant>``)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
"""Pipeline schedules (``pp=N:<schedule>``)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation modes (``recompute=<mode>``)."""
ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages (``zero=<stage>``)."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that run exactly two model chunks per rank, placed in a "V"."""
MULTI_CHUNK_SCHEDULES = ("interleaved",) + V_SCHEDULES
"""Schedules that hold several model chunks per rank (the others hold one)."""
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that split a backward into input gradients, then weight gradients: two autograd
passes per chunk and micro-batch (each recomputes a checkpointed region again)."""
INTERLEAVED_VPP = (2, 3, 4, 5, 6, 8)
"""The chunks per rank the search tries for the interleaved schedule."""

_NAMES = {"schedule": SCHEDULES, "cp_variant": CP_VARIANTS, "recompute": RECOMPUTE_MODES}

PLAN_COLUMNS = ("tp", "dp", "cp", "pp", "ep", "vpp", "m", "sp", "zero", "recompute", "cp_variant", "schedule")
"""The integer columns of an encoded plan (:func:`encode`): the degrees, ``vpp`` the model
chunks per pipeline rank, ``m`` the micro-batches per step, ``sp`` 0/1, ``zero`` the stage,
and the codes of the recompute mode, CP variant and schedule."""


def chunks_per_rank(schedule: str, vpp: int) -> int:
    """Model chunks each pipeline rank holds: ``vpp`` for interleaved, 2 for zbv and
    dualpipev (the V shape), else 1."""
    if schedule == "interleaved":
        return vpp
    return 2 if schedule in V_SCHEDULES else 1


def code(field: str, name: str) -> int:
    """The integer code of ``name`` for ``field`` (``schedule``, ``cp_variant``, ``recompute``)."""
    return _NAMES[field].index(name)


def among(column, field: str, names):
    """Whether the codes in ``column`` are one of ``names`` of ``field`` (int or array)."""
    hit = column != column  # False, or an all-False array
    for name in names:
        hit = hit | (column == code(field, name))
    return hit


def encode(plan) -> dict[str, int]:
    """A plan's integer columns (:data:`PLAN_COLUMNS`), as the cost model and search store plans."""
    return dict(tp=plan.tp, dp=plan.dp, cp=plan.cp, pp=plan.pp, ep=plan.ep,
                vpp=chunks_per_rank(plan.schedule, plan.vpp), m=plan.mb, sp=int(plan.sp), zero=plan.zero,
                recompute=code("recompute", plan.recompute), cp_variant=code("cp_variant", plan.cp_variant),
                schedule=code("schedule", plan.schedule))


def decode(columns: Mapping, i: int | None = None) -> dict:
    """The ``Plan(...)`` fields of row ``i`` of encoded ``columns`` (of ``columns`` itself for
    scalars): the inverse of :func:`encode`."""
    def get(name):
        value = columns[name] if i is None else columns[name][i]
        return int(value)

    schedule = SCHEDULES[get("schedule")]
    return dict(dp=get("dp"), tp=get("tp"), sp=bool(get("sp")), cp=get("cp"),
                cp_variant=CP_VARIANTS[get("cp_variant")], ep=get("ep"), pp=get("pp"), schedule=schedule,
                vpp=get("vpp") if schedule in MULTI_CHUNK_SCHEDULES else 1, mb=get("m"), zero=get("zero"),
                recompute=RECOMPUTE_MODES[get("recompute")])
