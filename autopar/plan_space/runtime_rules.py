"""What the runtime runs: the combinations it refuses, each rule once (``RUNTIME_RULES``).

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from autopar.plan_space.names import SPLIT_BACKWARD_SCHEDULES, among, code

__all__ = ["moe_rewritten", "split_backward", "Rule", "RUNTIME_RULES", "runtime_refusals", "runnable",
           "supported_summary"]


# ---- what the runtime runs -------------------------------------------------------------------

def moe_rewritten(tp, ep, capacity=0):
    """Whether a plan rewrites a MoE block's routing: experts split over ep, token shards under
    tp + sp, or a capacity factor (``capacity`` > 0; 0 for dropless routing)."""
    return (ep > 1) | (tp > 1) | (capacity > 0)


def split_backward(pp, schedule):
    """Whether a pipeline runs a split backward (:data:`SPLIT_BACKWARD_SCHEDULES`)."""
    return (pp > 1) & among(schedule, "schedule", SPLIT_BACKWARD_SCHEDULES)


@dataclass(frozen=True)
class Rule:
    """A combination the runtime does not run.

    ``refuses(c, moe, tied)``: the predicate on encoded columns ``c`` (:func:`encode`) and the
    model's facts (``moe``: it has MoE blocks; ``tied``: its LM head shares the embedding);
    ``says(plan)``: what a refused plan uses, and why the runtime does not run it, for the refusal;
    ``summary``: the exception as :func:`supported_summary` states it."""

    name: str
    refuses: Callable
    says: Callable
    summary: str


def _moe_tp_without_sp(c, moe, tied):
    # MoE blocks run on each rank's sequence shard with whole experts (they are not split by tp).
    return (moe > 0) & (c["tp"] > 1) & (c["sp"] == 0)


def _zero3_split_backward(c, moe, tied):
    # A unit's one flat shard feeds every weight of a layer, so torch's split weight backward
    # re-runs the layer's backward from the attention on, collectives included (measured: extra
    # CP sends), which neither the cost model nor the wall clock should pay.
    return split_backward(c["pp"], c["schedule"]) & (c["zero"] == 3) & (c["tp"] * c["cp"] * c["ep"] > 1)


def _tied_zero_under_pp(c, moe, tied):
    # The first and last pp ranks' copies of the tied weight would have to be summed shard by shard,
    # with the copy in a unit of its own on both (on one rank under the V schedules).
    return (tied > 0) & (c["pp"] > 1) & (c["zero"] > 1)


def _recompute_split_backward(c, moe, tied):
    return (c["recompute"] != code("recompute", "none")) & split_backward(c["pp"], c["schedule"])


def _recompute_moe(c, moe, tied):
    # The expert bodies and their routed activations are not cut into recomputed regions, nor are
    # the MoE all-to-alls in the cost model's recompute accounting (a CP attention's are).
    return (moe > 0) & (c["recompute"] != code("recompute", "none"))


RUNTIME_RULES = (
    Rule("moe_tp_without_sp", _moe_tp_without_sp,
         lambda p: (f"tp={p.tp} without sp on a mixture-of-experts model (MoE blocks run on "
                    f"each rank's sequence shard with whole experts: add sp, '{p.replace(sp=True)}', as "
                    "Megatron-Core also requires)"),
         "tp without sp on a mixture-of-experts model"),
    Rule("zero3_split_backward", _zero3_split_backward,
         lambda p: (f"zero=3 with the {p.schedule} schedule together with tp, cp or ep (its "
                    "weight backward would re-run the layer's backward collectives)"),
         "zero=3 under zbv / dualpipev together with tp, cp or ep"),
    Rule("tied_zero_under_pp", _tied_zero_under_pp,
         lambda p: f"zero={p.zero} with pp on a model whose LM head is tied to the embedding (zero=1 runs there)",
         "zero=2|3 with pp on a model whose LM head is tied to the embedding"),
    Rule("recompute_split_backward", _recompute_split_backward,
         lambda p: (f"recompute={p.recompute} with the {p.schedule} schedule (its split "
                    "backward would recompute every region twice)"),
         "recompute with the zbv / dualpipev schedules"),
    Rule("recompute_moe", _recompute_moe,
         lambda p: (f"recompute={p.recompute} on a mixture-of-experts model (the expert "
                    "bodies and their routed activations are not cut into recomputed regions)"),
         "recompute on a mixture-of-experts model"),
)
"""What the runtime does not run, each rule once."""


def runtime_refusals(c: Mapping, *, moe=0, tied=0) -> list[Rule]:
    """The rules of :data:`RUNTIME_RULES` that refuse the one plan encoded in ``c``."""
    return [rule for rule in RUNTIME_RULES if rule.refuses(c, moe, tied)]


def runnable(c: Mapping, *, moe=0, tied=0):
    """Whether the runtime runs the plans encoded in ``c`` (int columns or arrays) on a model
    with (``moe``) or without MoE blocks, and with (``tied``) or without a tied LM head."""
    refused = c["tp"] != c["tp"]
    for rule in RUNTIME_RULES:
        refused = refused | rule.refuses(c, moe, tied)
    return refused == 0


def supported_summary() -> str:
    """What the runtime runs, generated from :data:`RUNTIME_RULES`."""
    return ("the runtime runs every plan the cost model prices (dp, tp, sp, cp, ep, pp, zero, mb, capacity "
            "and recompute, each with the others) except " + "; ".join(r.summary for r in RUNTIME_RULES))
