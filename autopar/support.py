"""What the runtime runs today: the runtime rules of :mod:`autopar.plan_space`, asked about a plan.

``parallelize`` (through :func:`autopar.passes.compile.compile_program`) refuses a plan that
:func:`check_runnable` finds fault with, and the search (``runnable=True``, which ``plan="auto"``
uses) only ranks plans that :func:`autopar.plan_space.runnable` accepts: the same rules, so
neither offers a plan the runtime would refuse.  The offline cost model and search cover every
dimension.  Torch-free: offline planning imports it.
"""
from __future__ import annotations

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import encode, moe_rewritten, runtime_refusals, supported_summary

__all__ = ["unsupported", "check_supported", "check_runnable", "moe_needs_rewrite", "SUPPORTED_SUMMARY"]

SUPPORTED_SUMMARY = supported_summary()
"""What the runtime runs, generated from :data:`autopar.plan_space.RUNTIME_RULES`."""


def moe_needs_rewrite(plan: Plan) -> bool:
    """Experts split over ep, token shards under tp+sp, or a capacity: a MoE block's routing is
    rewritten (:func:`autopar.plan_space.moe_rewritten`)."""
    return bool(moe_rewritten(plan.tp, plan.ep, plan.capacity or 0))


def unsupported(plan: Plan, *, moe: bool = False, tied: bool = False) -> list[str]:
    """The parts of ``plan`` the runtime cannot run, each with why (empty when it runs).

    ``moe``: the model has mixture-of-experts blocks; ``tied``: its LM head shares the
    embedding matrix."""
    return [rule.says(plan) for rule in runtime_refusals(encode(plan), moe=int(moe), tied=int(tied))]


def check_supported(plan: Plan, *, moe: bool = False, tied: bool = False) -> None:
    """Raise an ``autopar:`` error naming what the runtime cannot run in ``plan``."""
    missing = unsupported(plan, moe=moe, tied=tied)
    if missing:
        raise AutoparError(
            f"autopar: plan '{plan}' uses {'; '.join(missing)}, which the runtime does not support yet; "
            f"{SUPPORTED_SUMMARY}. The offline cost model and search (autopar plan / autopar.estimate) "
            "cover every dimension.")


def check_runnable(plan: Plan, *, world_size: int | None = None, num_heads: int | None = None,
                   num_kv_heads: int | None = None, vocab: int | None = None, num_experts: int = 0,
                   tied: bool = False) -> None:
    """The checks ``parallelize`` makes of a plan against a model before compiling it: what the
    runtime runs (:func:`check_supported`), then :meth:`autopar.plan.Plan.validate` (``vocab``:
    the vocabulary of a model with embeddings, else None)."""
    check_supported(plan, moe=num_experts > 0, tied=tied)
    plan.validate(world_size=world_size, num_heads=num_heads, num_kv_heads=num_kv_heads, vocab=vocab,
                  num_experts=num_experts)
