"""estimate(): score one plan; Cost: its step time, MFU, memory and term-by-term breakdown.

The plan is evaluated on every pipeline rank (model.py); the step time uses the slowest
rank, the memory the fullest. ``Cost.breakdown()`` lists each term with its sympy
formula (plan flags substituted) and value, ``Cost.comm_table()`` the collectives one
rank issues per optimizer step, ``str(cost)`` a readable report for the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import encode

from . import symbols
from .buckets import BUCKET_FIELDS, DEFAULT_BUCKET_BYTES, bucket_counts
from .comm import CommRow, routed_all_to_all_rows
from .flops import model_flops, per_token_layer_flops
from .hardware import Cluster
from .model import (DEFAULT_CONSTANTS, evaluate, model_formulas, model_values, plan_values, shared_host_step,
                    step_time_arrays)
from .pipeline import inflight, stage_views
from .spec import ModelSpec

__all__ = ["Term", "PeakBreakdown", "Cost", "estimate", "head_layers"]


@dataclass(frozen=True)
class Term:
    name: str
    category: str      # "compute" | "comm" | "bubble" | "memory" | "step"
    formula: sympy.Expr | None  # None when breakdown(formulas=False) skipped the substitution
    value: float       # seconds per step (time terms) or bytes (memory terms)

    def __str__(self) -> str:
        unit = _fmt_bytes(self.value) if self.category == "memory" else _fmt_time(self.value)
        return f"{self.name:<38} {unit:>12}   {self.formula}"


@dataclass(frozen=True)
class PeakBreakdown:
    """One pp rank's peak, term by term (:meth:`Cost.peak_breakdown`): ``terms`` maps each memory
    term to ``(bytes, bytes alive at the peak)``; ``moment`` is the moment of the step that peaks
    (cost/memory.py ``MOMENTS``, described by ``what``); ``peak`` is the sum of the second column."""

    pp_rank: int
    moment: str
    what: str
    terms: dict[str, tuple[float, float]]
    peak: float

    @property
    def sum_of_terms(self) -> float:
        """Every term added up: more than the peak, the terms are never all alive at once."""
        return sum(total for total, _ in self.terms.values())


def _fmt_time(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.3f} s"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def head_layers(spec: ModelSpec, seq_len: int) -> float:
    """The LM head's compute in units of an average layer (for balancing pipeline stages)."""
    dense, moe, head = per_token_layer_flops(spec, seq_len)
    nmoe = spec.num_moe_layers
    avg = ((spec.num_layers - nmoe) * dense + nmoe * moe) / spec.num_layers
    return head / avg


@dataclass
class Cost:
    """The predicted cost of one plan (see estimate())."""

    plan: Plan
    spec: ModelSpec
    cluster: Cluster
    seq_len: int
    global_batch: int
    step_time: float
    mfu: float
    memory_per_gpu: float
    tokens_per_s: float
    bubble: float
    bottleneck_pp_rank: int
    memory_pp_rank: int
    _out: dict = field(repr=False)
    _subs: dict = field(repr=False)
    _model: object = field(repr=False)
    dtype_bytes: int = 2
    shared_cores: float = 0.0  # <= 0: the bubble's time other ranks of a time-shared host run in (model.shared_host_step)

    @property
    def fits(self) -> bool:
        return self.memory_per_gpu <= self.cluster.usable_memory

    def _value(self, name: str, pp_rank: int) -> float:
        return float(self._out[name][pp_rank])

    def _formula(self, expr) -> sympy.Expr:
        return sympy.sympify(expr).xreplace(self._subs)

    def memory(self, pp_rank: int | None = None) -> dict[str, float]:
        """Bytes per GPU by category on pipeline rank ``pp_rank`` (default: the fullest)."""
        r = self.memory_pp_rank if pp_rank is None else pp_rank
        return {n.split(".", 1)[1]: self._value(n, r) for n in self._out if n.startswith("memory.")}

    def peak_memory(self, pp_rank: int | None = None) -> float:
        """The step's peak bytes per GPU on pipeline rank ``pp_rank`` (default: the fullest):
        cost/memory.py's ``peak_memory`` timeline over the terms of :meth:`memory`, which are
        not all alive at once (their sum over-counts)."""
        return self._value("memory", self.memory_pp_rank if pp_rank is None else pp_rank)

    def peak_breakdown(self, pp_rank: int | None = None) -> PeakBreakdown:
        """Pipeline rank ``pp_rank``'s (default: the fullest) memory terms with the part of each alive at
        its peak: the static terms whole, the others as the moment that peaks holds them
        (cost/memory.py ``peak_parts``); the second column sums to :meth:`peak_memory`."""
        from .memory import MOMENTS, STATIC_TERMS

        r = self.memory_pp_rank if pp_rank is None else pp_rank
        totals = self.memory(r)
        moments = {mo: sum(self._value(f"peak.{mo}.{t}", r) for t in totals if f"peak.{mo}.{t}" in self._out)
                   for mo in MOMENTS}
        moment = max(moments, key=moments.get)
        alive = {t: (v if t in STATIC_TERMS else self._value(f"peak.{moment}.{t}", r) if f"peak.{moment}.{t}" in self._out
                     else 0.0) for t, v in totals.items()}
        return PeakBreakdown(r, moment, MOMENTS[moment], {t: (totals[t], alive[t]) for t in totals},
                             sum(alive.values()))

    def memory_moments(self, pp_rank: int | None = None) -> dict[str, dict[str, float]]:
        """Pipeline rank ``pp_rank``'s (default: the fullest) memory over the step: moment (cost/memory.py
        ``MOMENTS``, in step order) -> term -> bytes alive then, static terms whole; the largest moment's
        sum is :meth:`peak_memory` (the report's memory band chart)."""
        from .memory import MOMENTS, STATIC_TERMS

        r = self.memory_pp_rank if pp_rank is None else pp_rank
        totals = self.memory(r)
        return {mo: {t: (v if t in STATIC_TERMS else self._value(f"peak.{mo}.{t}", r)
                         if f"peak.{mo}.{t}" in self._out else 0.0) for t, v in totals.items()} for mo in MOMENTS}

    def flops(self, pp_rank: int | None = None) -> float:
        """FLOPs of one optimizer step on pipeline rank ``pp_rank`` (default: the slowest), counted
        as torch's ``FlopCounterMode`` counts them: matmuls and attention, forward, backward and
        recompute (cost/flops.py ``counted_flops``; :meth:`flops_terms` has them term by term)."""
        return self._value("flops", self.bottleneck_pp_rank if pp_rank is None else pp_rank)

    def flops_terms(self, pp_rank: int | None = None) -> dict[str, float]:
        """:meth:`flops` term by term (matmul and attention, forward and backward, recompute)."""
        r = self.bottleneck_pp_rank if pp_rank is None else pp_rank
        return {n.split(".", 1)[1]: self._value(n, r) for n in self._out if n.startswith("flops.")}

    def breakdown(self, *, formulas: bool = True) -> list[Term]:
        """Each term: per-step time on the slowest rank, bubble, and memory on the fullest.

        ``formulas=False`` leaves ``Term.formula`` None: the values alone are cheap, while
        substituting the plan into every sympy formula takes seconds (``autopar plan``'s table)."""
        model, r, mb = self._model, self.bottleneck_pp_rank, self.plan.mb
        # The sympy formulas are touched only when asked for (from the disk cache they are rebuilt).
        exprs = dict(zip(model.names, model.exprs)) if formulas else {}

        def formula(name, scale=1):
            return self._formula(scale * exprs[name]) if formulas else None

        terms: list[Term] = []
        for name in model.names:
            if name.startswith("compute.") and self._value(name, r) > 0:
                terms.append(Term(name, "compute", formula(name, symbols.m), mb * self._value(name, r)))
        for i, row in enumerate(model.rows):
            value = self._value(f"row{i}.time", r)
            if value > 0 and self._value(f"row{i}.count", r) > 0:
                label = f"comm.{row.phase}.{row.dimension}.{row.collective}"
                terms.append(Term(label, "comm", formula(f"row{i}.time"), value))
                terms.append(Term(label + " (exposed)", "comm", formula(f"row{i}.exposed"),
                                  self._value(f"row{i}.exposed", r)))
        bubble = self._formula(self._bubble_formula()) if formulas else None
        terms.append(Term("bubble", "bubble", bubble, self.bubble))
        if self.shared_cores:  # negative: the bubble's time the host's other ranks run in
            terms.append(Term("bubble (shared cores)", "bubble", None, self.shared_cores))
        terms.append(Term("optimizer", "step", formula("optimizer"), self._value("optimizer", r)))
        for name, value in self.memory().items():
            terms.append(Term(f"memory.{name}", "memory", formula(f"memory.{name}"), value))
        return terms

    def _bubble_formula(self):
        from .pipeline import bubble_expr
        return bubble_expr(self.plan.schedule if self.plan.pp > 1 else "1f1b")

    def comm_table(self, pp_rank: int = 0, *, expert_counts=None, ep_rank: int = 0) -> list[CommRow]:
        """Collectives one rank of pipeline rank ``pp_rank`` issues per optimizer step.

        MoE token all-to-alls are priced at the expected routing (uniform x ``routing_imbalance``,
        or the capacity factor); given the realised ``expert_counts`` of each MoE call (as the
        runtime records them in ``comm_stats()``) they are the exact rows of rank ``ep_rank``."""
        if not 0 <= pp_rank < self.plan.pp:
            raise AutoparError(f"autopar: pipeline rank {pp_rank} is outside 0..{self.plan.pp - 1}")
        p = self.plan
        dp_axis = "dp" if p.cp == 1 else "dp_cp"
        out = []
        for i, row in enumerate(self._model.rows):
            count = self._value(f"row{i}.count", pp_rank)
            group = self._value(f"row{i}.group", pp_rank)
            sent, recv = self._value(f"row{i}.sent", pp_rank), self._value(f"row{i}.recv", pp_rank)
            if count <= 0 or group <= 1 or (sent <= 0 and recv <= 0):
                continue
            # The runtime's group of that name: plain dp without cp, dp_cp for the experts' copies
            # too when neither ep nor tp splits them.
            axis = {"dp_cp": dp_axis, "edp": dp_axis if p.ep == 1 and p.tp == 1 else "edp"}.get(row.axis, row.axis)
            if expert_counts is not None and row.routed:
                continue
            out.append(CommRow(row.phase, row.dimension, row.collective, axis, int(round(group)),
                               sent, recv, int(round(count)), row.what))
        if expert_counts is not None and p.ep > 1:
            out += routed_all_to_all_rows(expert_counts, ep_rank=ep_rank, hidden=self.spec.hidden,
                                          dtype_bytes=self.dtype_bytes)
        return out

    def format(self, verbose: bool = False) -> str:
        cap = self.cluster.usable_memory
        lines = [
            f"plan {self.plan}  ({self.plan.world_size} GPUs, {self.cluster.gpu}, seq {self.seq_len}, "
            f"global batch {self.global_batch})",
            f"  step time     {_fmt_time(self.step_time)}   (bubble {_fmt_time(self.bubble)}, "
            f"slowest pp rank {self.bottleneck_pp_rank})",
            f"  throughput    {self.tokens_per_s:,.0f} tokens/s   MFU {self.mfu * 100:.1f}%",
            f"  memory/GPU    {_fmt_bytes(self.memory_per_gpu)}: the peak of pp rank {self.memory_pp_rank}, the "
            f"fullest, of {_fmt_bytes(cap)} usable ({'fits' if self.fits else 'DOES NOT FIT'})",
        ]
        terms = self.breakdown()
        lines.append("  time per step (slowest rank):")
        for t in sorted((t for t in terms if t.category != "memory"), key=lambda t: -t.value):
            if t.value > 0 and (verbose or t.value >= 1e-3 * self.step_time):
                lines.append("    " + (str(t) if verbose else f"{t.name:<38} {_fmt_time(t.value):>12}"))
        peak = self.peak_breakdown()
        lines.append(f"  memory per GPU, pp rank {peak.pp_rank} (term, its part alive at the peak: * ; "
                     f"the peak is {peak.what}, cost/memory.py peak_memory):")
        formulas = {t.name: t for t in terms if t.category == "memory"}
        for name, (total, alive) in peak.terms.items():
            if total > 0:
                line = f"memory.{name:<31} {_fmt_bytes(total):>12} {_fmt_bytes(alive):>12} {'*' if alive > 0 else ' '}"
                lines.append("    " + line + (f"   {formulas['memory.' + name].formula}" if verbose else ""))
        lines.append(f"    {'peak':<38} {'':>12} {_fmt_bytes(peak.peak):>12}")
        lines.append(f"    {'sum of all terms (never all alive)':<38} {_fmt_bytes(peak.sum_of_terms):>12}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _as_spec(spec) -> ModelSpec:
    return ModelSpec.preset(spec) if isinstance(spec, str) else spec


def _as_cluster(cluster) -> Cluster:
    return Cluster(gpu=cluster) if isinstance(cluster, str) else cluster


def estimate(spec, cluster, plan, seq_len: int, global_batch: int, *, dtype_bytes: int = 2,
             grad_bytes: int | None = None, activation_formula: str = "derived",
             tp_comm_overlap: bool = False, zero_overlap: bool = True, routing_imbalance: float = 1.0,
             flash_attention: bool = True, constants: dict | None = None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Cost:
    """Predict step time, MFU and memory of ``plan`` for ``spec`` on ``cluster``.

    ``dtype_bytes``: 2 for bf16 mixed precision, 4 for fp32 (memory.py states the
    conventions); ``grad_bytes``: bytes of a held gradient (default 4, Megatron's fp32
    main grads, when dtype_bytes is 2); ``activation_formula``: "derived" (ours, Llama-style
    layers) or "korthikanti" (GPT layer, set C); ``tp_comm_overlap``: TP collectives hidden
    behind GEMMs (Megatron-Core's userbuffers); ``zero_overlap``: ZeRO-1's reduce-scatters and
    ZeRO-1/2's after-step all-gathers hidden behind the last backward and the next forward (as
    autopar's runtime and Megatron's distributed optimizer run them; False: blocking);
    ``routing_imbalance``: MoE load factor of
    the busiest rank; ``flash_attention``: False models Megatron's older unfused attention
    (full score matrix, memory-bound softmax and dropout); ``constants``: override the calibrated eta_max, kappa, epsilon, phi;
    ``bucket_bytes``: the gradient buckets' cap (``parallelize``'s), which sets the number of DP and
    ZeRO-1/2 calls (buckets.py).
    """
    spec, cluster = _as_spec(spec), _as_cluster(cluster)
    plan = Plan.parse(plan)
    if plan.world_size > cluster.world_size:
        raise AutoparError(
            f"autopar: plan '{plan}' needs {plan.world_size} GPUs but the cluster has "
            f"{cluster.world_size} ({cluster.num_nodes} nodes x {cluster.gpus_per_node}); use a "
            f"bigger cluster or smaller degrees")
    plan.validate(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, vocab=spec.vocab,
                  num_layers=spec.num_layers, num_experts=spec.num_experts,
                  global_batch=global_batch, seq_len=seq_len)
    consts = {**DEFAULT_CONSTANTS, **(constants or {})}
    model = model_formulas(activation_formula, True)
    x = head_layers(spec, seq_len)
    arrays = _plan_arrays(spec, plan, global_batch, x, dtype_bytes, bucket_bytes)
    values = model_values(spec, dtype_bytes=dtype_bytes, grad_bytes=grad_bytes,
                          routing_imbalance=routing_imbalance, seq_len=seq_len,
                          flash_attention=flash_attention)
    values.update(plan_values(cluster, arrays, constants=consts, tp_comm_overlap=tp_comm_overlap,
                              zero_overlap=zero_overlap, capacity=plan.capacity))
    out = evaluate(model, values)
    slow = int(np.argmax(out["T_f"] + out["T_b"]))
    tf, tb, tw = (out[n][slow:slow + 1] for n in ("T_f", "T_b", "T_w"))
    pipe, bubble = step_time_arrays(model, arrays["schedule"][:1], tf, tb, tw, arrays["pp"][:1],
                                    arrays["vpp"][:1], arrays["m"][:1])
    per_step = float(np.max(out["step_comm"]) + np.max(out["optimizer"]))
    unshared = float(pipe[0]) + per_step
    busy = plan.mb * float(np.mean(out["T_f"] + out["T_b"])) + per_step  # the pp ranks' mean
    step = float(shared_host_step(unshared, busy, cluster.core_share))
    mem_rank = int(np.argmax(out["memory"]))
    tokens = global_batch * seq_len
    subs = _switches(values)
    return Cost(plan=plan, spec=spec, cluster=cluster, seq_len=seq_len, global_batch=global_batch,
                step_time=step,
                mfu=model_flops(spec, seq_len, global_batch) / (step * plan.world_size * cluster.peak_flops),
                memory_per_gpu=float(out["memory"][mem_rank]), tokens_per_s=tokens / step,
                bubble=float(bubble[0]), shared_cores=step - unshared, bottleneck_pp_rank=slow, memory_pp_rank=mem_rank, _out=out,
                _subs=subs, _model=model, dtype_bytes=dtype_bytes)


def _plan_arrays(spec, plan, global_batch: int, x, dtype_bytes: int, bucket_bytes) -> dict[str, np.ndarray]:
    """The plan's encoded columns, one row per pp rank, with each pp rank's layers, sends and
    receives, gradient buckets and micro-batches in flight (the inputs ``estimate`` evaluates)."""
    views = stage_views(spec, plan.pp, plan.schedule, plan.vpp, x)
    pp = plan.pp
    arrays = {key: np.full(pp, val, dtype=np.float64) for key, val in encode(plan).items()}
    arrays["b"] = np.full(pp, global_batch / (plan.dp * plan.mb))
    arrays["schedule"] = arrays["schedule"].astype(np.int64)
    for key, attr in (("ld", "dense"), ("le", "moe"), ("first", "first"), ("last", "last"),
                      ("nsend", "sends"), ("nrecv", "recvs")):
        arrays[key] = np.array([getattr(v, attr) for v in views], dtype=np.float64)
    counts = bucket_counts(spec, tp=plan.tp, ep=plan.ep, pp=pp, schedule=plan.schedule, vpp=plan.vpp, head_layers=x,
                           param_bytes=dtype_bytes, bucket_bytes=bucket_bytes)
    for key, attr in BUCKET_FIELDS.items():
        arrays[key] = np.array([getattr(c, attr) for c in counts], dtype=np.float64)
    arrays["infl"] = inflight(plan.schedule, pp, plan.num_chunks_per_rank,
                              np.arange(pp, dtype=np.float64), plan.mb)
    return arrays


def _switches(values: dict) -> dict:
    """The 0/1 switches and plan-wide numbers of one plan, as sympy numbers for ``Cost``'s
    formulas (its breakdown substitutes them before printing a term)."""
    subs = {sym: values[sym.name] for sym in (symbols.SP, symbols.RSEL, symbols.RFULL, symbols.Z1, symbols.Z2,
                                              symbols.Z3, symbols.CPRING, symbols.CPAG, symbols.CPUL, symbols.gated,
                                              symbols.qb, symbols.nn, symbols.FLASH, symbols.TPOV, symbols.DPV)}
    subs = {k: (float(v[0]) if isinstance(v, np.ndarray) else float(v)) for k, v in subs.items()}
    subs = {k: sympy.Integer(int(v)) if v == int(v) else sympy.Float(v) for k, v in subs.items()}
    return subs
