"""One rank of a full-size model compiled and stepped in one CPU process; its bytes against the cost model.

:func:`simulate` builds a Llama-shaped ``transformers.LlamaForCausalLM`` at full width (a dense
preset of ``autopar.ModelSpec``, or Mixtral for a preset with an MoE block in every layer) on the
meta device, compiles it with ``autopar.parallelize`` as one rank of a *fake* process group of
the plan's world size (every collective a no-op), steps it once and returns what
:func:`measured_and_predicted` reads: the step's collectives per (phase, collective, axis) as the
runtime recorded them and as the cost model's ``comm_table(pp_rank)`` predicts them, and the
rank's parameter bytes both ways.  :func:`compare` prints them side by side and says whether
everything is equal.  MoE routing on meta is balanced (:func:`autopar.ops.moe.balanced_counts`).

Its users: ``benchmarks/scale_simulation.py`` (the command line), tests/e2e/test_scale.py and
tests/e2e/test_search_compiles.py; :func:`fake_world` and :func:`compile_rank` also
tests/support/full_width.py (the rank's memory and FLOPs under torch's meters).  The model, the fake
world and the compiled rank come from autopar/verification/full_width.py (also ``autopar explain
--simulate``'s).
"""
from __future__ import annotations

import collections
import time

from autopar.cost import Cluster, ModelSpec, estimate
from autopar.plan import Plan
from autopar.plan_space import DEFAULT_BUCKET_BYTES
from autopar.verification.full_width import compile_rank, fake_world, simulated_spec

__all__ = ["simulate", "measured_and_predicted", "compare", "fake_world", "compile_rank", "model_spec"]


def model_spec(model: str, layers: int | None) -> ModelSpec:
    """The preset ``model`` (dense, or MoE in every layer), with ``layers`` layers if given."""
    return simulated_spec(ModelSpec.preset(model), layers)


def simulate(layers: int | None, plan: str, seq: int, microbatch: int, *, rank: int = 0,
             model: str = "llama3-70b", bucket_bytes: int = DEFAULT_BUCKET_BYTES, log=print) -> dict:
    """Compile and step rank ``rank`` under a fake world; what it measured and what the cost model says
    (``bucket_bytes``: the gradient buckets' cap, given to both)."""
    p = Plan.parse(plan)
    spec = model_spec(model, layers)
    with fake_world(p.world_size, rank):
        log(f"[1/3] compiling {spec.num_layers}-layer {model} (hidden {spec.hidden}) for '{plan}' as rank {rank} "
            f"of a fake world of {p.world_size}")
        start = time.perf_counter()
        pm, ids = compile_rank(spec, plan, seq, microbatch, bucket_bytes=bucket_bytes)
        seconds = time.perf_counter() - start
        for line in pm.program.log:
            log(f"      {line}")
        log(f"      compiled in {seconds:.1f} s")
        log("[2/3] one training step on the meta device")
        pm.train_step((ids,), ids)
        log("[3/3] comparing with the cost model")
        pp_rank = pm.coords().get("pp", (0, 1))[0]
        cost = estimate(spec, Cluster.for_world("h100", p.world_size), plan, seq_len=seq,
                                global_batch=ids.shape[0], dtype_bytes=4, bucket_bytes=bucket_bytes)
        return measured_and_predicted(pm, cost, pp_rank, seconds)


def measured_and_predicted(pm, cost, pp_rank: int, seconds: float = 0.0) -> dict:
    """What :func:`compare` reads: the step's bytes and calls per (phase, collective, axis),
    measured on ``pm`` and predicted by ``cost`` for ``pp_rank``, and the parameter bytes."""
    measured = collections.defaultdict(lambda: [0.0, 0])
    for r in pm.comm_stats():
        entry = measured[(r["phase"], r["op"], r["axis"])]
        entry[0] += r["bytes_sent"] + r["bytes_recv"]
        entry[1] += 1
    predicted = collections.defaultdict(lambda: [0.0, 0])
    # MoE: the token all-to-alls at the routing this rank realised (balanced on meta).
    counts = [r["counts"] for r in pm.comm_stats() if r["phase"] == "fwd" and r["counts"] is not None
              and r["tag"].startswith("MoE dispatch")]
    ep_rank = pm.coords().get("ep", (0, 1))[0]
    for row in cost.comm_table(pp_rank, expert_counts=counts or None, ep_rank=ep_rank):
        entry = predicted[(row.phase, row.collective, row.axis)]
        entry[0] += (row.bytes_sent + row.bytes_recv) * row.count
        entry[1] += row.count
    local_params = sum(t.numel() * t.element_size() for t in set(pm.gm.parameters()))
    return {"measured": {k: tuple(v) for k, v in measured.items()},
            "predicted": {k: tuple(v) for k, v in predicted.items()},
            "param_bytes": pm.memory_report().get("params", local_params),
            "predicted_param_bytes": cost.memory(pp_rank)["params"],
            "pp_rank": pp_rank, "compile_seconds": seconds}


def compare(result: dict, out=print) -> bool:
    """Print measured against predicted per collective; True when everything is equal."""
    ok = True
    out(f"\n{'phase':6s} {'collective':15s} {'axis':9s} {'calls':>6s} {'measured (bytes moved)':>24s} "
        f"{'calls':>6s} {'cost model':>24s}  equal")
    for key in sorted(set(result["measured"]) | set(result["predicted"])):
        (m, mc), (p, pc) = result["measured"].get(key, (0.0, 0)), result["predicted"].get(key, (0.0, 0))
        # Bucketed collectives (gradient all-reduces, ZeRO-1/2's reduce-scatters and gathers of the
        # updated parameters: one call per bucket_bytes bucket) are counted too (cost/buckets.py).
        equal = mc == round(pc) and abs(m - p) <= 1e-9 * max(m, p, 1.0)
        ok &= equal
        out(f"{key[0]:6s} {key[1]:15s} {key[2]:9s} {mc:6d} {m:24,.0f} {pc:6.0f} {p:24,.0f}  {equal}")
    params_equal = result["param_bytes"] == result["predicted_param_bytes"]
    ok &= params_equal
    out(f"parameter bytes on this rank (pp rank {result['pp_rank']}): measured {result['param_bytes']:,}, "
        f"cost model {result['predicted_param_bytes']:,.0f}  {params_equal}")
    out(f"compiled in {result['compile_seconds']:.1f} s; {'all equal' if ok else 'DIFFERENCES FOUND'}")
    return ok
