"""The parallel plan: degrees and options (its text form: :mod:`autopar.plan_text`; its rules: :mod:`autopar.plan_checks`).

A :class:`Plan` says how one training step is spread over ``world_size`` ranks. The
graph passes (``autopar.passes``) read it to rewrite the graph, the runtime
(``autopar.runtime``) reads it to build the device mesh, and the cost model
(``autopar.cost``) and search (:mod:`autopar.planning.search`) score and enumerate plans.
The rules a plan obeys are :mod:`autopar.plan_space`'s predicates; ``Plan`` asks them and
words the refusals.

Text syntax (comma-separated, whitespace and key case ignored, each option at most once)::

    dp=N  tp=N  sp  cp=N[:ring|allgather|ulysses]  ep=N
    pp=N[:gpipe|1f1b|interleaved|zbv|dualpipev]  vpp=N  mb=N
    zero=0|1|2|3  recompute=none|selective|full  capacity=F

``"none"`` or ``""`` is the default plan (one rank, nothing sharded). ``str(plan)`` is
the canonical text and ``Plan.parse(str(plan)) == plan`` for every valid plan.

The mesh is ``pp x dp x cp x tp``, outer to inner (tp varies fastest:
:data:`autopar.plan_space.MESH_AXES`). Expert parallelism is folded into the ``dp x cp`` ranks
of a pipeline stage, so ``ep`` is not a mesh factor of its own and must divide ``dp * cp``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.plan_checks import check_options, fmt_list, validate
from autopar.plan_space import (CP_VARIANTS, MESH_AXES, MULTI_CHUNK_SCHEDULES, RECOMPUTE_MODES, SCHEDULES,
                                V_SCHEDULES, chunk_rank, chunks_per_rank, microbatches_ok,
                                ulysses_fits, ulysses_heads_ok, valid_microbatches)
from autopar.plan_text import format_plan, parse_plan

# Names of the plan space used with plans (autopar.plan_space) are re-exported here.
__all__ = ["Plan", "CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "V_SCHEDULES", "MULTI_CHUNK_SCHEDULES",
           "chunks_per_rank", "chunk_rank", "microbatches_ok", "valid_microbatches",
           "ulysses_heads_ok", "ulysses_fits"]


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Degrees of each parallel dimension plus the options that go with them.

    Fields:
        dp: data-parallel degree (batch split).
        tp: tensor-parallel degree (heads / FFN / vocab split inside a layer).
        sp: sequence parallelism on the TP group (activations outside attention and
            MLP are split along the sequence over tp ranks). Needs ``tp > 1``.
        cp: context-parallel degree (sequence split for attention), with
            ``cp_variant`` one of ``ring``, ``allgather``, ``ulysses``.
        ep: expert-parallel degree, folded into the ``dp * cp`` ranks; must divide it.
        pp: pipeline degree, with ``schedule`` one of ``gpipe``, ``1f1b``,
            ``interleaved``, ``zbv``, ``dualpipev``.
        vpp: model chunks per pipeline rank. ``interleaved`` needs ``vpp >= 2``;
            ``zbv`` and ``dualpipev`` always run two chunks, so ``vpp`` is stored as 2
            for them (writing 1 or 2 is accepted, anything else is an error); the other
            schedules need ``vpp == 1``.
        mb: NUMBER of micro-batches per step per data-parallel replica (with ``pp == 1``
            this is gradient accumulation).
        zero: ZeRO stage 0-3 over the ``dp * cp`` ranks that hold copies of the dense
            weights (with ``dp * cp == 1`` it has nothing to shard and changes nothing).
        recompute: activation recomputation, ``none``, ``selective`` or ``full``.
        capacity: MoE capacity factor (> 0); ``None`` means dropless routing.

    Intrinsic rules checked on construction (``AutoparError``, a ``ValueError``):
    integer degrees are >= 1; variants are known names; ``sp`` needs ``tp > 1``; a CP
    variant other than ``ring`` needs ``cp > 1`` and a schedule other than ``1f1b``
    needs ``pp > 1`` (otherwise the option means nothing and two spellings of one plan
    would compare unequal); ``vpp`` as above; ``ep`` divides ``dp * cp``;
    ``capacity`` is a finite number > 0; the pipeline schedule runs ``mb`` micro-batches
    (:func:`autopar.plan_space.microbatches_ok`). Checks against a model and a run are in
    :meth:`validate`.
    """

    dp: int = 1
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_variant: str = "ring"
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    vpp: int = 1
    mb: int = 1
    zero: int = 0
    recompute: str = "none"
    capacity: float | None = None

    def __post_init__(self):
        check_options(self)  # the rules of a plan alone (autopar/plan_checks.py)

    # ------------------------------------------------------------------ construction
    def replace(self, **changes) -> "Plan":
        """A copy with ``changes`` applied, validated like a new plan.

        Moving away from ``zbv``/``dualpipev`` without giving ``vpp`` drops their implied
        two chunks, so ``plan.replace(schedule="1f1b")`` works on a ``zbv`` plan.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise AutoparError(
                f"autopar: Plan has no field {unknown[0]!r}; expected one of "
                f"{fmt_list(f.name for f in dataclasses.fields(self))}"
            )
        if (
            "vpp" not in changes
            and self.schedule in V_SCHEDULES
            and changes.get("schedule", self.schedule) not in V_SCHEDULES
        ):
            changes["vpp"] = 1
        if "pp" in changes and changes["pp"] == 1 and "schedule" not in changes:
            # pp=1 takes the schedule (and its chunks) with it.
            changes["schedule"] = "1f1b"
            changes.setdefault("vpp", 1)
        if "cp" in changes and changes["cp"] == 1 and "cp_variant" not in changes:
            changes["cp_variant"] = "ring"
        if "tp" in changes and changes["tp"] == 1 and "sp" not in changes:
            changes["sp"] = False
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ text form
    @classmethod
    def parse(cls, text: "str | Plan") -> "Plan":
        """Parse the plan text syntax (:mod:`autopar.plan_text`); a Plan is returned as is."""
        return parse_plan(cls, text)

    def __str__(self) -> str:
        return format_plan(self)

    # ------------------------------------------------------------------ derived sizes
    @property
    def world_size(self) -> int:
        """Ranks the plan needs: ``pp * dp * cp * tp`` (ep is folded into dp*cp)."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def num_chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: vpp (interleaved), 2 (zbv, dualpipev), else 1
        (:func:`autopar.plan_space.chunks_per_rank`)."""
        return chunks_per_rank(self.schedule, self.vpp)

    @property
    def degrees(self) -> dict[str, int]:
        """Mesh axis -> size, outer to inner (:data:`autopar.plan_space.MESH_AXES`)."""
        return {axis: getattr(self, axis) for axis in MESH_AXES}

    # ------------------------------------------------------------------ model checks
    def validate(self, *, world_size: int | None = None, num_heads: int | None = None,
                 num_kv_heads: int | None = None, vocab: int | None = None, num_layers: int | None = None,
                 num_experts: int | None = None, global_batch: int | None = None,
                 seq_len: int | None = None) -> "Plan":
        """Check the plan against a model and a run; return ``self`` or raise AutoparError
        (:func:`autopar.plan_checks.validate`).  Arguments left as ``None`` are not checked;
        ``num_kv_heads=None`` means the same as ``num_heads`` (no GQA); ``num_experts=0`` a dense model."""
        return validate(self, world_size=world_size, num_heads=num_heads, num_kv_heads=num_kv_heads, vocab=vocab,
                        num_layers=num_layers, num_experts=num_experts, global_batch=global_batch,
                        seq_len=seq_len)



