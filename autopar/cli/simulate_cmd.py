"""``autopar explain --simulate`` and ``autopar plan --check N``: a plan's fullest rank at full width,
measured by torch's meters beside the cost model's prediction, without a GPU.

:func:`simulate_rank` builds the model on the meta device, compiles the plan's fullest pp rank (its
first rank) as one rank of a fake process group of the plan's world and steps it under
``MemTracker`` and ``FlopCounterMode`` (autopar/verification/full_width.py).  The depth is cut to
one layer per pipeline chunk (at least 2) unless ``--simulate-layers`` says otherwise: the terms
checked per layer (activations, recompute, a layer's backward) are counted every chunk, and the
prediction set beside it is the cost model's for the same depth.  Under mixed precision
(``dtype_bytes`` 2, explain's default) the program runs ``mixed_precision="bf16"``.
Neighbours: autopar/cli/plan_cmd.py (the commands these flags belong to).
"""
from __future__ import annotations

import time

from autopar.errors import AutoparError

__all__ = ["simulate_rank", "format_simulated", "checked_records", "format_checked"]

_GIB = 2**30


def _depth(spec, plan, layers: int | None) -> int:
    chunks = plan.pp * plan.num_chunks_per_rank
    depth = layers if layers is not None else max(2, chunks)
    if depth < chunks or depth > spec.num_layers:
        raise AutoparError(f"autopar: --simulate-layers {depth} must be between the plan's {chunks} pipeline "
                           f"chunks and the model's {spec.num_layers} layers")
    return depth


def simulate_rank(spec, cluster, plan, seq: int, global_batch: int, *, dtype_bytes: int = 2,
                  layers: int | None = None, log=None) -> dict:
    """The fullest pp rank of ``plan`` at full width: MemTracker's peak and FlopCounterMode's FLOPs
    beside ``Cost.peak_memory`` and ``Cost.flops`` of the same depth (the module docstring)."""
    from autopar.cost import estimate
    from autopar.verification.full_width import compile_rank, fake_world, measure_step, simulated_spec

    depth = _depth(spec, plan, layers)
    sim_spec = simulated_spec(spec, depth)
    per_replica = plan.dp * plan.mb
    if global_batch % per_replica:
        raise AutoparError(f"autopar: a global batch of {global_batch} does not split into dp*mb = {per_replica} "
                           f"micro-batches; the simulation steps whole sequences")
    cost = estimate(sim_spec, cluster, plan, seq, global_batch, dtype_bytes=dtype_bytes)
    full = estimate(spec, cluster, plan, seq, global_batch, dtype_bytes=dtype_bytes)
    pp_rank = full.memory_pp_rank
    rank = pp_rank * (plan.world_size // plan.pp)  # pp is the outermost mesh axis
    start = time.perf_counter()
    if log:
        log(f"autopar: simulating pp rank {pp_rank} (rank {rank} of {plan.world_size}) of '{plan}' at full width, "
            f"{depth} of {spec.num_layers} layers, on the meta device ...")
    with fake_world(plan.world_size, rank):
        pm, ids = compile_rank(sim_spec, str(plan), seq, global_batch // per_replica,
                               mixed_precision="bf16" if dtype_bytes == 2 else None)
        measured = measure_step(pm, ids)
    breakdown = cost.peak_breakdown(pp_rank)
    return {"plan": str(plan), "pp_rank": pp_rank, "rank": rank, "layers": depth, "model_layers": spec.num_layers,
            "precision": "bf16" if dtype_bytes == 2 else "fp32", "seconds": time.perf_counter() - start,
            "predicted_peak": cost.peak_memory(pp_rank), "measured_peak": measured["peak"],
            "moment": breakdown.moment, "terms": {t: v for t, (v, alive) in breakdown.terms.items() if alive},
            "measured_categories": measured["categories"],
            "predicted_flops": cost.flops(pp_rank), "measured_flops": measured["flops"],
            "flops_terms": cost.flops_terms(pp_rank), "flops_by_op": measured["flops_by_op"],
            "usable_memory": cluster.usable_memory, "predicted_full_peak": full.peak_memory(pp_rank),
            # The rest of the layers as the cost model prices them: measured + (full - simulated depth).
            "full_peak": measured["peak"] + full.peak_memory(pp_rank) - cost.peak_memory(pp_rank)}


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.1f}%" if measured else "-"


def format_simulated(r: dict) -> str:
    """``explain --simulate``'s section: memory and FLOPs, predicted beside measured, term by term."""
    g = _GIB
    lines = [f"full width, simulated: pp rank {r['pp_rank']} (rank {r['rank']}), {r['layers']} of {r['model_layers']} "
             f"layers (one per pipeline chunk at least; the prediction is for the same depth), {r['precision']}, "
             f"meta device under a fake process group ({r['seconds']:.0f} s)",
             f"  memory  predicted {r['predicted_peak'] / g:8.2f} GiB   measured (MemTracker) "
             f"{r['measured_peak'] / g:8.2f} GiB   {_error(r['predicted_peak'], r['measured_peak'])}",
             f"          predicted, the terms alive at {r['moment']}:"]
    lines += [f"            {name:24s} {value / g:8.2f} GiB" for name, value in r["terms"].items() if value]
    lines.append("          measured, by MemTracker's category at its peak:")
    lines += [f"            {name:24s} {value / g:8.2f} GiB" for name, value in r["measured_categories"].items() if value]
    lines.append(f"  FLOPs   predicted {r['predicted_flops']:.4g}   measured (FlopCounterMode) {r['measured_flops']:.4g}   "
                 f"{_error(r['predicted_flops'], r['measured_flops'])}")
    lines += [f"            {name:24s} {value:.4g}" for name, value in r["flops_terms"].items() if value]
    lines.append("          measured, by op:")
    lines += [f"            {name:24s} {value:.4g}" for name, value in r["flops_by_op"].items() if value]
    fits = r["full_peak"] <= r["usable_memory"]
    lines.append(f"  at {r['model_layers']} layers: {r['full_peak'] / g:.2f} GiB (the measured peak plus the cost model's "
                 f"difference between the two depths; predicted {r['predicted_full_peak'] / g:.2f} GiB): "
                 f"{'fits' if fits else 'DOES NOT FIT'} in {r['usable_memory'] / g:.2f} GiB usable")
    return "\n".join(lines)


def checked_records(spec, cluster, results, seq: int, global_batch: int, count: int, *, dtype_bytes: int = 2,
                    log=None) -> list[dict]:
    """``plan --check N``: :func:`simulate_rank` for the first ``count`` of the search's ``results``."""
    out = []
    for plan, _ in results[:count]:
        r = simulate_rank(spec, cluster, plan, seq, global_batch, dtype_bytes=dtype_bytes, log=log)
        out.append({k: v for k, v in r.items() if k not in ("flops_by_op", "measured_categories", "terms")})
    return out


def format_checked(records: list[dict]) -> str:
    """The ``--check`` table: each plan's fullest rank, predicted and measured peak, and whether it fits."""
    head = (f"{'plan':58s} {'pp rank':>7s} {'layers':>7s} {'predicted':>10s} {'measured':>10s} {'error':>7s} "
            f"{'all layers':>10s}  fits")
    lines = ["checked at full width (MemTracker around one step of the fullest rank, meta device, at the "
             "depth shown; 'all layers': the measured peak plus the cost model's difference to the model's depth):",
             head]
    for r in records:
        fits = r["full_peak"] <= r["usable_memory"]
        lines.append(f"{r['plan']:58s} {r['pp_rank']:7d} {r['layers']:7d} {r['predicted_peak'] / _GIB:9.2f}G "
                     f"{r['measured_peak'] / _GIB:9.2f}G {_error(r['predicted_peak'], r['measured_peak']):>7s} "
                     f"{r['full_peak'] / _GIB:9.2f}G  {'yes' if fits else 'NO: would not fit'}")
    return "\n".join(lines)

