"""Plan search: enumerate every plan for a model and cluster, score them vectorised, rank.

The space: every factorisation of the world into ``pp * dp * cp * tp``; ``ep`` dividing
both the experts and ``dp * cp``; SP on/off; the CP variant; the pipeline schedule and
``vpp``; the micro-batch size (hence the number of micro-batches); ZeRO stage 0-3;
recompute none/selective/full. Infeasible plans are pruned: heads, KV heads and vocab
divisible by tp (KV heads are never replicated); Ulysses needs heads and KV heads
divisible by tp*cp (:func:`autopar.plan.ulysses_fits`); ``pp * chunks <= layers``; the
batch splits into dp*mb; the sequence into 2*cp chunks (and into tp shards under SP); each
schedule runs its micro-batch count (:func:`autopar.plan.micro_batches_ok`), and
interleaving gets at least ``pp`` micro-batches (below that the cost model's interleaved
bubble is too small); and the predicted memory must fit the GPU.

Candidates are columns: a dict of numpy arrays keyed by plan field (:data:`STRUCTURE_FIELDS`
and ``b m zero recompute``), names coded as their index in autopar.plan's tuples.

Scoring goes through the cost model's compiled formulas (autopar.cost.model): one call
per scored pipeline rank (the first, the last and the busiest) over arrays of all
candidates, never sympy per candidate. The best plans are re-scored with
:func:`autopar.cost.estimate` on every rank, and only plans that fit are returned.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from autopar.cost.estimate import Cost, _as_cluster, _as_spec, estimate, head_layers
from autopar.cost.model import (DEFAULT_CONSTANTS, compiled, compiled_compute, compiled_memory, evaluate,
                                link_values, model_values, plan_values, step_time_arrays)
from autopar.cost.pipeline import inflight, stage_views
from autopar.errors import AutoparError
from autopar.support import moe_needs_rewrite, unsupported
from autopar.plan import (CP_VARIANTS, MULTI_CHUNK_SCHEDULES, RECOMPUTE_MODES, SCHEDULES, Plan,
                          chunks_per_rank, micro_batches_ok, ulysses_fits)

__all__ = ["search", "enumerate_plans", "STRUCTURE_FIELDS"]

STRUCTURE_FIELDS = ("pp", "dp", "cp", "tp", "ep", "sp", "cp_variant", "schedule", "vpp")
"""The columns of a structure (a plan but for its micro-batching, ZeRO and recompute)."""
# Stage-view column -> StageView attribute, per structure and scored rank slot.
_VIEW_FIELDS = {"ld": "dense", "le": "moe", "first": "first", "last": "last", "nsend": "sends",
                "nrecv": "recvs", "rank": "rank"}

_VPP_CHOICES = (2, 3, 4, 5, 6, 8)
_ESTIMATE_OPTIONS = ("dtype_bytes", "grad_bytes", "activation_formula", "tp_comm_overlap", "zero_overlap",
                     "routing_imbalance", "flash_attention", "constants")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _structures(spec, world: int, seq_len: int, global_batch: int, opts: dict) -> dict[str, np.ndarray]:
    """The structures that pass the divisibility rules, as int64 columns keyed by STRUCTURE_FIELDS."""
    heads, kv, layers = spec.num_heads, spec.num_kv_heads, spec.num_layers
    schedules = opts.get("schedules") or SCHEDULES
    cp_variants = opts.get("cp_variants") or CP_VARIANTS
    zero_sp = opts.get("sp")  # None: both
    cols: dict[str, list[int]] = {name: [] for name in STRUCTURE_FIELDS}

    def add(**row):
        for name in STRUCTURE_FIELDS:
            cols[name].append(row[name])

    for tp in _divisors(world):
        if heads % tp or kv % tp or spec.vocab % tp or tp > opts.get("max_tp", world):
            continue
        if tp > 1 and spec.kv_lora_rank:  # latent attention: the runtime does not split it by heads
            continue
        for cp in _divisors(world // tp):
            if cp > 1 and seq_len % (2 * cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                if global_batch % dp or pp > layers:
                    continue
                eps = [e for e in _divisors(math.gcd(spec.num_experts, dp * cp))] if spec.is_moe else [1]
                sps = [False] if tp == 1 else [False, True]
                if zero_sp is not None:
                    sps = [s for s in sps if s == zero_sp] or sps[:1]
                sps = [s for s in sps if not s or (seq_len // cp) % tp == 0]
                variants = ["ring"] if cp == 1 else [
                    v for v in cp_variants if v != "ulysses" or ulysses_fits(heads, kv, tp, cp)]
                scheds = [("1f1b", 1)] if pp == 1 else []
                if pp > 1:
                    for sched in schedules:
                        vpps = _VPP_CHOICES if sched == "interleaved" else (chunks_per_rank(sched, 1),)
                        scheds += [(sched, v) for v in vpps if pp * chunks_per_rank(sched, v) <= layers]
                for ep in eps:
                    for sp_on in sps:
                        for variant in variants:
                            for sched, vpp in scheds:
                                add(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=int(sp_on),
                                    cp_variant=CP_VARIANTS.index(variant), schedule=SCHEDULES.index(sched),
                                    vpp=vpp)
    return {name: np.array(col, dtype=np.int64) for name, col in cols.items()}


def _micro_batches_run(schedule_codes: np.ndarray, pp: np.ndarray, m: np.ndarray) -> np.ndarray:
    """:func:`autopar.plan.micro_batches_ok` for arrays of schedule codes, stage counts and
    micro-batch counts (broadcast together)."""
    return np.select([schedule_codes == SCHEDULES.index(name) for name in SCHEDULES],
                     [micro_batches_ok(name, pp, m) for name in SCHEDULES], default=False)


def enumerate_plans(spec, world: int, seq_len: int, global_batch: int, **opts) -> dict[str, np.ndarray]:
    """All candidate plans as integer-coded arrays (keys as autopar.cost.model.plan_values)."""
    base = _structures(spec, world, seq_len, global_batch, opts)
    if not len(base["pp"]):
        return {}
    max_b = opts.get("max_micro_batch", 64)
    bvals = np.array([b for b in _divisors(global_batch) if b <= max_b], dtype=np.int64)
    per_replica = global_batch // base["dp"]
    ok = (per_replica[:, None] % bvals[None, :]) == 0
    m = per_replica[:, None] // bvals[None, :]
    sched, pp = base["schedule"][:, None], base["pp"][:, None]
    ok &= _micro_batches_run(sched, pp, m)
    # The cost model's interleaved bubble, (pp - 1)(T_f + T_b)/v, needs at least pp micro-batches.
    ok &= ~((sched == SCHEDULES.index("interleaved")) & (m < pp))
    if opts.get("micro_batches"):
        ok &= np.isin(m, np.asarray(opts["micro_batches"]))
    rows, cols = np.nonzero(ok)
    zeros = np.asarray(opts.get("zero_stages", (0, 1, 2, 3)))
    recomputes = np.asarray([RECOMPUTE_MODES.index(r) for r in opts.get("recompute_modes", RECOMPUTE_MODES)])
    n_opt = len(zeros) * len(recomputes)
    idx = np.repeat(rows, n_opt)
    bsel = np.repeat(bvals[cols], n_opt)
    zero = np.tile(np.repeat(zeros, len(recomputes)), len(rows))
    rec = np.tile(np.tile(recomputes, len(zeros)), len(rows))
    arrays = {name: col[idx] for name, col in base.items()}
    arrays.update(b=bsel, m=global_batch // (arrays["dp"] * bsel), zero=zero, recompute=rec,
                  base=idx)
    # ZeRO has nothing to shard without data-parallel copies: keep only stage 0 there.
    keep = (arrays["zero"] == 0) | (arrays["dp"] * arrays["cp"] > 1)
    out = {k: v[keep].astype(np.float64) for k, v in arrays.items()}
    out["schedule"] = out["schedule"].astype(np.int64)
    return out


def _view_tables(spec, base: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Per structure and scored slot (first rank, last rank, busiest rank): the stage view,
    as (structures, 3) float columns keyed ld le first last nsend nrecv rank."""
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
    for (pp, code, vpp), j in keys.items():
        views = stage_views(spec, pp, SCHEDULES[code], vpp, x)
        # Ties (equal layers) go to the rank with the most P2P traffic.
        cost = [v.dense + moe_cost * v.moe + x * v.last + 1e-3 * (v.sends + v.recvs) for v in views]
        slots = (views[0], views[-1], views[int(np.argmax(cost))])
        for name, attr in _VIEW_FIELDS.items():
            table[name][j] = [getattr(v, attr) for v in slots]
    return {name: col[which] for name, col in table.items()}


def search(spec, cluster, seq_len: int, global_batch: int, top: int = 10, *,
           progress: Callable[[int, int], None] | None = None, **options) -> list[tuple[Plan, Cost]]:
    """The ``top`` fastest plans that fit, best first, as (Plan, Cost) pairs.

    ``options``: estimate()'s keyword options (dtype_bytes, grad_bytes, activation_formula,
    tp_comm_overlap, zero_overlap, routing_imbalance, constants), and restrictions of the space:
    ``world_size`` (default: the whole cluster), ``schedules``, ``cp_variants``,
    ``zero_stages``, ``recompute_modes``, ``sp`` (True/False), ``max_tp``,
    ``max_micro_batch`` (largest micro-batch size, default 64), ``micro_batches``;
    ``runnable`` (default True): only plans the runtime runs (:func:`autopar.support.unsupported`,
    the check ``parallelize`` applies), False for every plan the cost model prices.
    ``progress(done, total)`` is called as candidates are scored.
    """
    spec, cluster = _as_spec(spec), _as_cluster(cluster)
    est_opts, world = _split_options(options, cluster)
    cands = enumerate_plans(spec, world, seq_len, global_batch, **options)
    total = len(cands.get("tp", ()))
    if not total:
        raise AutoparError(
            f"autopar: no plan splits {spec.name} over {world} GPUs with seq {seq_len} and global "
            f"batch {global_batch}; check that the batch and heads have divisors matching the world size")
    base = _structures(spec, world, seq_len, global_batch, options)
    scorer = _Scorer(spec, cluster, seq_len, cands, base, est_opts)
    lower = scorer.lower_bounds(int(options.get("chunk_size", 400_000)), progress)
    step = scorer.step_times(lower, top, int(options.get("batch_size", 4096)))
    if progress is not None:
        progress(2 * total, 2 * total)
    return _fitting_plans(spec, cluster, cands, step, top, seq_len, global_batch, est_opts,
                          runnable=bool(options.get("runnable", True)))


def _split_options(options: dict, cluster) -> tuple[dict, int]:
    """Pop estimate()'s options and ``world_size`` off ``options`` and reject unknown ones."""
    est_opts = {k: options.pop(k) for k in list(options) if k in _ESTIMATE_OPTIONS}
    world = options.pop("world_size", cluster.world_size)
    unknown = set(options) - {"schedules", "cp_variants", "zero_stages", "recompute_modes", "sp",
                              "max_tp", "max_micro_batch", "micro_batches", "chunk_size", "batch_size",
                              "runnable"}
    if unknown:
        raise AutoparError(f"autopar: unknown search option(s) {', '.join(sorted(unknown))}")
    return est_opts, world


class _Scorer:
    """The compiled cost formulas evaluated over arrays of candidates, one scored rank slot at a time."""

    def __init__(self, spec, cluster, seq_len: int, cands: dict[str, np.ndarray],
                 base: dict[str, np.ndarray], est_opts: dict):
        """Stage views and link figures per structure, and the compiled models of ``est_opts``."""
        self.cluster, self.cands, self.total = cluster, cands, len(cands["tp"])
        self.views = _view_tables(spec, base, seq_len)
        self.consts = {**DEFAULT_CONSTANTS, **(est_opts.get("constants") or {})}
        self.model = compiled(est_opts.get("activation_formula", "derived"), False)
        self.mvals = model_values(spec, dtype_bytes=est_opts.get("dtype_bytes", 2),
                                  grad_bytes=est_opts.get("grad_bytes"),
                                  routing_imbalance=est_opts.get("routing_imbalance", 1.0), seq_len=seq_len,
                                  flash_attention=est_opts.get("flash_attention", True))
        # Link figures depend on the degrees only: compute them per structure, gather per candidate.
        self.base_links = link_values(cluster, base["tp"], base["cp"], base["dp"], base["pp"], base["ep"],
                                      self.consts["epsilon"])
        self.mem_model = compiled_memory(est_opts.get("activation_formula", "derived"))
        self.lb_model = compiled_compute()
        self.tp_overlap = est_opts.get("tp_comm_overlap", False)
        self.zero_overlap = est_opts.get("zero_overlap", False)

    def slot_values(self, arrays, links, bidx, slot, rows=None) -> dict:
        """The symbol values of the candidates (``rows`` of them, or all) on scored rank ``slot``."""
        if rows is not None:
            arrays = {k: v[rows] for k, v in arrays.items()}
            links = {k: v[rows] if np.ndim(v) else v for k, v in links.items()}
            bidx = bidx[rows]
        view = {name: col[bidx, slot] for name, col in self.views.items()}
        rank = view.pop("rank")
        arrays = dict(arrays, **view)
        arrays["infl"] = inflight(arrays["schedule"], arrays["pp"], arrays["vpp"], rank, arrays["m"])
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
        rank = self.views["rank"][bidx]
        return [None, np.nonzero(rank[:, 1] != rank[:, 0])[0],
                np.nonzero((rank[:, 2] != rank[:, 0]) & (rank[:, 2] != rank[:, 1]))[0]]

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
                lower[lo + rows] = pipe
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
        pipe, _ = step_time_arrays(self.model, arrays["schedule"], tf[slow, cols], tb[slow, cols], tw[slow, cols],
                                   arrays["pp"], arrays["vpp"], arrays["m"])
        return pipe + step_comm + opt

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
                   est_opts: dict, runnable: bool = True) -> list[tuple[Plan, Cost]]:
    """The ``top`` fastest candidates by ``step`` that estimate() confirms fit (and, with
    ``runnable``, that the runtime runs), as (Plan, Cost) by step time."""
    feasible = np.nonzero(np.isfinite(step))[0]
    order = feasible[np.argsort(step[feasible], kind="stable")]
    results: list[tuple[Plan, Cost]] = []
    for i in order:
        if len(results) >= top:
            break
        plan = _plan_of(cands, i)
        if runnable and unsupported(plan, moe_rewrite=spec.is_moe and moe_needs_rewrite(plan),
                                    tied=spec.tied_embeddings):
            continue
        cost = estimate(spec, cluster, plan, seq_len, global_batch, **est_opts)
        if cost.fits:  # the full per-rank check of estimate() has the last word
            results.append((plan, cost))
    results.sort(key=lambda pc: pc[1].step_time)
    return results


def _plan_of(cands: dict, i: int) -> Plan:
    sched = SCHEDULES[int(cands["schedule"][i])]
    pp = int(cands["pp"][i])
    return Plan(dp=int(cands["dp"][i]), tp=int(cands["tp"][i]), sp=bool(cands["sp"][i]),
                cp=int(cands["cp"][i]), cp_variant=CP_VARIANTS[int(cands["cp_variant"][i])],
                ep=int(cands["ep"][i]), pp=pp, schedule=sched,
                vpp=int(cands["vpp"][i]) if sched in MULTI_CHUNK_SCHEDULES else 1,
                mb=int(cands["m"][i]), zero=int(cands["zero"][i]),
                recompute=RECOMPUTE_MODES[int(cands["recompute"][i])])
