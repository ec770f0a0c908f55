"""The optimizer's share of a training step, flat fused step against per-tensor (issue 30 item 2).

One process, ``plan="none"`` (world 1), the example decoder (examples/model.py) at a modest
size, AdamW.  Six programs, built side by side: ``mixed_precision`` None (fp32) and
``"bf16"``, each with ``fused_optimizer=False`` (the per-tensor ``foreach`` step), with
``fused_optimizer=True`` as one rank runs it (per tensor, ``fused=True``: without
data-parallel buckets the gradients are not kept between steps, so they are not made flat),
and flat and fused as a ``dp >= 2`` rank runs it (autopar/runtime/gradients/fused_step.py; here by
making ``GradSync._keeps_grads`` answer True, the only difference from such a rank being
that no all-reduce runs).  Their steps are interleaved round by round, so machine noise hits
all alike; the table gives the median
of each program's ``train_step``, of ``pm.optimizer.step()`` inside it and of the whole
``grad_sync.step()`` (the optimizer plus gathering the flat gradient, zeroing and, under bf16,
copying the masters into the bf16 parameters), their share of the step, and the per-tensor
over fused ratio of the optimizer's time.

    .venv/bin/python benchmarks/optimizer_share.py [--steps 20] [--layers 8] [--hidden 256] [--threads 1]

Figures: docs/performance.md ("Optimizer step: flat and fused").
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import autopar  # noqa: E402
from autopar.runtime.gradients.grad_sync import GradSync  # noqa: E402
from benchmarks.gloo_ranks import size_arguments  # noqa: E402
from benchmarks.models import example_module as _example  # noqa: E402

MODES = ("per-tensor foreach", "per-tensor fused", "flat fused")


def _timed(times: list, fn):
    """``fn`` that appends each call's wall time (s) to ``times``."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - start)
    return run


def build(args, mixed_precision, mode: str):
    ex = _example()
    torch.manual_seed(0)
    cfg = ex.DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=8, num_kv_heads=4, intermediate_size=2 * args.hidden)
    model = ex.Decoder(cfg)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    batch = ((ids[:, :-1],), ids[:, 1:])
    keeps = GradSync._keeps_grads
    if mode == "flat fused":
        GradSync._keeps_grads = lambda self: True  # as on a dp >= 2 rank (the module docstring)
    try:
        pm = autopar.parallelize(model, example_inputs=batch[0], plan="none", loss_fn=ex.lm_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, weight_decay=0.1),
                                 mixed_precision=mixed_precision, fused_optimizer=mode != "per-tensor foreach")
    finally:
        GradSync._keeps_grads = keeps
    assert (pm.grad_sync.flat is not None) == (mode == "flat fused")
    times = {"step": [], "optimizer": [], "grad_sync.step": []}
    pm.optimizer.step = _timed(times["optimizer"], pm.optimizer.step)
    pm.grad_sync.step = _timed(times["grad_sync.step"], pm.grad_sync.step)
    pm.train_step = _timed(times["step"], pm.train_step)
    return pm, batch, times, sum(p.numel() for p in model.parameters()), len(list(model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size_arguments(parser, steps=20, warmup=3, layers=8, hidden=256, vocab=1024, batch=2, seq=32, threads=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {}
    for mp in (None, "bf16"):
        for mode in MODES:
            runs[(mp, mode)] = build(args, mp, mode)
    _, _, _, numel, count = next(iter(runs.values()))
    for step in range(args.warmup + args.steps):
        for pm, batch, times, _, _ in runs.values():
            pm.train_step(*batch)
            if step < args.warmup:
                for t in times.values():
                    t.clear()
    print(f"example decoder: {count} parameter tensors, {numel / 1e6:.2f} M parameters; torch {torch.__version__}, "
          f"{args.threads} thread(s), batch {args.batch}x{args.seq}, median of {args.steps} steps")
    print(f"{'precision':<10}{'optimizer':<22}{'step ms':>9}{'opt ms':>9}{'opt %':>7}{'sync.step ms':>14}{'%':>6}")
    medians = {}
    for (mp, mode), (_, _, times, _, _) in runs.items():
        m = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        medians[(mp, mode)] = m
        print(f"{mp or 'fp32':<10}{mode:<22}{m['step']:>9.2f}"
              f"{m['optimizer']:>9.2f}{100 * m['optimizer'] / m['step']:>7.1f}{m['grad_sync.step']:>14.2f}"
              f"{100 * m['grad_sync.step'] / m['step']:>6.1f}")
    for mp in (None, "bf16"):
        a = medians[(mp, MODES[0])]
        for mode in MODES[1:]:
            b = medians[(mp, mode)]
            print(f"{mp or 'fp32'}: {MODES[0]} / {mode}: optimizer {a['optimizer'] / b['optimizer']:.2f}x, "
                  f"grad_sync.step {a['grad_sync.step'] / b['grad_sync.step']:.2f}x, step {a['step'] / b['step']:.2f}x")


if __name__ == "__main__":
    main()
