"""The refusals of a :class:`autopar.plan.Plan`: every rule a plan obeys, asked of :mod:`autopar.plan_space`
and worded for the user.

Two kinds: :func:`check_options`, the rules of a plan alone, run by ``Plan``'s construction (so no
plan that breaks one exists: integer degrees >= 1, known names, options that need their degree,
``vpp`` for the schedule, ``ep`` dividing ``dp*cp``, the capacity factor, and the micro-batch
count the pipeline schedule runs); and :func:`validate`, the rules of a plan against a model and a
run (world size, heads, KV heads under cp, Ulysses, layers per chunk, experts, batch, sequence),
run by ``Plan.validate``, hence by ``compile_program``, the cost model and the search's
checks.  The predicates themselves live in :mod:`autopar.plan_space`, each once; this module only
asks them and says what to change.  Neighbours: :mod:`autopar.plan` (the ``Plan``),
:mod:`autopar.plan_text` (its text form).
"""
from __future__ import annotations

import math
import operator

from autopar.errors import AutoparError
from autopar.plan_space import (CP_VARIANTS, RECOMPUTE_MODES, SCHEDULES, V_SCHEDULES, ZERO_STAGES, batch_ok,
                                code, cp_seq_ok, divisors, ep_ok, experts_ok, heads_ok, local_experts,
                                kv_cp_ok, layers_ok, microbatches_ok, sp_ok, sp_seq_ok, ulysses_ok,
                                valid_microbatches)

__all__ = ["check_options", "validate", "fmt_list", "INT_OPTIONS"]

INT_OPTIONS = ("dp", "tp", "cp", "ep", "pp", "vpp", "mb", "zero")
"""The plan's integer fields."""


def fmt_list(values) -> str:
    return ", ".join(str(v) for v in values)


def _nearest(candidates: list[int], target: int) -> list[int]:
    """The candidate(s) closest to ``target``; two when it sits between them."""
    if not candidates:
        return []
    best = min(abs(c - target) for c in candidates)
    return sorted(c for c in candidates if abs(c - target) == best)


def check_options(plan) -> None:
    """Every rule of ``plan`` alone (see the module docstring); normalises names to lower case,
    integers to ``int``, the capacity to ``float`` and ``vpp`` of the V schedules to 2, in place
    (the plan is frozen: ``object.__setattr__``)."""
    _check_values(plan)
    _check_combinations(plan)
    _check_vpp(plan)
    _check_capacity(plan)
    _check_microbatches(plan)


def _check_microbatches(plan) -> None:
    """Raise an ``autopar:`` error naming the nearest valid counts when ``plan``'s pipeline
    schedule does not run ``plan.mb`` micro-batches (:func:`microbatches_ok`)."""
    if not microbatches_ok(plan.schedule, plan.pp, plan.mb):
        rule = {"1f1b": f"at least pp={plan.pp} micro-batches",
                "interleaved": f"a micro-batch count that is a multiple of its rounds (mb // pp = {max(1, plan.mb // plan.pp)})",
                "dualpipev": f"at least 2*pp={2 * plan.pp} micro-batches (one per chunk)"}[plan.schedule]
        near = " or ".join(f"mb={m}" for m in valid_microbatches(plan.schedule, plan.pp, plan.mb))
        raise AutoparError(f"autopar: schedule '{plan.schedule}' with pp={plan.pp} needs {rule}, "
                           f"got mb={plan.mb}; use {near}.")


def _check_values(plan) -> None:
    """Integer degrees >= 1, a ZeRO stage, known names (lower-cased in place)."""
    for name in INT_OPTIONS:
        value = getattr(plan, name)
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)  # also numpy / torch integer scalars
        except TypeError:
            raise AutoparError(f"autopar: plan option {name} must be an integer, got {value!r}; "
                               f"write e.g. {name}=2") from None
        object.__setattr__(plan, name, int(value))
    for name in ("dp", "tp", "cp", "ep", "pp", "vpp", "mb"):
        value = getattr(plan, name)
        if value < 1:
            raise AutoparError(f"autopar: plan option {name}={value} is not allowed; expected an "
                               f"integer >= 1 (use {name}=1 to turn it off)")
    if plan.zero not in ZERO_STAGES:
        raise AutoparError(f"autopar: zero={plan.zero} is not a ZeRO stage; expected one of {fmt_list(ZERO_STAGES)}")
    if not isinstance(plan.sp, bool):
        raise AutoparError(f"autopar: plan option sp must be True or False, got {plan.sp!r}")
    for name, allowed in (
        ("cp_variant", CP_VARIANTS),
        ("schedule", SCHEDULES),
        ("recompute", RECOMPUTE_MODES),
    ):
        value = getattr(plan, name)
        if not isinstance(value, str) or value.lower() not in allowed:
            raise AutoparError(f"autopar: unknown {name} {value!r}; expected one of {fmt_list(allowed)}")
        object.__setattr__(plan, name, value.lower())


def _check_combinations(plan) -> None:
    """Options that mean nothing without their degree; ep divides dp*cp."""
    if not sp_ok(plan.sp, plan.tp):
        raise AutoparError("autopar: sp (sequence parallelism) splits activations over the tensor-"
                           "parallel group, but tp=1; use tp>=2 with sp, or drop sp")
    if plan.cp == 1 and plan.cp_variant != "ring":
        raise AutoparError(f"autopar: cp variant '{plan.cp_variant}' given with cp=1; a context-"
                           f"parallel variant needs cp>=2 (e.g. cp=2:{plan.cp_variant}), or drop it")
    if plan.pp == 1 and plan.schedule != "1f1b":
        raise AutoparError(f"autopar: pipeline schedule '{plan.schedule}' given with pp=1; a schedule "
                           f"needs pp>=2 (e.g. pp=2:{plan.schedule}), or drop it")
    if not ep_ok(plan.ep, plan.dp, plan.cp):
        good = divisors(plan.dp * plan.cp)
        raise AutoparError(f"autopar: ep={plan.ep} does not divide dp*cp={plan.dp * plan.cp} (dp={plan.dp}, "
                           f"cp={plan.cp}); expert parallelism is folded into the data/context-parallel "
                           f"ranks, so ep must be one of {fmt_list(good)}, or raise dp")


def _check_capacity(plan) -> None:
    """A MoE capacity factor: a finite number > 0 (stored as a float)."""
    if plan.capacity is not None:
        cap = plan.capacity
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            try:
                cap = float(cap)
            except (TypeError, ValueError):
                raise AutoparError(f"autopar: capacity must be a number, got {plan.capacity!r}; "
                                   f"write e.g. capacity=1.25") from None
        cap = float(cap)
        if not math.isfinite(cap) or cap <= 0:
            raise AutoparError(f"autopar: capacity={cap} is not a valid MoE capacity factor; expected a "
                               f"finite number > 0 (e.g. capacity=1.25), or leave it out for dropless routing")
        object.__setattr__(plan, "capacity", cap)


def _check_vpp(plan) -> None:
    """Model chunks per pipeline rank for the schedule (zbv / dualpipev: stored as 2)."""
    if plan.schedule in V_SCHEDULES:
        if plan.vpp not in (1, 2):
            raise AutoparError(f"autopar: schedule '{plan.schedule}' runs exactly 2 model chunks per "
                               f"rank, but vpp={plan.vpp}; drop vpp (or write vpp=2)")
        object.__setattr__(plan, "vpp", 2)
    elif plan.schedule == "interleaved":
        if plan.vpp < 2:
            raise AutoparError(f"autopar: the interleaved schedule needs vpp>=2 model chunks per "
                               f"rank, got vpp={plan.vpp}; add vpp=2 (or use pp={plan.pp}:1f1b)")
    elif plan.vpp != 1:
        hint = (
            f"use pp={plan.pp}:interleaved,vpp={plan.vpp}"
            if plan.pp > 1
            else f"use pp>=2 with :interleaved, e.g. pp=2:interleaved,vpp={plan.vpp}"
        )
        raise AutoparError(f"autopar: vpp={plan.vpp} (virtual pipeline chunks) needs the interleaved "
                           f"schedule, but the schedule is '{plan.schedule}' with pp={plan.pp}; {hint}, "
                           f"or drop vpp")


def validate(
    plan,
    *,
    world_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    vocab: int | None = None,
    num_layers: int | None = None,
    num_experts: int | None = None,
    global_batch: int | None = None,
    seq_len: int | None = None,
):
    """Check the plan against a model and a run; return ``plan`` or raise AutoparError.

    Arguments left as ``None`` are not checked. ``num_kv_heads=None`` means the same
    as ``num_heads`` (no GQA). ``num_experts=0`` means a dense model.
    """
    if world_size is not None:
        _check_world(plan, world_size)
    kv = num_kv_heads if num_kv_heads is not None else num_heads
    if num_heads is not None:
        _check_heads(plan, num_heads, kv)
    elif num_kv_heads is not None:
        _check_kv_cp(plan, num_kv_heads)
    # a vocabulary tp does not divide is padded to ceil(V/tp) rows per rank (plan_space.padded_vocab: no rule)
    if num_layers is not None:
        _check_layers(plan, num_layers)
    if num_experts is not None:
        _check_experts(plan, num_experts)
    if global_batch is not None:
        _check_batch(plan, global_batch)
    if seq_len is not None:
        _check_seq(plan, seq_len)
    return plan

def _check_heads(plan, heads: int, kv: int) -> None:
    if not heads_ok(plan.tp, heads, kv):
        raise AutoparError(f"autopar: tp={plan.tp} does not divide the {heads} attention heads; tensor "
                           f"parallelism splits whole heads, so tp must be one of {fmt_list(divisors(heads))}")
    _check_kv_cp(plan, kv)
    if not ulysses_ok(plan.cp, code("cp_variant", plan.cp_variant), heads, kv, plan.tp):
        split = plan.tp * plan.cp
        # tp divides gcd(heads, kv) here, so cp must divide what is left per tp rank.
        good_cp = [c for c in divisors(math.gcd(heads, kv) // plan.tp) if c > 1]
        hint = (
            f"with tp={plan.tp} use cp in {fmt_list(good_cp)}, or"
            if good_cp
            else f"with tp={plan.tp} no cp>1 fits; use"
        )
        raise AutoparError(f"autopar: cp={plan.cp}:ulysses splits the heads over tp*cp = "
                           f"{plan.tp}*{plan.cp} = {split} ranks, but the model has {heads} heads "
                           f"and {kv} KV heads, which must both be divisible by {split}; {hint} "
                           f"the ring or allgather variant")

def _check_kv_cp(plan, kv: int) -> None:
    if not kv_cp_ok(plan.tp, plan.cp, kv):
        good_tp = [t for t in divisors(kv) if t > 1]
        raise AutoparError(
            f"autopar: tp={plan.tp} does not divide the {kv} KV heads, so every tp rank holds all of "
            f"them (KV-head replication), which context parallelism does not run: use cp=1 with "
            f"tp={plan.tp}" + (f", or a tp that divides the KV heads ({fmt_list(good_tp)}) with cp={plan.cp}"
                               if good_tp else "")
        )

def _check_batch(plan, global_batch: int) -> None:
    parts = plan.dp * plan.mb
    if batch_ok(global_batch, plan.dp, plan.mb):
        return
    if not batch_ok(global_batch, plan.dp, 1):
        good_dp = divisors(global_batch)
        raise AutoparError(f"autopar: the global batch of {global_batch} does not split into dp={plan.dp} "
                           f"replicas times mb={plan.mb} micro-batches; dp must divide the batch "
                           f"(valid dp: {fmt_list(good_dp)}), or use a batch that is a multiple of "
                           f"{parts}")
    per_replica = global_batch // plan.dp
    near = _nearest(divisors(per_replica), plan.mb)
    raise AutoparError(f"autopar: the global batch of {global_batch} does not split into dp*mb = "
                       f"{plan.dp}*{plan.mb} = {parts} equal parts; each replica gets {per_replica} "
                       f"samples, so mb must divide {per_replica}: the nearest valid mb is "
                       f"{' or '.join(str(m) for m in near)}")

def _check_seq(plan, seq_len: int) -> None:
    if not cp_seq_ok(seq_len, plan.cp):
        lo = seq_len // (2 * plan.cp) * 2 * plan.cp
        near = [n for n in (lo, lo + 2 * plan.cp) if n > 0]
        raise AutoparError(f"autopar: cp={plan.cp} cuts the sequence into 2*cp = {2 * plan.cp} chunks "
                           f"(two per rank, to balance causal attention), but the sequence length "
                           f"{seq_len} is not a multiple of {2 * plan.cp}; use a sequence length of "
                           f"{' or '.join(str(n) for n in near)}, or a cp with 2*cp dividing {seq_len}")
    if not sp_seq_ok(seq_len, plan.cp, plan.tp, plan.sp):
        local = seq_len // plan.cp
        step = plan.cp * plan.tp
        lo = seq_len // step * step
        near = [n for n in (lo, lo + step) if n > 0]
        raise AutoparError(f"autopar: sp splits each rank's {local}-token sequence over tp={plan.tp} "
                           f"ranks, but {local} is not a multiple of {plan.tp}; use a sequence length "
                           f"of {' or '.join(str(n) for n in near)} (a multiple of cp*tp = {step}), or "
                           f"drop sp")


def _check_world(plan, world_size: int) -> None:
    if world_size == plan.world_size:
        return
    rest = plan.pp * plan.cp * plan.tp
    hint = (
        f"with the other degrees unchanged, dp={world_size // rest} fits"
        if world_size % rest == 0
        else f"pp*cp*tp={rest} does not divide {world_size}, so change those degrees"
    )
    raise AutoparError(f"autopar: plan '{plan}' needs pp*dp*cp*tp = {plan.pp}*{plan.dp}*{plan.cp}*"
                       f"{plan.tp} = {plan.world_size} ranks, but the world size is {world_size}; " f"{hint}")


def _check_layers(plan, num_layers: int) -> None:
    chunks = plan.pp * plan.num_chunks_per_rank
    if not layers_ok(plan.pp, plan.num_chunks_per_rank, num_layers):
        raise AutoparError(f"autopar: plan '{plan}' cuts the model into pp*chunks_per_rank = "
                           f"{plan.pp}*{plan.num_chunks_per_rank} = {chunks} pipeline chunks, but "
                           f"it has only {num_layers} layers; use at most {num_layers} chunks "
                           f"(a smaller pp or vpp)")


def _check_experts(plan, num_experts: int) -> None:
    if num_experts == 0 and (not experts_ok(plan.ep, 0) or plan.capacity is not None):
        what = f"ep={plan.ep}" if plan.ep > 1 else f"capacity={plan.capacity!r}"
        raise AutoparError(f"autopar: {what} applies to mixture-of-experts layers, but the model "
                           f"has no experts; drop {what.split('=')[0]}")
    if num_experts and not experts_ok(plan.ep, num_experts):
        good = [d for d in divisors(plan.dp * plan.cp) if experts_ok(d, num_experts)]
        raise AutoparError(f"autopar: ep={plan.ep} leaves a rank without any of the {num_experts} experts "
                           f"({local_experts(num_experts, plan.ep)} per rank); ep must divide "
                           f"dp*cp={plan.dp * plan.cp} and give every rank an expert (an ep that does not "
                           f"divide the experts pads them): valid ep values are {fmt_list(good)}")
