"""Benchmark: the cost of expert parallelism's dispatch and combine, against experts kept local.

The example MoE decoder (``examples/model.py``, ModuleList experts, top-2) trains on
2 gloo ranks of this machine under two plans:

- ``dp=2``: every rank holds every expert and runs them on its own tokens (the traced
  experts, unchanged);
- ``ep=2,dp=2``: each rank holds half of the experts; tokens travel to their experts'
  owner and back (``autopar/ops/moe.py``: counts all-to-all, token all-to-all, reverse
  all-to-all), and expert gradients need no reduction.

Both plans compute the same function on the same batches, so the first steps' losses are
compared before timing.  Steps are interleaved (dp, ep, dp, ...) after warm-up; each step
starts after a barrier and its time is the slower rank's.  The report gives each plan's
median step time and the median of the per-pair ratios ep/dp.  On CPUs with gloo the
ratio measures the overhead of routing (sorting, host-side split sizes, the extra
collectives) against the saved expert compute and gradient all-reduce; it is not a
prediction for NVLink or InfiniBand.

Run: ``python benchmarks/ep_dispatch.py [--steps N] [--warmup N] [--experts E] [--json]``.
Results: ``docs/performance.md``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gloo_ranks import run_ranks, size_arguments, slowest  # noqa: E402

__all__ = ["run_benchmark", "main"]

WORLD_SIZE = 2
PLANS = ("dp=2", "ep=2,dp=2")


def _worker(rank: int, world: int, args) -> dict:
    import autopar
    from benchmarks.models import example_moe, lm_loss, make_batch

    batches = [make_batch(128, args.batch, args.seq, seed=s) for s in range(args.warmup + args.steps)]
    modules = {}
    for plan in PLANS:
        model = example_moe(0, num_experts=args.experts, hidden_size=args.hidden,
                            intermediate_size=2 * args.hidden)
        modules[plan] = autopar.parallelize(model, example_inputs=(batches[0][0],), plan=plan, loss_fn=lm_loss,
                                            optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    times = {plan: [] for plan in PLANS}
    losses = {plan: [] for plan in PLANS}
    for i, (ids, target) in enumerate(batches):
        for plan in PLANS:
            loss, seconds = slowest(modules[plan].train_step, (ids,), target)
            losses[plan].append(loss)
            if i >= args.warmup:
                times[plan].append(seconds)
    return {"times": times, "losses": losses}


def run_benchmark(args) -> dict:
    result = run_ranks(_worker, WORLD_SIZE, args)
    dp, ep = (result["times"][p] for p in PLANS)
    first = [result["losses"][p][:2] for p in PLANS]
    return {
        "plans": list(PLANS), "experts": args.experts, "hidden": args.hidden, "batch": args.batch,
        "seq": args.seq, "steps": args.steps,
        "losses_match": all(abs(a - b) <= 1e-5 for a, b in zip(*first)),
        "median_s": {PLANS[0]: statistics.median(dp), PLANS[1]: statistics.median(ep)},
        "median_ratio_ep_over_dp": statistics.median(e / d for e, d in zip(ep, dp)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size_arguments(parser, steps=20, warmup=3, experts=8, hidden=128, batch=8, seq=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    print(f"benchmark: {args.warmup} warm-up + {args.steps} timed steps of each plan on {WORLD_SIZE} gloo ranks",
          file=sys.stderr)
    report = run_benchmark(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"losses of the first two steps match: {report['losses_match']}")
        for plan, t in report["median_s"].items():
            print(f"{plan:>12}: median step {t * 1e3:.1f} ms")
        print(f"median ratio ep/dp: {report['median_ratio_ep_over_dp']:.2f}")
    return 0 if report["losses_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
