"""``autopar verify --model MODEL --plan PLAN [--world N] [--layers L] [--steps K] [--seed S]``.

Proves a plan on a shrunk copy of the model before a cluster is spent on it: the plan runs
on N gloo processes on this machine's CPU and the unparallelized model in one process, on
the same weights, batches and optimizer, fp32 (:func:`autopar.verification.verify`).  Prints
what was shrunk, each step's loss and its difference, the worst gradient and parameter
differences with the tensors' names, and a verdict line.  Exit status: 0 equal within the
bounds, 1 different (or a rank crashed), 2 the plan is refused for this model (the
``autopar:`` error is printed; autopar/cli/__init__.py maps it).
"""
from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run_verify"]


def run_verify(args: argparse.Namespace) -> int:
    from autopar.verification import RankFailure, verify  # here: `autopar plan` never loads torch
    from autopar.verification.api import _corrupting  # the testing hook, not in verify's signature

    try:
        with _corrupting(args.corrupt):
            result = verify(args.model, args.plan, world_size=args.world, layers=args.layers, steps=args.steps,
                            seed=args.seed, optimizer=args.optimizer, global_batch=args.batch, seq_len=args.seq,
                            timeout=args.timeout, log=lambda line: print(line, flush=True))
    except RankFailure as exc:
        print(str(exc), file=sys.stderr)
        print("verdict: FAILED - the parallel run did not complete; see the error above.")
        return 1
    print(result.report())
    return 0 if result.ok else 1


def register(sub) -> None:
    p = sub.add_parser("verify", help="prove a plan on a shrunk copy of the model on CPU gloo processes",
                       description="Run a plan on N gloo processes on this machine's CPU and the unparallelized model "
                                   "in one process, on a shrunk copy of the model with the same weights, batches and "
                                   "optimizer, and compare losses, gradients and parameters step by step. Exit "
                                   "status 0: equal within the bounds; 1: different; 2: the plan is refused.")
    p.add_argument("--model", required=True,
                   help="a preset (llama3-8b, llama3-70b, mixtral-8x7b, ...), a transformers model type (qwen2), "
                        "a config.json path, or MODULE:FUNCTION returning a model")
    p.add_argument("--plan", required=True, help="plan text, e.g. tp=2,sp or dp=2,zero=1")
    p.add_argument("--world", type=int, default=None, help="number of ranks (default: the plan's world size)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the shrunk model (default: 2, or the plan's pipeline chunks)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (default 0)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd (lr 0.1; gradients compared too) or adamw (lr 1e-3, weight decay 0.1)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: >= 4, split by dp*mb)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: >= 16, split by cp and sp)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds the ranks may take (default 600)")
    p.add_argument("--corrupt", default=None, metavar="PARAM",
                   help="testing: double PARAM's gradient on one rank, to see verify report the difference")
    p.set_defaults(func=run_verify)
