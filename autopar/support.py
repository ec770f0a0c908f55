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

SUPPORTED_SUMMARY = ("the runtime supports dp, tp, sp, cp, ep (with dp, cp, tp, sp, pp, zero), zero (with dp, cp, tp, "
                     "sp, ep and pp; zero=3 with the zbv / dualpipev schedules only without tp, cp and ep), pp (with "
                     "dp, cp, tp, sp, ep, zero, "
                     "tied embeddings with zero=0|1), mb (gradient accumulation) and recompute=selective|full (with dp, "
                     "tp, sp, cp, zero and pp, not with MoE rewrites or the zbv / dualpipev schedules)")


def moe_needs_rewrite(plan: Plan) -> bool:
    """Experts split over ep, token shards under tp+sp, or a capacity: a MoE block's routing is rewritten."""
    return plan.ep > 1 or plan.tp > 1 or plan.capacity is not None


def unsupported(plan: Plan, *, moe_rewrite: bool = False, tied: bool = False) -> list[str]:
    """The parts of ``plan`` the runtime cannot run yet (empty when it runs).

    ``moe_rewrite``: the model has MoE blocks that the plan's ep, tp or capacity rewrites;
    ``tied``: its LM head shares the embedding matrix."""
    missing = []

    if (plan.pp > 1 and plan.zero == 3 and plan.schedule in SPLIT_BACKWARD_SCHEDULES
            and (plan.tp > 1 or plan.cp > 1 or plan.ep > 1)):
        # A unit's one flat shard feeds every weight of a layer, so torch's split weight backward
        # re-runs the layer's backward from the attention on, collectives included (measured:
        # extra CP sends), which neither the cost model nor the wall clock should pay.
        missing.append(f"zero=3 with the {plan.schedule} schedule together with tp, cp or ep (its weight "
                       "backward would re-run the layer's backward collectives)")
    if plan.pp > 1 and plan.zero > 1 and tied:
        # The first and last stages' copies of the tied weight would have to be summed shard by
        # shard, with the copy in a unit of its own on both (on one rank under the V schedules).
        missing.append(f"zero={plan.zero} with pp on a model whose LM head is tied to the embedding "
                       "(zero=1 runs there)")
    if plan.recompute != "none":
        # The MoE blocks' routed activations and all-to-alls are not in the cost model's
        # recompute accounting (a CP attention's collectives are: cost/comm.py).
        if plan.pp > 1 and plan.schedule in SPLIT_BACKWARD_SCHEDULES:
            missing.append(f"recompute={plan.recompute} with the {plan.schedule} schedule (its split backward "
                           "would recompute every region twice)")
        if moe_rewrite:
            missing.append(f"recompute={plan.recompute} on a mixture-of-experts model whose blocks the plan rewrites")
    return missing


def check_supported(plan: Plan, *, moe_rewrite: bool = False, tied: bool = False) -> None:
    """Raise an ``autopar:`` error naming what the runtime cannot run in ``plan``."""
    missing = unsupported(plan, moe_rewrite=moe_rewrite, tied=tied)
    if missing:
        raise AutoparError(
            f"autopar: plan '{plan}' uses {', '.join(missing)}, which the runtime does not support yet; "
            f"{SUPPORTED_SUMMARY}. The offline cost model and search (autopar plan / autopar.estimate) "
            "cover every dimension.")
