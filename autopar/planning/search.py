"""Plan search: enumerate every plan for a model and cluster, score them vectorised, rank.

The space is :mod:`autopar.plan_space`'s: every structure (:func:`autopar.plan_space.structures`:
the factorisations of the world into ``pp * dp * cp * tp``, ``ep``, SP, the CP variant, the
schedule and ``vpp``, pruned by the rules of a plan and of the model), expanded here over
arrays by the micro-batch size (hence the number of micro-batches), the ZeRO stage and the
recompute mode, and kept where the same rules hold on the arrays (micro-batch counts the
schedule runs, what the search prices, and with ``runnable`` what the runtime runs); then the
predicted memory must fit the GPU.  :func:`autopar.plan_space.candidates` is the same space,
one plan at a time.

Candidates are columns: a dict of numpy arrays keyed by the encoded plan's fields
(:data:`autopar.plan_space.PLAN_COLUMNS`, :func:`autopar.plan_space.encode`) plus ``b`` (the
micro-batch size) and ``base`` (the candidate's structure).

Scoring goes through the cost model's lambdified formulas (autopar.cost.model): one call
per scored pipeline rank (the first, the last and the busiest) over arrays of all
candidates, never sympy per candidate. The best plans are re-scored with
:func:`autopar.cost.estimate` on every rank, and only plans that fit are returned.
"""
from __future__ import annotations

import inspect
from typing import Callable

import numpy as np

from autopar.cost.buckets import BUCKET_FIELDS, bucket_counts
from autopar.cost.estimate import Cost, _as_cluster, _as_spec, estimate, head_layers
from autopar.cost.model import (DEFAULT_CONSTANTS, compute_formulas, evaluate, link_values, memory_formulas,
                                model_formulas, model_values, plan_values, shared_host_step,
                                step_time_arrays)
from autopar.cost.pipeline import inflight, stage_views
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import (RECOMPUTE_MODES, SCHEDULES, STRUCTURE_FIELDS, ZERO_STAGES, code, decode, divisors,
                                interleaved_priced, microbatches_ok, model_facts, runnable, structures,
                                zero_meaningful)

__all__ = ["search", "enumerate_plans", "STRUCTURE_FIELDS", "SPACE_OPTIONS", "ESTIMATE_OPTIONS"]

# Stage-view column -> StageView attribute, per structure and scored rank slot.
_VIEW_FIELDS = {"ld": "dense", "le": "moe", "first": "first", "last": "last", "nsend": "sends",
                "nrecv": "recvs", "pp_rank": "pp_rank"}

ESTIMATE_OPTIONS = tuple(name for name, p in inspect.signature(estimate).parameters.items()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)
"""The options :func:`search` passes on to :func:`autopar.cost.estimate` (its keyword-only
parameters, read from its signature)."""

SPACE_OPTIONS = {
    "world_size": "the ranks a plan uses (default: the whole cluster)",
    "schedules": "pipeline schedules to try (names; default: all)",
    "cp_variants": "CP variants to try (names; default: all)",
    "zero_stages": "ZeRO stages to try (default: 0-3)",
    "recompute_modes": "recompute modes to try (default: all)",
    "sp": "True or False: only plans with or without SP (default: both)",
    "max_tp": "the largest tp",
    "max_microbatch": "the largest micro-batch size (default 64)",
    "microbatches": "the micro-batch counts to try (default: all)",
    "runnable": "True (default): only plans the runtime runs (autopar.plan_space.runnable, the rules "
                "parallelize checks); False: every plan the cost model prices",
    "chunk_size": "candidates per memory / lower-bound pass (default 400000)",
    "batch_size": "candidates per first full-scoring batch (default 4096)",
}
"""The options of :func:`search` that shape the space and its scoring, with what they do."""


def _restrictions(opts: dict) -> dict:
    """The options :func:`autopar.plan_space.structures` takes."""
    return {k: opts.get(k) for k in ("schedules", "cp_variants", "sp", "max_tp")}


def _structures(spec, world_size: int, seq_len: int, global_batch: int, opts: dict) -> dict[str, np.ndarray]:
    """The structures of the plan space, as int64 columns keyed by STRUCTURE_FIELDS."""
    cols = structures(world_size, model_facts(spec), seq_len=seq_len, global_batch=global_batch,
                      **_restrictions(opts))
    return {name: np.array(col, dtype=np.int64) for name, col in cols.items()}


def enumerate_plans(spec, world_size: int, seq_len: int, global_batch: int, **opts) -> dict[str, np.ndarray]:
    """All candidate plans as integer-coded arrays (:func:`autopar.plan_space.encode`'s keys, ``b``
    and ``base``); with ``runnable`` (default True) only those the runtime runs."""
    base = _structures(spec, world_size, seq_len, global_batch, opts)
    if not len(base["pp"]):
        return {}
    max_b = opts.get("max_microbatch", 64)
    bvals = np.array([b for b in divisors(global_batch) if b <= max_b], dtype=np.int64)
    per_replica = global_batch // base["dp"]
    ok = (per_replica[:, None] % bvals[None, :]) == 0
    m = per_replica[:, None] // bvals[None, :]
    sched, pp = base["schedule"][:, None], base["pp"][:, None]
    ok &= microbatches_ok(sched, pp, m) & interleaved_priced(sched, pp, m)
    if opts.get("microbatches"):
        ok &= np.isin(m, np.asarray(opts["microbatches"]))
    rows, cols = np.nonzero(ok)
    zeros = np.asarray(opts.get("zero_stages", ZERO_STAGES))
    recomputes = np.asarray([code("recompute", r) for r in opts.get("recompute_modes", RECOMPUTE_MODES)])
    n_opt = len(zeros) * len(recomputes)
    idx = np.repeat(rows, n_opt)
    bsel = np.repeat(bvals[cols], n_opt)
    zero = np.tile(np.repeat(zeros, len(recomputes)), len(rows))
    rec = np.tile(np.tile(recomputes, len(zeros)), len(rows))
    arrays = {name: col[idx] for name, col in base.items()}
    arrays.update(b=bsel, m=global_batch // (arrays["dp"] * bsel), zero=zero, recompute=rec, base=idx)
    keep = zero_meaningful(arrays["zero"], arrays["dp"], arrays["cp"])
    if opts.get("runnable", True):
        facts = model_facts(spec)
        keep &= runnable(arrays, moe=facts["num_experts"] > 0, tied=facts["tied"])
    out = {k: v[keep].astype(np.float64) for k, v in arrays.items()}
    out["schedule"] = out["schedule"].astype(np.int64)
    return out


def _view_tables(spec, base: dict[str, np.ndarray], seq_len: int, param_bytes: int,
                 bucket_bytes: int) -> dict[str, np.ndarray]:
    """Per structure and scored slot (first rank, last rank, busiest rank): the stage view and the
    rank's gradient buckets, as (structures, 3) float columns keyed ld le first last nsend nrecv
    pp_rank and nbd nud nbe nue."""
    x = head_layers(spec, seq_len)
    moe_cost = 1.0
    if spec.is_moe:
        from autopar.cost.flops import per_token_layer_flops
        dense, moe, _ = per_token_layer_flops(spec, seq_len)
        moe_cost = moe / dense
    keys: dict[tuple[int, int, int], int] = {}
    which = np.array([keys.setdefault(k, len(keys)) for k in zip(
        base["pp"].tolist(), base["schedule"].tolist(), base["vpp"].tolist())], dtype=np.int64)
    table = {name: np.zeros((len(keys), 3)) for name in _VIEW_FIELDS}
    for (pp, schedule, vpp), j in keys.items():
        views = stage_views(spec, pp, SCHEDULES[schedule], vpp, x)
        # Ties (equal layers) go to the rank with the most P2P traffic.
        cost = [v.dense + moe_cost * v.moe + x * v.last + 1e-3 * (v.sends + v.recvs) for v in views]
        slots = (views[0], views[-1], views[int(np.argmax(cost))])
        for name, attr in _VIEW_FIELDS.items():
            table[name][j] = [getattr(v, attr) for v in slots]
    out = {name: col[which] for name, col in table.items()}
    out.update(_bucket_tables(spec, base, out["pp_rank"], x, param_bytes, bucket_bytes))
    return out


def _bucket_tables(spec, base: dict[str, np.ndarray], pp_rank: np.ndarray, x: float, param_bytes: int,
                   bucket_bytes: int) -> dict[str, np.ndarray]:
    """Per structure and scored slot: the gradient-bucket counts of the slot's pipeline rank
    (:func:`autopar.cost.buckets.bucket_counts`, once per pp, schedule, vpp, tp and ep)."""
    keys: dict[tuple[int, ...], int] = {}
    which = np.array([keys.setdefault(k, len(keys)) for k in zip(
        *(base[f].tolist() for f in ("pp", "schedule", "vpp", "tp", "ep")))], dtype=np.int64)
    out = {name: np.zeros(pp_rank.shape) for name in BUCKET_FIELDS}
    for (pp, schedule, vpp, tp, ep), j in keys.items():
        counts = bucket_counts(spec, tp=tp, ep=ep, pp=pp, schedule=SCHEDULES[schedule], vpp=vpp, head_layers=x,
                               param_bytes=param_bytes, bucket_bytes=bucket_bytes)
        rows = np.nonzero(which == j)[0]
        ranks = pp_rank[rows].astype(np.int64)
        for name, attr in BUCKET_FIELDS.items():
            out[name][rows] = np.array([getattr(c, attr) for c in counts], dtype=np.float64)[ranks]
    return out


def search(spec, cluster, seq_len: int, global_batch: int, top: int = 10, *,
           progress: Callable[[int, int], None] | None = None, **options) -> list[tuple[Plan, Cost]]:
    """The ``top`` fastest plans that fit, best first, as (Plan, Cost) pairs.

    ``options``: :func:`autopar.cost.estimate`'s keyword options ({estimate_options}), and the
    options of the space and its scoring:

{space_options}

    ``progress(done, total)`` is called as candidates are scored.
    """
    spec, cluster = _as_spec(spec), _as_cluster(cluster)
    est_opts, world_size = _split_options(options, cluster)
    cands = enumerate_plans(spec, world_size, seq_len, global_batch, **options)
    total = len(cands.get("tp", ()))
    if not total:
        raise AutoparError(
            f"autopar: no plan splits {spec.name} over {world_size} GPUs with seq {seq_len} and global "
            f"batch {global_batch}; check that the batch and heads have divisors matching the world size")
    base = _structures(spec, world_size, seq_len, global_batch, options)
    scorer = _Scorer(spec, cluster, seq_len, cands, base, est_opts)
    lower = scorer.lower_bounds(int(options.get("chunk_size", 400_000)), progress)
    step = scorer.step_times(lower, top, int(options.get("batch_size", 4096)))
    if progress is not None:
        progress(2 * total, 2 * total)
    return _fitting_plans(spec, cluster, cands, step, top, seq_len, global_batch, est_opts)


if search.__doc__:  # (python -OO drops docstrings)
    search.__doc__ = search.__doc__.format(
        estimate_options=", ".join(ESTIMATE_OPTIONS),
        space_options="\n".join(f"    * ``{name}``: {what}" for name, what in SPACE_OPTIONS.items()))

_ESTIMATE_DEFAULTS = {name: p.default for name, p in inspect.signature(estimate).parameters.items()
                      if name in ESTIMATE_OPTIONS}


def _split_options(options: dict, cluster) -> tuple[dict, int]:
    """Pop estimate()'s options and ``world_size`` off ``options`` and reject unknown ones."""
    est_opts = {k: options.pop(k) for k in list(options) if k in ESTIMATE_OPTIONS}
    world_size = options.pop("world_size", cluster.world_size)
    unknown = set(options) - set(SPACE_OPTIONS)
    if unknown:
        raise AutoparError(f"autopar: unknown search option(s) {', '.join(sorted(unknown))}; expected "
                           f"{', '.join(ESTIMATE_OPTIONS + tuple(SPACE_OPTIONS))}")
    return est_opts, world_size


class _Scorer:
    """The lambdified cost formulas evaluated over arrays of candidates, one scored rank slot at a time."""

    def __init__(self, spec, cluster, seq_len: int, cands: dict[str, np.ndarray],
                 base: dict[str, np.ndarray], est_opts: dict):
        """Stage views and link figures per structure, and the lambdified formulas of ``est_opts``."""
        opts = {**_ESTIMATE_DEFAULTS, **est_opts}
        self.cluster, self.cands, self.total = cluster, cands, len(cands["tp"])
        self.views = _view_tables(spec, base, seq_len, opts["dtype_bytes"], opts["bucket_bytes"])
        self.consts = {**DEFAULT_CONSTANTS, **(opts["constants"] or {})}
        self.model = model_formulas(opts["activation_formula"], False)
        self.mvals = model_values(spec, dtype_bytes=opts["dtype_bytes"], grad_bytes=opts["grad_bytes"],
                                  routing_imbalance=opts["routing_imbalance"], seq_len=seq_len,
                                  flash_attention=opts["flash_attention"])
        # Link figures depend on the degrees only: compute them per structure, gather per candidate.
        self.base_links = link_values(cluster, base["tp"], base["cp"], base["dp"], base["pp"], base["ep"],
                                      self.consts["epsilon"])
        self.mem_model = memory_formulas(opts["activation_formula"])
        self.lb_model = compute_formulas()
        self.tp_overlap = opts["tp_comm_overlap"]
        self.zero_overlap = opts["zero_overlap"]

    def slot_values(self, arrays, links, bidx, slot, rows=None) -> dict:
        """The symbol values of the candidates (``rows`` of them, or all) on scored rank ``slot``."""
        if rows is not None:
            arrays = {k: v[rows] for k, v in arrays.items()}
            links = {k: v[rows] if np.ndim(v) else v for k, v in links.items()}
            bidx = bidx[rows]
        view = {name: col[bidx, slot] for name, col in self.views.items()}
        pp_rank = view.pop("pp_rank")
        arrays = dict(arrays, **view)
        arrays["infl"] = inflight(arrays["schedule"], arrays["pp"], arrays["vpp"], pp_rank, arrays["m"])
        values = dict(self.mvals)
        values.update(plan_values(self.cluster, arrays, constants=self.consts, tp_comm_overlap=self.tp_overlap,
                                  zero_overlap=self.zero_overlap, links=links))
        return values

    def take(self, lo, hi, rows=None):
        """Candidates ``lo:hi`` (then ``rows`` of those), their link figures and structure indices."""
        arrays = {k: v[lo:hi] for k, v in self.cands.items()}
        if rows is not None:
            arrays = {k: v[rows] for k, v in arrays.items()}
        bidx = arrays["base"].astype(np.int64)
        links = {k: np.asarray(v)[bidx] if np.ndim(v) else v for k, v in self.base_links.items()}
        return arrays, links, bidx

    def needed_slots(self, bidx):
        """Per scored slot, the candidate rows to evaluate there (None: all of them)."""
        # Slots: 0 = first rank, 1 = last rank, 2 = busiest rank; 1 and 2 only where they differ.
        pp_rank = self.views["pp_rank"][bidx]
        return [None, np.nonzero(pp_rank[:, 1] != pp_rank[:, 0])[0],
                np.nonzero((pp_rank[:, 2] != pp_rank[:, 0]) & (pp_rank[:, 2] != pp_rank[:, 1]))[0]]

    def peak_memory(self, arrays, links, bidx) -> np.ndarray:
        """Predicted memory per candidate, the largest over the scored slots."""
        mem = evaluate(self.mem_model, self.slot_values(arrays, links, bidx, 0))["memory"].copy()
        for slot, rows in enumerate(self.needed_slots(bidx)[1:], start=1):
            if len(rows):
                values = self.slot_values(arrays, links, bidx, slot, rows)
                mem[rows] = np.maximum(mem[rows], evaluate(self.mem_model, values)["memory"])
        return mem

    def lower_bounds(self, chunk: int, progress) -> np.ndarray:
        """Pass 1: a step-time lower bound per candidate from first-rank compute; inf if it does not fit."""
        # Pass 1, all candidates: memory (prune what does not fit) and a lower bound on the step
        # time from compute alone on the first rank (communication and slower ranks only add).
        total = self.total
        lower = np.full(total, np.inf)
        for lo in range(0, total, chunk):
            hi = min(lo + chunk, total)
            arrays, links, bidx = self.take(lo, hi)
            mem = self.peak_memory(arrays, links, bidx)
            rows = np.nonzero(mem <= self.cluster.usable_memory)[0]
            if len(rows):
                comp = evaluate(self.lb_model, self.slot_values(arrays, links, bidx, 0, rows))
                # T_w = T_f + T_b zeroes the zbv / dualpipev bubbles: the bound stays a bound whatever
                # the slowest rank's weight-gradient share turns out to be.
                pipe, _ = step_time_arrays(self.model, arrays["schedule"][rows], comp["T_f"], comp["T_b"],
                                           comp["T_f"] + comp["T_b"], arrays["pp"][rows], arrays["vpp"][rows],
                                           arrays["m"][rows])
                # On a time-shared host the step is at least core_share of it (shared_host_step: the
                # ranks' mean busy time may be below this rank's); 1 elsewhere.
                lower[lo + rows] = self.cluster.core_share * pipe
            if progress is not None:
                progress(hi, 2 * total)
        return lower

    def full_step_times(self, sel: np.ndarray) -> np.ndarray:
        """Full-model step times of candidates ``sel``: slowest scored rank + per-step comm + optimizer."""
        arrays, links, bidx = self.take(0, self.total, sel)
        n = len(sel)
        tf, tb, tw = np.full((3, n), -np.inf), np.zeros((3, n)), np.zeros((3, n))
        step_comm, opt = np.zeros(n), np.zeros(n)
        for slot, rows in enumerate(self.needed_slots(bidx)):
            if rows is not None and not len(rows):
                continue
            out = evaluate(self.model, self.slot_values(arrays, links, bidx, slot, rows))
            rows = slice(None) if rows is None else rows
            tf[slot, rows], tb[slot, rows], tw[slot, rows] = out["T_f"], out["T_b"], out["T_w"]
            step_comm[rows] = np.maximum(step_comm[rows], out["step_comm"])
            opt[rows] = np.maximum(opt[rows], out["optimizer"])
        slow = np.argmax(tf + tb, axis=0)
        cols = np.arange(n)
        pipe, _ = step_time_arrays(self.model, arrays["schedule"], tf[slow, cols], tb[slow, cols],
                                   tw[slow, cols], arrays["pp"], arrays["vpp"], arrays["m"])
        # The ranks' mean compute: the first and the last pp rank's where they differ (time-shared hosts).
        first, last = tf[0] + tb[0], tf[1] + tb[1]
        mean = np.where(np.isfinite(last), (first + last) / 2, first)
        busy = arrays["m"] * mean + step_comm + opt
        return shared_host_step(pipe + step_comm + opt, busy, self.cluster.core_share)

    def step_times(self, lower: np.ndarray, top: int, batch: int) -> np.ndarray:
        """Pass 2: full step times in order of the bound, inf for the candidates never reached."""
        # Pass 2, in order of the bound: the full model, until the bound passes the best found.
        step = np.full(self.total, np.inf)
        order = np.argsort(lower, kind="stable")
        order = order[np.isfinite(lower[order])]
        keep = max(4 * top, 16)
        done = 0
        while done < len(order):
            sel = np.sort(order[done:done + batch])
            step[sel] = self.full_step_times(sel)
            done += len(sel)
            found = np.sort(step[np.isfinite(step)])
            if len(found) >= keep and done < len(order) and lower[order[done]] > found[keep - 1]:
                break
            batch *= 2
        return step


def _fitting_plans(spec, cluster, cands: dict, step: np.ndarray, top: int, seq_len: int, global_batch: int,
                   est_opts: dict) -> list[tuple[Plan, Cost]]:
    """The ``top`` fastest candidates by ``step`` that estimate() confirms fit, as (Plan, Cost) by
    step time."""
    feasible = np.nonzero(np.isfinite(step))[0]
    order = feasible[np.argsort(step[feasible], kind="stable")]
    results: list[tuple[Plan, Cost]] = []
    for i in order:
        if len(results) >= top:
            break
        plan = Plan(**decode(cands, i))
        cost = estimate(spec, cluster, plan, seq_len, global_batch, **est_opts)
        if cost.fits:  # the full per-rank check of estimate() has the last word
            results.append((plan, cost))
    results.sort(key=lambda pc: pc[1].step_time)
    return results
