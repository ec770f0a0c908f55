"""Scale simulation: compile and step a full-size model in one CPU process, count its bytes.

A Llama-3-70B-shaped ``transformers.LlamaForCausalLM`` (80 layers, hidden 8192) is built
on the meta device (no memory), compiled by ``autopar.parallelize`` for a plan under a
*fake* process group of the full world size (``torch.distributed`` backend "fake": every
collective is a no-op), and stepped once.  The runtime records every collective of this
rank exactly as on a real cluster, so the per-rank bytes can be compared with the cost
model's ``comm_table()`` for the same shapes; parameter bytes per rank are compared
with the cost model's memory terms.

Run: ``python benchmarks/scale_simulation.py [--layers 80] [--plan tp=8,sp,dp=16] [--seq 8192]``
(progress is printed as it goes; the 80-layer compile takes a few minutes on 2 cores).
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

__all__ = ["simulate", "main"]


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def simulate(layers: int, plan: str, seq: int, micro_batch: int, log=print) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import LlamaConfig, LlamaForCausalLM

    p = autopar.Plan.parse(plan)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                      num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=seq,
                      attn_implementation="sdpa")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p.world_size)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        batch = micro_batch * p.dp * p.mb
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        log(f"[1/3] compiling {layers}-layer Llama (hidden 8192) for '{plan}' on a fake world of {p.world_size}")
        start = time.perf_counter()
        pm = autopar.parallelize(model, (ids,), {"use_cache": False}, plan=plan, loss_fn=_loss)
        for line in pm.program.log:
            log(f"      {line}")
        log(f"      compiled in {time.perf_counter() - start:.1f} s")
        log("[2/3] one training step on the meta device")
        pm.train_step((ids,), ids)
        log("[3/3] comparing with the cost model")
        spec = autopar.ModelSpec(name="llama3-70b-shaped", num_layers=layers, hidden=8192, num_heads=64,
                                 num_kv_heads=8, ffn=28672, vocab=128256)
        cluster = autopar.Cluster.for_world("h100", p.world_size)
        cost = autopar.estimate(spec, cluster, plan, seq_len=seq, global_batch=batch, dtype_bytes=4)
        measured = collections.defaultdict(float)
        for r in pm.comm_stats():
            measured[(r["phase"], r["op"], r["axis"])] += r["bytes_sent"]
        predicted = collections.defaultdict(float)
        for row in cost.comm_table():
            predicted[(row.phase, row.collective, row.axis)] += row.bytes_sent * row.count
        local_params = sum(t.numel() * t.element_size() for t in pm.gm.parameters())
        return {"measured": dict(measured), "predicted": dict(predicted), "param_bytes": local_params,
                "predicted_param_bytes": cost.memory()["params"]}
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--plan", default="tp=8,sp,dp=16")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args(argv)
    r = simulate(args.layers, args.plan, args.seq, args.micro_batch)
    print(f"\n{'phase':6s} {'collective':15s} {'axis':5s} {'measured (bytes sent)':>24s} {'cost model':>24s}  equal")
    for key in sorted(set(r["measured"]) | set(r["predicted"])):
        m, p = r["measured"].get(key, 0.0), r["predicted"].get(key, 0.0)
        print(f"{key[0]:6s} {key[1]:15s} {key[2]:5s} {m:24,.0f} {p:24,.0f}  {abs(m - p) <= 1e-9 * max(m, p, 1)}")
    print(f"parameter bytes on this rank: measured {r['param_bytes']:,}, cost model {r['predicted_param_bytes']:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
