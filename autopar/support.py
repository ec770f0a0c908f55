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

__all__ = ["unsupported", "check_supported", "moe_needs_rewrite", "SUPPORTED_SUMMARY"]

_MOE = "a mixture-of-experts model's experts or tokens split (ep, tp or capacity) together with pp or zero"

SUPPORTED_SUMMARY = ("the runtime supports dp, tp, sp, cp, ep (with dp, cp, tp, sp), zero (with dp, tp, sp), "
                     "pp (with dp, tp, sp) and mb (gradient accumulation)")


def moe_needs_rewrite(plan: Plan) -> bool:
    """Experts split over ep, token shards under tp+sp, or a capacity: a MoE block's routing is rewritten."""
    return plan.ep > 1 or plan.tp > 1 or plan.capacity is not None


def unsupported(plan: Plan, *, moe_rewrite: bool = False) -> list[str]:
    """The parts of ``plan`` the runtime cannot run yet (empty when it runs).

    ``moe_rewrite``: the model has MoE blocks that the plan's ep, tp or capacity rewrites."""
    missing = []
    if plan.pp > 1 and (plan.cp > 1 or plan.ep > 1 or plan.zero > 0):
        missing.append(f"pp={plan.pp} together with cp, ep or zero")  # pp runs with dp, tp, sp
    if plan.zero > 0 and (plan.cp > 1 or plan.ep > 1):
        missing.append(f"zero={plan.zero} together with cp or ep")  # ZeRO shards over dp only
    if plan.recompute != "none":
        missing.append(f"recompute={plan.recompute}")
    if moe_rewrite and (plan.pp > 1 or plan.zero > 0):
        missing.append(_MOE)
    return missing


def check_supported(plan: Plan, *, moe_rewrite: bool = False) -> None:
    """Raise an ``autopar:`` error naming what the runtime cannot run in ``plan``."""
    missing = unsupported(plan, moe_rewrite=moe_rewrite)
    if _MOE in missing:
        raise AutoparError(
            f"autopar: plan '{plan}' splits the experts or tokens of a mixture-of-experts model (ep, tp or capacity) "
            "together with pp or zero, which the runtime does not combine yet; use ep, tp+sp and capacity with "
            "dp and cp, or pp / zero without them (every rank then runs every expert on its own tokens).")
    if missing:
        raise AutoparError(
            f"autopar: plan '{plan}' uses {', '.join(missing)}, which the runtime does not support yet; "
            f"{SUPPORTED_SUMMARY}. The offline cost model and search (autopar plan / autopar.estimate) "
            "cover every dimension.")
