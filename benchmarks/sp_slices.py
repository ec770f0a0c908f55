"""Benchmark: sequence parallelism's collectives on per-sample slices against moving the sequence dim (issue 30 item 4).

SP's all-gathers and reduce-scatters run along the sequence dim 1 of ``[batch, seq, hidden]``.
From micro-batch 2 on, autopar runs each as one coalesced call over the samples' contiguous
slices, copying nothing (autopar/ops/collectives.py, "Copy-free slices"); the alternative stacks
the ranks' pieces in front around one call (one copy of whole rows: of the gathered result, or of
the input to reduce-scatter; before 2026-12-06 it moved the dim to the front and back, copying both).
Three sides run here on 2 gloo ranks, the same ``tp=2,sp`` program of the example decoder
stepped under each of ``collectives.SLICED_OPS``'s choices for gloo: ``both`` sliced (what NCCL runs), ``gloo`` (its default: gathers sliced, reduce-scatters stacked) and
``none`` (both stacked), in rotating order, at several micro-batch sizes.  Each step starts after a
barrier and is timed as the slower rank; the steps' losses must be equal bit for bit (the same
values travel and sum in the same order).  The table gives each side's median step and the
medians of the per-step ratios to ``none``.  These are gloo's costs: its coalesced calls pay a
host-side fixed cost per slice that NCCL's grouped launch does not, and the copies saved are
device-memory traffic on a GPU.

    .venv/bin/python benchmarks/sp_slices.py [--steps 10] [--micro-batches 1,2,8] [--hidden 256] [--seq 256]

Figures: docs/performance.md ("Sequence parallelism at micro-batch 2 and more").
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gloo_ranks import run_ranks, slowest  # noqa: E402

SIDES = ("both", "gloo", "none")
POLICY = {"both": frozenset({"all_gather", "reduce_scatter"}), "none": frozenset()}  # "gloo": the default


def _worker(rank: int, world: int, args) -> dict:
    import autopar
    from autopar.ops import collectives
    from benchmarks.models import example_model, lm_loss, make_batch

    default, out = collectives.SLICED_OPS, {}
    for micro in args.micro_batches:
        model = example_model(0, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                              num_heads=8, num_kv_heads=4, intermediate_size=2 * args.hidden)
        batches = [make_batch(args.vocab, micro, args.seq, seed=s) for s in range(args.warmup + args.steps)]
        pm = autopar.parallelize(model, example_inputs=(batches[0][0],), plan=f"tp={world},sp", loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.0))  # lr 0: both sides see one model
        times, losses = {side: [] for side in SIDES}, {side: [] for side in SIDES}
        for i, (ids, target) in enumerate(batches):
            for side in SIDES[i % 3:] + SIDES[:i % 3]:  # each side first in turn
                collectives.SLICED_OPS = {**default, "gloo": POLICY[side]} if side in POLICY else default
                loss, seconds = slowest(pm.train_step, (ids,), target)
                losses[side].append(float(loss))
                if i >= args.warmup:
                    times[side].append(seconds)
        collectives.SLICED_OPS = default
        out[micro] = {"times": times, "equal": losses["both"] == losses["gloo"] == losses["none"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args(argv)
    print(f"tp=2,sp on 2 gloo ranks, example decoder hidden {args.hidden}, {args.layers} layers, seq {args.seq}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per side", file=sys.stderr)
    report = run_ranks(_worker, 2, args)
    print(f"{'micro-batch':>12}{'both ms':>9}{'gloo ms':>9}{'none ms':>9}{'both/none':>11}{'gloo/none':>11}"
          f"{'losses equal':>14}")
    for micro, r in report.items():
        t = r["times"]
        ratio = {side: statistics.median(a / b for a, b in zip(t[side], t["none"])) for side in ("both", "gloo")}
        print(f"{micro:>12}" + "".join(f"{statistics.median(t[side]) * 1e3:>9.1f}" for side in SIDES)
              + f"{ratio['both']:>11.2f}{ratio['gloo']:>11.2f}{str(r['equal']):>14}")
    return 0 if all(r["equal"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
