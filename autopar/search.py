"""Plan search: enumerate every plan for a model and cluster, score them vectorised, rank.

The space: every factorisation of the world into ``pp * dp * cp * tp``; ``ep`` dividing
both the experts and ``dp * cp``; SP on/off; the CP variant; the pipeline schedule and
``vpp``; the micro-batch size (hence the number of micro-batches); ZeRO stage 0-3;
recompute none/selective/full. Infeasible plans are pruned: heads, KV heads and vocab
divisible by tp (KV heads are never replicated); Ulysses needs heads and KV heads
divisible by tp*cp; ``pp * chunks <= layers``; the batch splits into dp*mb; the
sequence into 2*cp chunks (and into tp shards under SP); interleaving needs at least
``pp`` micro-batches; and the predicted memory must fit the GPU.

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
from autopar.cost.model import (CP_VARIANTS, DEFAULT_CONSTANTS, RECOMPUTE, SCHEDULES, compiled,
                                compiled_compute, compiled_memory, evaluate,
                                link_values, model_values, plan_values, step_time_arrays)
from autopar.cost.pipeline import chunks_per_rank, inflight, stage_views
from autopar.errors import AutoparError
from autopar.plan import Plan

__all__ = ["search", "enumerate_plans"]

_VPP_CHOICES = (2, 3, 4, 5, 6, 8)
_ESTIMATE_OPTIONS = ("dtype_bytes", "grad_bytes", "activation_formula", "tp_comm_overlap",
                     "routing_imbalance", "flash_attention", "constants")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _structures(spec, world: int, seq_len: int, global_batch: int, opts: dict) -> list[tuple]:
    """(pp, dp, cp, tp, ep, sp, cp_variant, schedule, vpp) tuples that pass the divisibility rules."""
    heads, kv, layers = spec.num_heads, spec.num_kv_heads, spec.num_layers
    schedules = opts.get("schedules") or SCHEDULES
    cp_variants = opts.get("cp_variants") or CP_VARIANTS
    zero_sp = opts.get("sp")  # None: both
    out = []
    for tp in _divisors(world):
        if heads % tp or kv % tp or spec.vocab % tp or tp > opts.get("max_tp", world):
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
                    v for v in cp_variants
                    if v != "ulysses" or (heads % (tp * cp) == 0 and kv % (tp * cp) == 0)]
                scheds = [("1f1b", 1)] if pp == 1 else []
                if pp > 1:
                    for sched in schedules:
                        if sched == "interleaved":
                            scheds += [(sched, v) for v in _VPP_CHOICES if pp * v <= layers]
                        elif sched in ("zbv", "dualpipev"):
                            if 2 * pp <= layers:
                                scheds.append((sched, 2))
                        else:
                            scheds.append((sched, 1))
                for ep in eps:
                    for sp_on in sps:
                        for variant in variants:
                            for sched, vpp in scheds:
                                out.append((pp, dp, cp, tp, ep, int(sp_on), CP_VARIANTS.index(variant),
                                            SCHEDULES.index(sched), vpp))
    return out


def enumerate_plans(spec, world: int, seq_len: int, global_batch: int, **opts) -> dict[str, np.ndarray]:
    """All candidate plans as integer-coded arrays (keys as autopar.cost.model.plan_values)."""
    base = np.array(_structures(spec, world, seq_len, global_batch, opts), dtype=np.int64).reshape(-1, 9)
    if not len(base):
        return {}
    max_b = opts.get("max_micro_batch", 64)
    bvals = np.array([b for b in _divisors(global_batch) if b <= max_b], dtype=np.int64)
    per_replica = global_batch // base[:, 1]
    ok = (per_replica[:, None] % bvals[None, :]) == 0
    m = per_replica[:, None] // bvals[None, :]
    ok &= ~((base[:, 7:8] == SCHEDULES.index("interleaved")) & (m < base[:, 0:1]))
    if opts.get("micro_batches"):
        ok &= np.isin(m, np.asarray(opts["micro_batches"]))
    rows, cols = np.nonzero(ok)
    zeros = np.asarray(opts.get("zero_stages", (0, 1, 2, 3)))
    recomputes = np.asarray([RECOMPUTE.index(r) for r in opts.get("recompute_modes", RECOMPUTE)])
    n_opt = len(zeros) * len(recomputes)
    idx = np.repeat(rows, n_opt)
    bsel = np.repeat(bvals[cols], n_opt)
    zero = np.tile(np.repeat(zeros, len(recomputes)), len(rows))
    rec = np.tile(np.tile(recomputes, len(zeros)), len(rows))
    arrays = {name: base[idx, i] for i, name in enumerate(
        ("pp", "dp", "cp", "tp", "ep", "sp", "cp_variant", "schedule", "vpp"))}
    arrays.update(b=bsel, m=global_batch // (arrays["dp"] * bsel), zero=zero, recompute=rec,
                  base=idx)
    # ZeRO has nothing to shard without data-parallel copies: keep only stage 0 there.
    keep = (arrays["zero"] == 0) | (arrays["dp"] * arrays["cp"] > 1)
    out = {k: v[keep].astype(np.float64) for k, v in arrays.items()}
    out["schedule"] = out["schedule"].astype(np.int64)
    return out


def _view_tables(spec, base: np.ndarray, seq_len: int):
    """Per structure and scored slot (first rank, last rank, busiest rank): the stage view."""
    x = head_layers(spec, seq_len)
    moe_cost = 1.0
    if spec.is_moe:
        from autopar.cost.flops import per_token_layer_flops
        dense, moe, _ = per_token_layer_flops(spec, seq_len)
        moe_cost = moe / dense
    table = np.zeros((len(base), 3, 7))  # ld, le, first, last, nsend, nrecv, rank
    cache = {}
    for i, (pp, sched, vpp) in enumerate(base[:, [0, 7, 8]]):
        key = (int(pp), int(sched), int(vpp))
        if key not in cache:
            name = SCHEDULES[key[1]]
            views = stage_views(spec, key[0], name, chunks_per_rank(name, key[2]) if name == "interleaved"
                                else key[2], x)
            # Ties (equal layers) go to the rank with the most P2P traffic.
            cost = [v.dense + moe_cost * v.moe + x * v.last + 1e-3 * (v.sends + v.recvs) for v in views]
            busiest = int(np.argmax(cost))
            cache[key] = np.array([[v.dense, v.moe, v.first, v.last, v.sends, v.recvs, v.rank]
                                   for v in (views[0], views[-1], views[busiest])], dtype=np.float64)
        table[i] = cache[key]
    return table


def search(spec, cluster, seq_len: int, global_batch: int, top: int = 10, *,
           progress: Callable[[int, int], None] | None = None, **options) -> list[tuple[Plan, Cost]]:
    """The ``top`` fastest plans that fit, best first, as (Plan, Cost) pairs.

    ``options``: estimate()'s keyword options (dtype_bytes, grad_bytes, activation_formula,
    tp_comm_overlap, routing_imbalance, constants), and restrictions of the space:
    ``world_size`` (default: the whole cluster), ``schedules``, ``cp_variants``,
    ``zero_stages``, ``recompute_modes``, ``sp`` (True/False), ``max_tp``,
    ``max_micro_batch`` (largest micro-batch size, default 64), ``micro_batches``.
    ``progress(done, total)`` is called as candidates are scored.
    """
    spec, cluster = _as_spec(spec), _as_cluster(cluster)
    est_opts = {k: options.pop(k) for k in list(options) if k in _ESTIMATE_OPTIONS}
    world = options.pop("world_size", cluster.world_size)
    unknown = set(options) - {"schedules", "cp_variants", "zero_stages", "recompute_modes", "sp",
                              "max_tp", "max_micro_batch", "micro_batches", "chunk_size", "batch_size"}
    if unknown:
        raise AutoparError(f"autopar: unknown search option(s) {', '.join(sorted(unknown))}")
    cands = enumerate_plans(spec, world, seq_len, global_batch, **options)
    total = len(cands.get("tp", ()))
    if not total:
        raise AutoparError(
            f"autopar: no plan splits {spec.name} over {world} GPUs with seq {seq_len} and global "
            f"batch {global_batch}; check that the batch and heads have divisors matching the world size")
    base = np.array(_structures(spec, world, seq_len, global_batch, options), dtype=np.int64).reshape(-1, 9)
    views = _view_tables(spec, base, seq_len)
    consts = {**DEFAULT_CONSTANTS, **(est_opts.get("constants") or {})}
    model = compiled(est_opts.get("activation_formula", "derived"), False)
    mvals = model_values(spec, dtype_bytes=est_opts.get("dtype_bytes", 2),
                         grad_bytes=est_opts.get("grad_bytes"),
                         routing_imbalance=est_opts.get("routing_imbalance", 1.0), seq_len=seq_len,
                         flash_attention=est_opts.get("flash_attention", True))
    # Link figures depend on the degrees only: compute them per structure, gather per candidate.
    base_links = link_values(cluster, *(base[:, i] for i in (3, 2, 1, 0, 4)), consts["epsilon"])
    mem_model = compiled_memory(est_opts.get("activation_formula", "derived"))
    lb_model = compiled_compute()
    tp_overlap = est_opts.get("tp_comm_overlap", False)
    chunk = int(options.get("chunk_size", 400_000))

    def slot_values(arrays, links, bidx, slot, rows=None):
        if rows is not None:
            arrays = {k: v[rows] for k, v in arrays.items()}
            links = {k: v[rows] if np.ndim(v) else v for k, v in links.items()}
            bidx = bidx[rows]
        view = views[bidx, slot]
        arrays = dict(arrays, ld=view[:, 0], le=view[:, 1], first=view[:, 2], last=view[:, 3],
                      nsend=view[:, 4], nrecv=view[:, 5])
        arrays["infl"] = inflight(arrays["schedule"], arrays["pp"], arrays["vpp"], view[:, 6], arrays["m"])
        values = dict(mvals)
        values.update(plan_values(cluster, arrays, constants=consts, tp_comm_overlap=tp_overlap, links=links))
        return values

    def take(lo, hi, rows=None):
        arrays = {k: v[lo:hi] for k, v in cands.items()}
        if rows is not None:
            arrays = {k: v[rows] for k, v in arrays.items()}
        bidx = arrays["base"].astype(np.int64)
        links = {k: np.asarray(v)[bidx] if np.ndim(v) else v for k, v in base_links.items()}
        return arrays, links, bidx

    def needed_slots(bidx):
        # Slots: 0 = first rank, 1 = last rank, 2 = busiest rank; 1 and 2 only where they differ.
        rank = views[bidx][:, :, 6]
        return [None, np.nonzero(rank[:, 1] != rank[:, 0])[0],
                np.nonzero((rank[:, 2] != rank[:, 0]) & (rank[:, 2] != rank[:, 1]))[0]]

    # Pass 1, all candidates: memory (prune what does not fit) and a lower bound on the step
    # time from compute alone on the first rank (communication and slower ranks only add).
    lower = np.full(total, np.inf)
    for lo in range(0, total, chunk):
        hi = min(lo + chunk, total)
        arrays, links, bidx = take(lo, hi)
        mem = evaluate(mem_model, slot_values(arrays, links, bidx, 0))["memory"].copy()
        for slot, rows in enumerate(needed_slots(bidx)[1:], start=1):
            if len(rows):
                mem[rows] = np.maximum(mem[rows], evaluate(mem_model, slot_values(arrays, links, bidx, slot, rows))["memory"])
        rows = np.nonzero(mem <= cluster.usable_memory)[0]
        if len(rows):
            comp = evaluate(lb_model, slot_values(arrays, links, bidx, 0, rows))
            # T_w = T_f + T_b zeroes the zbv / dualpipev bubbles: the bound stays a bound whatever
            # the slowest rank's weight-gradient share turns out to be.
            pipe, _ = step_time_arrays(model, arrays["schedule"][rows], comp["T_f"], comp["T_b"],
                                       comp["T_f"] + comp["T_b"], arrays["pp"][rows], arrays["vpp"][rows],
                                       arrays["m"][rows])
            lower[lo + rows] = pipe
        if progress is not None:
            progress(hi, 2 * total)

    # Pass 2, in order of the bound: the full model, until the bound passes the best found.
    step = np.full(total, np.inf)
    order = np.argsort(lower, kind="stable")
    order = order[np.isfinite(lower[order])]
    keep = max(4 * top, 16)
    batch = int(options.get("batch_size", 4096))
    done = 0
    while done < len(order):
        sel = np.sort(order[done:done + batch])
        arrays, links, bidx = take(0, total, sel)
        n = len(sel)
        tf, tb, tw = np.full((3, n), -np.inf), np.zeros((3, n)), np.zeros((3, n))
        step_comm, opt = np.zeros(n), np.zeros(n)
        for slot, rows in enumerate(needed_slots(bidx)):
            if rows is not None and not len(rows):
                continue
            out = evaluate(model, slot_values(arrays, links, bidx, slot, rows))
            rows = slice(None) if rows is None else rows
            tf[slot, rows], tb[slot, rows], tw[slot, rows] = out["T_f"], out["T_b"], out["T_w"]
            step_comm[rows] = np.maximum(step_comm[rows], out["step_comm"])
            opt[rows] = np.maximum(opt[rows], out["optimizer"])
        slow = np.argmax(tf + tb, axis=0)
        cols = np.arange(n)
        pipe, _ = step_time_arrays(model, arrays["schedule"], tf[slow, cols], tb[slow, cols], tw[slow, cols],
                                   arrays["pp"], arrays["vpp"], arrays["m"])
        step[sel] = pipe + step_comm + opt
        done += n
        found = np.sort(step[np.isfinite(step)])
        if len(found) >= keep and done < len(order) and lower[order[done]] > found[keep - 1]:
            break
        batch *= 2
    if progress is not None:
        progress(2 * total, 2 * total)
    feasible = np.nonzero(np.isfinite(step))[0]
    order = feasible[np.argsort(step[feasible], kind="stable")]
    results: list[tuple[Plan, Cost]] = []
    for i in order:
        if len(results) >= top:
            break
        plan = _plan_of(cands, i)
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
                vpp=int(cands["vpp"][i]) if sched in ("interleaved", "zbv", "dualpipev") else 1,
                mb=int(cands["m"][i]), zero=int(cands["zero"][i]),
                recompute=RECOMPUTE[int(cands["recompute"][i])])
