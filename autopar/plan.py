"""The parallel plan: degrees and options, its text syntax, and its validation.

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
import difflib
import math
import operator
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.plan_space import (CP_VARIANTS, MESH_AXES, MULTI_CHUNK_SCHEDULES, RECOMPUTE_MODES, SCHEDULES,
                                V_SCHEDULES, ZERO_STAGES, batch_ok, check_microbatches, chunk_rank,
                                chunks_per_rank, cp_seq_ok, divisors, ep_ok, experts_ok, heads_ok, kv_cp_ok,
                                layers_ok, microbatches_ok, sp_ok, sp_seq_ok, ulysses_fits,
                                ulysses_heads_ok, ulysses_ok, valid_microbatches)
from autopar.plan_space import code as _code

# Names of the plan space used with plans (autopar.plan_space) are re-exported here.
__all__ = ["Plan", "CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "V_SCHEDULES", "MULTI_CHUNK_SCHEDULES",
           "chunks_per_rank", "chunk_rank", "microbatches_ok", "valid_microbatches",
           "check_microbatches", "ulysses_heads_ok", "ulysses_fits"]

_INT_OPTIONS = ("dp", "tp", "cp", "ep", "pp", "vpp", "mb", "zero")
_OPTIONS = ("dp", "tp", "sp", "cp", "ep", "pp", "vpp", "mb", "zero", "recompute", "capacity")
_SYNTAX = (
    f"dp=N, tp=N, sp, cp=N[:{'|'.join(CP_VARIANTS)}], ep=N, "
    f"pp=N[:{'|'.join(SCHEDULES)}], vpp=N, mb=N, zero={'|'.join(map(str, ZERO_STAGES))}, "
    f"recompute={'|'.join(RECOMPUTE_MODES)}, capacity=F"
)


def _nearest(candidates: list[int], target: int) -> list[int]:
    """The candidate(s) closest to ``target``; two when it sits between them."""
    if not candidates:
        return []
    best = min(abs(c - target) for c in candidates)
    return sorted(c for c in candidates if abs(c - target) == best)


def _fmt_list(values) -> str:
    return ", ".join(str(v) for v in values)


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
    ``capacity`` is a finite number > 0. Checks against a model and a run are in
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

    # ------------------------------------------------------------------ construction
    def __post_init__(self):
        for name in _INT_OPTIONS:
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)  # also numpy / torch integer scalars
            except TypeError:
                raise AutoparError(
                    f"autopar: plan option {name} must be an integer, got {value!r}; "
                    f"write e.g. {name}=2"
                ) from None
            object.__setattr__(self, name, int(value))
        for name in ("dp", "tp", "cp", "ep", "pp", "vpp", "mb"):
            value = getattr(self, name)
            if value < 1:
                raise AutoparError(
                    f"autopar: plan option {name}={value} is not allowed; expected an "
                    f"integer >= 1 (use {name}=1 to turn it off)"
                )
        if self.zero not in ZERO_STAGES:
            raise AutoparError(
                f"autopar: zero={self.zero} is not a ZeRO stage; expected one of {_fmt_list(ZERO_STAGES)}"
            )
        if not isinstance(self.sp, bool):
            raise AutoparError(f"autopar: plan option sp must be True or False, got {self.sp!r}")
        for name, allowed in (
            ("cp_variant", CP_VARIANTS),
            ("schedule", SCHEDULES),
            ("recompute", RECOMPUTE_MODES),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or value.lower() not in allowed:
                raise AutoparError(
                    f"autopar: unknown {name} {value!r}; expected one of {_fmt_list(allowed)}"
                )
            object.__setattr__(self, name, value.lower())

        if not sp_ok(self.sp, self.tp):
            raise AutoparError(
                "autopar: sp (sequence parallelism) splits activations over the tensor-"
                "parallel group, but tp=1; use tp>=2 with sp, or drop sp"
            )
        if self.cp == 1 and self.cp_variant != "ring":
            raise AutoparError(
                f"autopar: cp variant '{self.cp_variant}' given with cp=1; a context-"
                f"parallel variant needs cp>=2 (e.g. cp=2:{self.cp_variant}), or drop it"
            )
        if self.pp == 1 and self.schedule != "1f1b":
            raise AutoparError(
                f"autopar: pipeline schedule '{self.schedule}' given with pp=1; a schedule "
                f"needs pp>=2 (e.g. pp=2:{self.schedule}), or drop it"
            )
        self._check_vpp()
        if not ep_ok(self.ep, self.dp, self.cp):
            good = divisors(self.dp * self.cp)
            raise AutoparError(
                f"autopar: ep={self.ep} does not divide dp*cp={self.dp * self.cp} (dp={self.dp}, "
                f"cp={self.cp}); expert parallelism is folded into the data/context-parallel "
                f"ranks, so ep must be one of {_fmt_list(good)}, or raise dp"
            )
        if self.capacity is not None:
            cap = self.capacity
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                try:
                    cap = float(cap)
                except (TypeError, ValueError):
                    raise AutoparError(
                        f"autopar: capacity must be a number, got {self.capacity!r}; "
                        f"write e.g. capacity=1.25"
                    ) from None
            cap = float(cap)
            if not math.isfinite(cap) or cap <= 0:
                raise AutoparError(
                    f"autopar: capacity={cap} is not a valid MoE capacity factor; expected a "
                    f"finite number > 0 (e.g. capacity=1.25), or leave it out for dropless routing"
                )
            object.__setattr__(self, "capacity", cap)

    def _check_vpp(self) -> None:
        if self.schedule in V_SCHEDULES:
            if self.vpp not in (1, 2):
                raise AutoparError(
                    f"autopar: schedule '{self.schedule}' runs exactly 2 model chunks per "
                    f"rank, but vpp={self.vpp}; drop vpp (or write vpp=2)"
                )
            object.__setattr__(self, "vpp", 2)
        elif self.schedule == "interleaved":
            if self.vpp < 2:
                raise AutoparError(
                    f"autopar: the interleaved schedule needs vpp>=2 model chunks per "
                    f"rank, got vpp={self.vpp}; add vpp=2 (or use pp={self.pp}:1f1b)"
                )
        elif self.vpp != 1:
            hint = (
                f"use pp={self.pp}:interleaved,vpp={self.vpp}"
                if self.pp > 1
                else f"use pp>=2 with :interleaved, e.g. pp=2:interleaved,vpp={self.vpp}"
            )
            raise AutoparError(
                f"autopar: vpp={self.vpp} (virtual pipeline chunks) needs the interleaved "
                f"schedule, but the schedule is '{self.schedule}' with pp={self.pp}; {hint}, "
                f"or drop vpp"
            )

    def replace(self, **changes) -> "Plan":
        """A copy with ``changes`` applied, validated like a new plan.

        Moving away from ``zbv``/``dualpipev`` without giving ``vpp`` drops their implied
        two chunks, so ``plan.replace(schedule="1f1b")`` works on a ``zbv`` plan.
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise AutoparError(
                f"autopar: Plan has no field {unknown[0]!r}; expected one of "
                f"{_fmt_list(f.name for f in dataclasses.fields(self))}"
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
        """Parse the plan text syntax (see the module docstring); a Plan is returned as is."""
        if isinstance(text, Plan):
            return text
        if not isinstance(text, str):
            raise AutoparError(
                f"autopar: a plan must be a string like 'tp=2,dp=2' or a Plan, got "
                f"{type(text).__name__}"
            )
        stripped = text.strip()
        if stripped.lower() in ("", "none"):
            return cls()
        if stripped.lower() == "auto":
            raise AutoparError(
                "autopar: 'auto' is not a fixed plan; pass plan='auto' to "
                "autopar.parallelize (or call autopar.search) to choose one, or write "
                "the degrees out, e.g. 'tp=2,dp=2'"
            )
        fields: dict = {}
        seen: set[str] = set()
        for raw in stripped.split(","):
            token = raw.strip()
            if not token:
                continue
            key, eq, value = (part.strip() for part in token.partition("="))
            key = key.lower()
            if key not in _OPTIONS:
                near = f"; did you mean '{_close_option(key)}'?" if _close_option(key) else ""
                raise AutoparError(
                    f"autopar: unknown plan option {key!r} in {text!r}; expected one of "
                    f"{_fmt_list(_OPTIONS)} (syntax: {_SYNTAX}){near}"
                )
            if key in seen:
                raise AutoparError(
                    f"autopar: plan option {key!r} is given twice in {text!r}; give each "
                    f"option once"
                )
            seen.add(key)
            if key == "sp":
                if eq:
                    raise AutoparError(
                        f"autopar: plan option 'sp' is a flag and takes no value, got "
                        f"{token!r} in {text!r}; write 'sp' to turn sequence parallelism on, "
                        f"or leave it out"
                    )
                fields["sp"] = True
                continue
            if not eq or not value:
                raise AutoparError(
                    f"autopar: plan option {key!r} needs a value, got {token!r} in {text!r}; "
                    f"syntax: {_SYNTAX}"
                )
            fields.update(_parse_value(key, value, text))
        return cls(**fields)

    def __str__(self) -> str:
        parts: list[str] = []
        if self.tp > 1:
            parts.append(f"tp={self.tp}")
        if self.sp:
            parts.append("sp")
        if self.cp > 1:
            parts.append(f"cp={self.cp}:{self.cp_variant}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}:{self.schedule}")
        if self.schedule == "interleaved":
            parts.append(f"vpp={self.vpp}")  # zbv/dualpipev imply their 2 chunks
        if self.dp > 1:
            parts.append(f"dp={self.dp}")
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.mb > 1:
            parts.append(f"mb={self.mb}")
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.capacity is not None:
            parts.append(f"capacity={self.capacity!r}")
        return ",".join(parts) or "none"

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
    def validate(
        self,
        *,
        world_size: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        vocab: int | None = None,
        num_layers: int | None = None,
        num_experts: int | None = None,
        global_batch: int | None = None,
        seq_len: int | None = None,
    ) -> "Plan":
        """Check the plan against a model and a run; return ``self`` or raise AutoparError.

        Arguments left as ``None`` are not checked. ``num_kv_heads=None`` means the same
        as ``num_heads`` (no GQA). ``num_experts=0`` means a dense model.
        """
        if world_size is not None and world_size != self.world_size:
            rest = self.pp * self.cp * self.tp
            hint = (
                f"with the other degrees unchanged, dp={world_size // rest} fits"
                if world_size % rest == 0
                else f"pp*cp*tp={rest} does not divide {world_size}, so change those degrees"
            )
            raise AutoparError(
                f"autopar: plan '{self}' needs pp*dp*cp*tp = {self.pp}*{self.dp}*{self.cp}*"
                f"{self.tp} = {self.world_size} ranks, but the world size is {world_size}; "
                f"{hint}"
            )
        kv = num_kv_heads if num_kv_heads is not None else num_heads
        if num_heads is not None:
            self._check_heads(num_heads, kv)
        elif num_kv_heads is not None:
            self._check_kv_cp(num_kv_heads)
        # a vocabulary tp does not divide is padded to ceil(V/tp) rows per rank (plan_space.padded_vocab: no rule)
        if num_layers is not None:
            chunks = self.pp * self.num_chunks_per_rank
            if not layers_ok(self.pp, self.num_chunks_per_rank, num_layers):
                raise AutoparError(
                    f"autopar: plan '{self}' cuts the model into pp*chunks_per_rank = "
                    f"{self.pp}*{self.num_chunks_per_rank} = {chunks} pipeline chunks, but "
                    f"it has only {num_layers} layers; use at most {num_layers} chunks "
                    f"(a smaller pp or vpp)"
                )
        if num_experts is not None:
            if num_experts == 0 and (not experts_ok(self.ep, 0) or self.capacity is not None):
                what = f"ep={self.ep}" if self.ep > 1 else f"capacity={self.capacity!r}"
                raise AutoparError(
                    f"autopar: {what} applies to mixture-of-experts layers, but the model "
                    f"has no experts; drop {what.split('=')[0]}"
                )
            if num_experts and not experts_ok(self.ep, num_experts):
                good = [d for d in divisors(num_experts) if ep_ok(d, self.dp, self.cp)]
                raise AutoparError(
                    f"autopar: ep={self.ep} does not divide the {num_experts} experts; ep "
                    f"must divide both the experts and dp*cp={self.dp * self.cp}: valid ep "
                    f"values are {_fmt_list(good)}"
                )
        if global_batch is not None:
            self._check_batch(global_batch)
        if seq_len is not None:
            self._check_seq(seq_len)
        return self

    def _check_heads(self, heads: int, kv: int) -> None:
        if not heads_ok(self.tp, heads, kv):
            raise AutoparError(
                f"autopar: tp={self.tp} does not divide the {heads} attention heads; tensor "
                f"parallelism splits whole heads, so tp must be one of {_fmt_list(divisors(heads))}"
            )
        self._check_kv_cp(kv)
        if not ulysses_ok(self.cp, _code("cp_variant", self.cp_variant), heads, kv, self.tp):
            split = self.tp * self.cp
            # tp divides gcd(heads, kv) here, so cp must divide what is left per tp rank.
            good_cp = [c for c in divisors(math.gcd(heads, kv) // self.tp) if c > 1]
            hint = (
                f"with tp={self.tp} use cp in {_fmt_list(good_cp)}, or"
                if good_cp
                else f"with tp={self.tp} no cp>1 fits; use"
            )
            raise AutoparError(
                f"autopar: cp={self.cp}:ulysses splits the heads over tp*cp = "
                f"{self.tp}*{self.cp} = {split} ranks, but the model has {heads} heads "
                f"and {kv} KV heads, which must both be divisible by {split}; {hint} "
                f"the ring or allgather variant"
            )

    def _check_kv_cp(self, kv: int) -> None:
        if not kv_cp_ok(self.tp, self.cp, kv):
            good_tp = [t for t in divisors(kv) if t > 1]
            raise AutoparError(
                f"autopar: tp={self.tp} does not divide the {kv} KV heads, so every tp rank holds all of "
                f"them (KV-head replication), which context parallelism does not run: use cp=1 with "
                f"tp={self.tp}" + (f", or a tp that divides the KV heads ({_fmt_list(good_tp)}) with cp={self.cp}"
                                   if good_tp else "")
            )

    def _check_batch(self, global_batch: int) -> None:
        parts = self.dp * self.mb
        if batch_ok(global_batch, self.dp, self.mb):
            return
        if not batch_ok(global_batch, self.dp, 1):
            good_dp = divisors(global_batch)
            raise AutoparError(
                f"autopar: the global batch of {global_batch} does not split into dp={self.dp} "
                f"replicas times mb={self.mb} micro-batches; dp must divide the batch "
                f"(valid dp: {_fmt_list(good_dp)}), or use a batch that is a multiple of "
                f"{parts}"
            )
        per_replica = global_batch // self.dp
        near = _nearest(divisors(per_replica), self.mb)
        raise AutoparError(
            f"autopar: the global batch of {global_batch} does not split into dp*mb = "
            f"{self.dp}*{self.mb} = {parts} equal parts; each replica gets {per_replica} "
            f"samples, so mb must divide {per_replica}: the nearest valid mb is "
            f"{' or '.join(str(m) for m in near)}"
        )

    def _check_seq(self, seq_len: int) -> None:
        if not cp_seq_ok(seq_len, self.cp):
            lo = seq_len // (2 * self.cp) * 2 * self.cp
            near = [n for n in (lo, lo + 2 * self.cp) if n > 0]
            raise AutoparError(
                f"autopar: cp={self.cp} cuts the sequence into 2*cp = {2 * self.cp} chunks "
                f"(two per rank, to balance causal attention), but the sequence length "
                f"{seq_len} is not a multiple of {2 * self.cp}; use a sequence length of "
                f"{' or '.join(str(n) for n in near)}, or a cp with 2*cp dividing {seq_len}"
            )
        if not sp_seq_ok(seq_len, self.cp, self.tp, self.sp):
            local = seq_len // self.cp
            step = self.cp * self.tp
            lo = seq_len // step * step
            near = [n for n in (lo, lo + step) if n > 0]
            raise AutoparError(
                f"autopar: sp splits each rank's {local}-token sequence over tp={self.tp} "
                f"ranks, but {local} is not a multiple of {self.tp}; use a sequence length "
                f"of {' or '.join(str(n) for n in near)} (a multiple of cp*tp = {step}), or "
                f"drop sp"
            )



def _parse_value(key: str, value: str, text: str) -> dict:
    """The fields one ``key=value`` token of plan ``text`` sets (``sp`` is handled by the caller)."""
    fields: dict = {}
    if key in ("cp", "pp"):
        number, colon, variant = (p.strip() for p in value.partition(":"))
        if colon:
            allowed = CP_VARIANTS if key == "cp" else SCHEDULES
            if variant.lower() not in allowed:
                what = "context-parallel variant" if key == "cp" else "pipeline schedule"
                raise AutoparError(
                    f"autopar: unknown {what} {variant!r} in {text!r}; expected one "
                    f"of {_fmt_list(allowed)} (e.g. {key}={number or 2}:{allowed[0]})"
                )
            fields["cp_variant" if key == "cp" else "schedule"] = variant.lower()
        fields[key] = _parse_int(key, number, text)
    elif key in _INT_OPTIONS:
        fields[key] = _parse_int(key, value, text)
    elif key == "recompute":
        if value.lower() not in RECOMPUTE_MODES:
            raise AutoparError(
                f"autopar: unknown recompute mode {value!r} in {text!r}; expected one "
                f"of {_fmt_list(RECOMPUTE_MODES)}"
            )
        fields["recompute"] = value.lower()
    else:  # capacity
        try:
            fields["capacity"] = float(value)
        except ValueError:
            raise AutoparError(
                f"autopar: capacity needs a number, got {value!r} in {text!r}; "
                f"write e.g. capacity=1.25"
            ) from None
    return fields


def _parse_int(key: str, value: str, text: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise AutoparError(
            f"autopar: plan option {key!r} needs an integer, got {value!r} in {text!r}; "
            f"write e.g. {key}=2"
        ) from None


def _close_option(key: str) -> str | None:
    match = difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.6)
    return match[0] if match else None
