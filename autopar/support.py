"""What the runtime can run today: the one source of truth for plan combinations.

``parallelize`` (through :func:`autopar.passes.compile.compile_program`) refuses a plan
that :func:`unsupported` finds fault with, and ``plan="auto"``
(:mod:`autopar.planning.autoplan`) only considers plans it accepts, so neither offers a
plan the runtime would refuse.  The offline cost model and search cover every dimension.
Torch-free: offline planning imports it.
"""
from __future__ import annotations

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_rules import SPLIT_BACKWARD_SCHEDULES

__all__ = ["unsupported", "check_supported", "moe_needs_rewrite", "SUPPORTED_SUMMARY"]

_MOE = "a mixture-of-experts model's experts or tokens split (ep, tp or capacity) together with zero=3"

SUPPORTED_SUMMARY = ("the runtime supports dp, tp, sp, cp, ep (with dp, cp, tp, sp, pp, zero=1|2), zero (with dp, cp, tp, "
                     "sp; zero=1 with pp), pp (with dp, cp, tp, sp, ep, zero=1, tied embeddings), mb (gradient accumulation) and recompute=selective|full (with dp, tp, "
                     "sp, zero and pp, not with cp, MoE rewrites or the zbv / dualpipev schedules)")


def moe_needs_rewrite(plan: Plan) -> bool:
    """Experts split over ep, token shards under tp+sp, or a capacity: a MoE block's routing is rewritten."""
    return plan.ep > 1 or plan.tp > 1 or plan.capacity is not None


def unsupported(plan: Plan, *, moe_rewrite: bool = False) -> list[str]:
    """The parts of ``plan`` the runtime cannot run yet (empty when it runs).

    ``moe_rewrite``: the model has MoE blocks that the plan's ep, tp or capacity rewrites."""
    missing = []

    if plan.pp > 1 and plan.zero > 1:
        # Stage 2 reduce-scatters per micro-batch and stage 3 gathers per unit, inside torch's
        # schedule, whose chunks do not own whole units yet.
        missing.append(f"pp={plan.pp} together with zero={plan.zero} (zero=1 runs with pp)")
    if plan.zero == 3 and plan.ep > 1:
        missing.append("zero=3 together with ep")  # stage 3's units are whole layers, experts and all
    if plan.recompute != "none":
        # The regions' CP attention (its collectives, the K,V it keeps) is not in the cost model's
        # recompute accounting, nor are the MoE blocks' routed activations and all-to-alls.
        if plan.cp > 1:
            missing.append(f"recompute={plan.recompute} together with cp")
        if plan.pp > 1 and plan.schedule in SPLIT_BACKWARD_SCHEDULES:
            missing.append(f"recompute={plan.recompute} with the {plan.schedule} schedule (its split backward "
                           "would recompute every region twice)")
        if moe_rewrite:
            missing.append(f"recompute={plan.recompute} on a mixture-of-experts model whose blocks the plan rewrites")
    if moe_rewrite and plan.zero == 3:
        missing.append(_MOE)
    return missing


def check_supported(plan: Plan, *, moe_rewrite: bool = False) -> None:
    """Raise an ``autopar:`` error naming what the runtime cannot run in ``plan``."""
    missing = unsupported(plan, moe_rewrite=moe_rewrite)
    if _MOE in missing:
        raise AutoparError(
            f"autopar: plan '{plan}' splits the experts or tokens of a mixture-of-experts model (ep, tp or capacity) "
            "together with zero=3, which the runtime does not combine yet (its units are whole layers, experts "
            "and all); use zero=1 or zero=2, or zero=3 without them (every rank then runs every expert on its "
            "own tokens).")
    if missing:
        raise AutoparError(
            f"autopar: plan '{plan}' uses {', '.join(missing)}, which the runtime does not support yet; "
            f"{SUPPORTED_SUMMARY}. The offline cost model and search (autopar plan / autopar.estimate) "
            "cover every dimension.")
