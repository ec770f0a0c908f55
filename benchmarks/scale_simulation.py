"""Scale simulation: compile and step one rank of a full-size model in one CPU process, count its bytes.

A Llama-shaped ``transformers.LlamaForCausalLM`` at full width (``--model``: a dense preset of
``autopar.ModelSpec``, default Llama-3-70B, hidden 8192; ``--layers`` overrides the depth) is
built on the meta device (no memory), compiled by ``autopar.parallelize`` for ``--plan`` as rank
``--rank`` of a *fake* process group of the plan's world size (``torch.distributed`` backend
"fake": every collective is a no-op), so it is that rank's pipeline stage that compiles, and
stepped once.  The runtime records every collective of the rank exactly as on a real cluster;
they are compared call for call and byte for byte with the cost model's ``comm_table(stage)``
for the same shapes, and the rank's parameter bytes with the cost model's parameter memory
(fp32, ``dtype_bytes=4``, the meta model's dtype).  The exit status is non-zero when anything
differs.

Mixture-of-experts presets with an MoE block in every layer and no shared experts
(``mixtral-8x7b``) build a ``MixtralForCausalLM``.  Routing depends on the data, which a
meta-device step has none of, so dispatch routes every rank's tokens evenly over the
experts (balanced routing, :func:`autopar.ops.moe.balanced_counts`): the all-to-alls are
compared with the cost model at those counts (``comm_table(expert_counts=...)``), which is
what the model predicts for balanced routing (``routing_imbalance=1``).  Other MoE layouts
are refused with a message.

Run: ``python benchmarks/scale_simulation.py --plan PLAN [--layers L] [--rank R] [--model PRESET]
[--seq S] [--micro-batch B]`` (progress is printed as it goes).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import autopar  # noqa: E402

__all__ = ["simulate", "compare", "main"]


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def _spec(model: str, layers: int | None) -> "autopar.ModelSpec":
    import dataclasses

    spec = autopar.ModelSpec.preset(model)
    if spec.is_moe and (spec.moe_layer_freq != 1 or spec.num_shared_experts or spec.first_dense_layers):
        raise SystemExit(f"scale_simulation: {model} mixes dense and MoE layers (or has shared experts); only "
                         "presets with an MoE block in every layer (mixtral-8x7b) are built here. Price it with "
                         "autopar.estimate instead.")
    return dataclasses.replace(spec, num_layers=layers) if layers else spec


def _model(spec, seq: int):
    """The preset as a transformers model on the current (meta) device: Llama, or Mixtral for MoE."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads or spec.num_heads,
                  head_dim=spec.head_dim, max_position_embeddings=seq, tie_word_embeddings=spec.tied_embeddings,
                  attn_implementation="sdpa")
    if spec.is_moe:
        return MixtralForCausalLM(MixtralConfig(intermediate_size=spec.moe_ffn or spec.ffn,
                                                num_local_experts=spec.num_experts,
                                                num_experts_per_tok=spec.top_k, **common))
    return LlamaForCausalLM(LlamaConfig(intermediate_size=spec.ffn, **common))


def simulate(layers: int | None, plan: str, seq: int, micro_batch: int, *, rank: int = 0,
             model: str = "llama3-70b", log=print) -> dict:
    """Compile and step rank ``rank`` under a fake world; what it measured and what the cost model says."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    p = autopar.Plan.parse(plan)
    if not 0 <= rank < p.world_size:
        raise SystemExit(f"scale_simulation: --rank {rank} is outside the plan's world of {p.world_size} ranks")
    spec = _spec(model, layers)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=p.world_size)
    try:
        with torch.device("meta"):
            net = _model(spec, seq)
        batch = micro_batch * p.dp * p.mb
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        log(f"[1/3] compiling {spec.num_layers}-layer {model} (hidden {spec.hidden}) for '{plan}' as rank {rank} "
            f"of a fake world of {p.world_size}")
        start = time.perf_counter()
        pm = autopar.parallelize(net, (ids,), {"use_cache": False}, plan=plan, loss_fn=_loss)
        seconds = time.perf_counter() - start
        for line in pm.program.log:
            log(f"      {line}")
        log(f"      compiled in {seconds:.1f} s")
        log("[2/3] one training step on the meta device")
        pm.train_step((ids,), ids)
        log("[3/3] comparing with the cost model")
        stage = pm.coords().get("pp", (0, 1))[0]
        cost = autopar.estimate(spec, autopar.Cluster.for_world("h100", p.world_size), plan, seq_len=seq,
                                global_batch=batch, dtype_bytes=4)
        return measured_and_predicted(pm, cost, stage, seconds)
    finally:
        dist.destroy_process_group()


def measured_and_predicted(pm, cost, stage: int, seconds: float = 0.0) -> dict:
    """What :func:`compare` reads: the step's bytes and calls per (phase, collective, axis),
    measured on ``pm`` and predicted by ``cost`` for ``stage``, and the parameter bytes."""
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
    for row in cost.comm_table(stage, expert_counts=counts or None, ep_rank=ep_rank):
        entry = predicted[(row.phase, row.collective, row.axis)]
        entry[0] += (row.bytes_sent + row.bytes_recv) * row.count
        entry[1] += row.count
    local_params = sum(t.numel() * t.element_size() for t in set(pm.gm.parameters()))
    return {"measured": {k: tuple(v) for k, v in measured.items()},
            "predicted": {k: tuple(v) for k, v in predicted.items()},
            "param_bytes": pm.memory_report().get("params", local_params),
            "predicted_param_bytes": cost.memory(stage)["params"],
            "stage": stage, "compile_seconds": seconds, "zero": pm.plan.zero}


def compare(result: dict, out=print) -> bool:
    """Print measured against predicted per collective; True when everything is equal."""
    ok = True
    out(f"\n{'phase':6s} {'collective':15s} {'axis':9s} {'calls':>6s} {'measured (bytes moved)':>24s} "
        f"{'calls':>6s} {'cost model':>24s}  equal")
    for key in sorted(set(result["measured"]) | set(result["predicted"])):
        (m, mc), (p, pc) = result["measured"].get(key, (0.0, 0)), result["predicted"].get(key, (0.0, 0))
        # Gradient all-reduces, and ZeRO-1/2's reduce-scatters and gathers of the updated
        # parameters, run per bucket (bucket_bytes): the cost model's one row per step carries
        # their bytes, not the bucket count (ZeRO-3's per-unit calls are counted).
        per_bucket = {("grad", "all_reduce")} | ({("grad", "reduce_scatter"), ("step", "all_gather")}
                                                 if result["zero"] in (1, 2) else set())
        bucketed = key[:2] in per_bucket and key[2] in ("dp", "dp_cp", "edp")
        equal = (bucketed or mc == round(pc)) and abs(m - p) <= 1e-9 * max(m, p, 1.0)
        ok &= equal
        out(f"{key[0]:6s} {key[1]:15s} {key[2]:9s} {mc:6d} {m:24,.0f} {pc:6.0f} {p:24,.0f}  {equal}")
    params_equal = result["param_bytes"] == result["predicted_param_bytes"]
    ok &= params_equal
    out(f"parameter bytes on this rank (stage {result['stage']}): measured {result['param_bytes']:,}, "
        f"cost model {result['predicted_param_bytes']:,.0f}  {params_equal}")
    out(f"compiled in {result['compile_seconds']:.1f} s; {'all equal' if ok else 'DIFFERENCES FOUND'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="tp=8,sp,dp=16")
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the preset's)")
    ap.add_argument("--rank", type=int, default=0, help="the rank to compile (its pipeline stage)")
    ap.add_argument("--model", default="llama3-70b",
                    help="an autopar.ModelSpec preset (dense, or MoE in every layer: balanced routing)")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args(argv)
    r = simulate(args.layers, args.plan, args.seq, args.micro_batch, rank=args.rank, model=args.model)
    return 0 if compare(r) else 1


if __name__ == "__main__":
    sys.exit(main())
