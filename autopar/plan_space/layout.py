"""The mesh layout: axes outer to inner, the derived axes, their strides and rank groups.

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations


__all__ = ["MESH_AXES", "GROUP_AXES", "data_axis", "axis_digits", "axis_geometry", "axis_groups"]


# ---- the mesh layout ------------------------------------------------------------------------

MESH_AXES = ("pp", "dp", "cp", "tp")
"""The mesh axes, outer to inner: tp varies fastest, so consecutive ranks (one node, NVLink)
form the tp groups (docs/architecture.md, "Mesh and ranks")."""
GROUP_AXES = MESH_AXES + ("dp_cp", "ep", "edp")
"""Every axis a collective runs on: the mesh axes and the derived ones -- ``dp_cp`` (the
``dp * cp`` ranks holding copies of the dense weights), ``ep`` (experts split over ``ep``
consecutive ``dp * cp`` indices of one stage and tp index) and ``edp`` (the ranks holding the
same experts: the other ``dp * cp / ep`` token slices times tp)."""


def data_axis(cp) -> str:
    """The axis over which the ranks holding different tokens of one model replica meet (the
    dense weights' gradient reduction, the loss mean, ZeRO's shards): ``dp_cp`` under context
    parallelism, else ``dp`` (the same ranks when ``cp == 1``; torch builds one group fewer)."""
    return "dp_cp" if cp > 1 else "dp"


def axis_digits(axis: str, *, pp, dp, cp, tp, ep=1) -> tuple[tuple, ...]:
    """The rank digits ``axis`` spans, outer to inner, as ``(stride, size)`` pairs.

    A rank is ``((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``; its ``dp * cp`` index splits
    again into ``dp * cp / ep`` expert replicas times ``ep``.  A group of ``axis`` is the ranks
    that differ only in these digits.  The degrees may be numpy arrays."""
    return {
        "tp": ((1, tp),),
        "cp": ((tp, cp),),
        "dp": ((tp * cp, dp),),
        "pp": ((tp * cp * dp, pp),),
        "dp_cp": ((tp, dp * cp),),
        "ep": ((tp, ep),),
        "edp": ((tp * ep, dp * cp // ep), (1, tp)),
    }[axis]


def axis_geometry(axis: str, *, pp, dp, cp, tp, ep=1):
    """(stride, size) of ``axis``'s outermost digit, which sets its links: the ``edp`` ranks of one
    expert replica's tp digit are adjacent, its ``dp * cp / ep`` replicas sit at stride ``tp * ep``."""
    return axis_digits(axis, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)[0]


def axis_groups(axis: str, *, pp: int, dp: int, cp: int, tp: int, ep: int = 1) -> list[list[int]]:
    """The rank groups of ``axis``, each ascending, in the order of their first rank (every rank
    builds them in this same order)."""
    offsets = [0]
    for stride, size in axis_digits(axis, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep):
        offsets = [o + i * stride for o in offsets for i in range(size)]
    offsets.sort()
    seen: set[int] = set()
    groups = []
    for rank in range(pp * dp * cp * tp):
        if rank not in seen:  # the smallest rank not yet grouped is its group's first
            group = [rank + o for o in offsets]
            seen.update(group)
            groups.append(group)
    return groups
