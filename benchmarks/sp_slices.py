"""Benchmark: sequence parallelism's collectives sliced per sample against moving the sequence dim (issue 30 item 4).

SP's all-gathers and reduce-scatters run along the sequence dim 1 of ``[batch, seq, hidden]``.
From micro-batch 2 on, autopar issues each as one call per sample on contiguous slices, copying
nothing (autopar/ops/collectives.py, "Copy-free slices"); the alternative it replaced moved the
dim to the front and back around one call (``movedim(...).contiguous()``: a copy of the input and
of the result).  Both run here side by side on 2 gloo ranks: the same ``tp=2,sp`` program of the
example decoder, stepped with ``collectives.MAX_PARTS`` at its default (sliced) and at 0 (moved),
alternately, at several micro-batch sizes.  Each step starts after a barrier and is timed as the
slower rank; the first steps' losses must be equal bit for bit (the same values travel and sum in
the same order).  The table gives each side's median step and the median of the per-step ratios
sliced / moved.  On gloo every call pays a host round trip that NCCL's launches do not, so CPU
ratios bound the cost of the extra calls from above; the copies saved are device-memory traffic on
a GPU.

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

SIDES = ("sliced", "moved")


def _worker(rank: int, world: int, args) -> dict:
    import autopar
    from autopar.ops import collectives
    from tests.support.models import example_model, lm_loss, make_batch

    default, out = collectives.MAX_PARTS, {}
    for micro in args.micro_batches:
        model = example_model(0, vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                              num_heads=8, num_kv_heads=4, intermediate_size=2 * args.hidden)
        batches = [make_batch(args.vocab, micro, args.seq, seed=s) for s in range(args.warmup + args.steps)]
        pm = autopar.parallelize(model, example_inputs=(batches[0][0],), plan=f"tp={world},sp", loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.0))  # lr 0: both sides see one model
        times, losses = {side: [] for side in SIDES}, {side: [] for side in SIDES}
        for i, (ids, target) in enumerate(batches):
            for side in SIDES:
                collectives.MAX_PARTS = default if side == "sliced" else 0
                loss, seconds = slowest(pm.train_step, (ids,), target)
                losses[side].append(float(loss))
                if i >= args.warmup:
                    times[side].append(seconds)
        collectives.MAX_PARTS = default
        out[micro] = {"times": times, "equal": losses["sliced"] == losses["moved"]}
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
    print(f"{'micro-batch':>12}{'sliced ms':>11}{'moved ms':>10}{'sliced/moved':>14}{'losses equal':>14}")
    for micro, r in report.items():
        sliced, moved = r["times"]["sliced"], r["times"]["moved"]
        ratio = statistics.median(a / b for a, b in zip(sliced, moved))
        print(f"{micro:>12}{statistics.median(sliced) * 1e3:>11.1f}{statistics.median(moved) * 1e3:>10.1f}"
              f"{ratio:>14.2f}{str(r['equal']):>14}")
    return 0 if all(r["equal"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
