"""What the search prices beyond validity, and the enumeration of candidate plans.

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations

import itertools
import math
from typing import Iterator, Mapping

from autopar.plan_space.names import (CP_VARIANTS, INTERLEAVED_VPP, RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES,
                                      among, chunks_per_rank, code)
from autopar.plan_space.rules import (batch_ok, cp_seq_ok, experts_ok, heads_ok, kv_cp_ok,
                                      layers_ok, microbatches_ok, sp_ok, sp_seq_ok, ulysses_ok)
from autopar.plan_space.runtime_rules import runnable

__all__ = ["zero_meaningful", "interleaved_priced", "divisors", "STRUCTURE_FIELDS", "structures",
           "candidates"]


# ---- what the search prices beyond validity ---------------------------------------------------

def zero_meaningful(zero, dp, cp):
    """ZeRO shards over the ``dp * cp`` copies of the dense weights: without copies every ZeRO stage is
    ZeRO-0 (the search keeps only that one)."""
    return (zero == 0) | (dp * cp > 1)


def interleaved_priced(schedule, pp, mb):
    """The cost model's interleaved bubble, ``(pp - 1)(T_f + T_b) / v``, needs ``mb >= pp``."""
    return (among(schedule, "schedule", ("interleaved",)) == 0) | (mb >= pp)


# ---- enumeration ------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


STRUCTURE_FIELDS = ("pp", "dp", "cp", "tp", "ep", "sp", "cp_variant", "schedule", "vpp")
"""The columns of a structure: a plan but for its micro-batching, ZeRO and recompute."""


def structures(world_size: int, facts: Mapping, *, seq_len: int, global_batch: int,
               schedules=None, cp_variants=None, sp=None, max_tp=None) -> dict[str, list[int]]:
    """Every structure of ``world_size`` ranks that passes the rules of a plan and of the model
    ``facts`` (:func:`model_facts`), as integer columns keyed by :data:`STRUCTURE_FIELDS`.

    Restrictions: ``schedules`` and ``cp_variants`` (names), ``sp`` (True / False; None: both,
    and a tp of 1 keeps sp off), ``max_tp``."""
    f = facts
    cols: dict[str, list[int]] = {name: [] for name in STRUCTURE_FIELDS}
    for tp in divisors(world_size):
        if (max_tp is not None and tp > max_tp) or not heads_ok(tp, f["num_heads"], f["num_kv_heads"]):
            continue
        for cp in divisors(world_size // tp):
            if not (cp_seq_ok(seq_len, cp) & kv_cp_ok(tp, cp, f["num_kv_heads"])):
                continue
            for pp in divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                if not (batch_ok(global_batch, dp, 1) & layers_ok(pp, 1, f["num_layers"])):
                    continue
                eps = [e for e in divisors(dp * cp) if experts_ok(e, f["num_experts"])]
                sps = [s for s in (0, 1) if sp_ok(s, tp)]
                if sp is not None:
                    sps = [s for s in sps if s == int(sp)] or sps[:1]
                sps = [s for s in sps if sp_seq_ok(seq_len, cp, tp, s)]
                variants = [code("cp_variant", v) for v in (("ring",) if cp == 1 else cp_variants or CP_VARIANTS)]
                variants = [v for v in variants if ulysses_ok(cp, v, f["num_heads"], f["num_kv_heads"], tp)]
                scheds = [("1f1b", 1)] if pp == 1 else [
                    (s, v) for s in schedules or SCHEDULES
                    for v in (INTERLEAVED_VPP if s == "interleaved" else (chunks_per_rank(s, 1),))
                    if layers_ok(pp, chunks_per_rank(s, v), f["num_layers"])]
                for ep, sp_on, variant, (sched, vpp) in itertools.product(eps, sps, variants, scheds):
                    row = dict(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=sp_on, cp_variant=variant,
                               schedule=code("schedule", sched), vpp=vpp)
                    for name in STRUCTURE_FIELDS:
                        cols[name].append(row[name])
    return cols


def candidates(world_size: int, facts: Mapping, *, seq_len: int, global_batch: int,
               zero_stages=ZERO_STAGES, recompute_modes=RECOMPUTE_MODES, max_microbatch: int = 64,
               microbatches=None, runnable_only: bool = False, **restrictions) -> Iterator[dict[str, int]]:
    """Every plan of ``world_size`` ranks that the search prices, one encoded plan
    (:func:`encode`, with ``b`` the micro-batch size) at a time; ``runnable_only``: only those
    the runtime runs.  Pure Python: the search expands :func:`structures` the same way over arrays."""
    base = structures(world_size, facts, seq_len=seq_len, global_batch=global_batch, **restrictions)
    for i in range(len(base["pp"])):
        s = {name: col[i] for name, col in base.items()}
        for b in divisors(global_batch):
            m = global_batch // (s["dp"] * b) if global_batch % (s["dp"] * b) == 0 else 0
            if not m or b > max_microbatch or (microbatches and m not in microbatches):
                continue
            if not (microbatches_ok(s["schedule"], s["pp"], m) & interleaved_priced(s["schedule"], s["pp"], m)):
                continue
            for zero in zero_stages:
                for mode in recompute_modes:
                    c = dict(s, b=b, m=m, zero=zero, recompute=code("recompute", mode))
                    if zero_meaningful(zero, s["dp"], s["cp"]) and (
                            not runnable_only or runnable(c, moe=facts["num_experts"] > 0, tied=facts["tied"])):
                        yield c
