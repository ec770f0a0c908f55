"""Elastic training: after a failure torchrun restarts the workers, which re-plan for the ranks left and resume.

    torchrun --nnodes=1:2 --nproc-per-node=4 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=$HEAD:29400 --rdzv-id=run1 examples/train_elastic.py --ckpt-dir ckpt/run1 --steps 1000

Every start of the workers, the first and each restart torchrun makes after a rank, a node or a
save failed, runs the same code (docs/fault-tolerance.md):

1. ``autopar.init_distributed(timeout=--timeout)``: a collective whose peer died raises within the
   timeout (the process exits non-zero and torchrun restarts the group), and a restarted group
   connects afresh (:mod:`autopar.runtime.rendezvous`).
2. The model is built on the meta device (a Llama from ``--config``, a Hugging Face
   ``config.json``; by default a tiny one with attention dropout), and ``autopar.parallelize(...,
   plan="auto")`` picks a plan for the world it now has: 8 ranks, 4 after a node was lost.
3. ``autopar.latest_checkpoint(--ckpt-dir)``, if there is one, is loaded with ``pm.load(latest,
   data=sampler)``: weights, AdamW state, the LR schedule, the step, dropout's RNG streams and the
   sampler's position, saved under any plan on any world size.  Otherwise each rank initialises
   its own shards (``init_weights=model._init_weights``).
4. Training runs to ``--steps``.  The data are ``--samples`` synthetic sequences (every rank makes
   the same ones from ``--seed``); a ``DistributedBatchSampler`` gives each rank its rows of each
   global batch of ``--batch``, in the same global order whatever the dp size, so the resumed run
   sees the samples the uninterrupted one would.  Every ``--save-every`` steps
   ``pm.save(<ckpt-dir>/step-<n>, blocking=False, keep=--keep, data=sampler, overlap_steps=1)``
   stages the state and writes it while the next step's forward and backward run; that step's
   update waits for the write, so a failure loses at most ``--save-every`` steps, as with blocking
   saves (``--overlap-steps k`` lets a slow write overlap k steps: at most ``--save-every + k - 1``).
   The last step is saved too.

Output (rank 0; ``time`` is the wall clock, for measuring recovery)::

    plan dp=4 on 4 ranks
    resumed from ckpt/run1/step-00000008 at step 8
    step 9 loss 4.123456 time 1733461234.567
    done at step 16

and, from every rank, ``worker rank R pid P world W`` when it starts.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

__all__ = ["synthetic_tokens", "build_model", "main"]


def synthetic_tokens(samples: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """``[samples, seq + 1]`` tokens that a model can learn: each row an arithmetic sequence modulo
    ``vocab`` from a random start and stride (the same on every rank, from ``seed``)."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=gen)
    stride = torch.randint(1, 8, (samples, 1), generator=gen)
    return (start + stride * torch.arange(seq + 1)) % vocab


def build_model(config_path: str | None, dropout: float):
    """A Llama built on the meta device from ``config_path`` (a config.json or its directory), or a
    tiny one (hidden 64, 2 layers, vocab 256) with ``dropout`` on the attention probabilities."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if config_path:
        config = AutoConfig.from_pretrained(config_path, local_files_only=True)
    else:
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             attention_dropout=dropout)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _line(text: str) -> None:
    """``text`` as one line of output in one write: the ranks share torchrun's stdout, and a line
    printed in two writes (text, then newline) can have another rank's line land in between."""
    os.write(sys.stdout.fileno(), (text + "\n").encode())


def _say(text: str) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        _line(text)


def _setup(args):
    """The program for this world (resumed from the newest checkpoint, if any), its sampler, the data."""
    import autopar

    model = build_model(args.config, args.dropout)
    tokens = synthetic_tokens(args.samples, args.seq, model.config.vocab_size, args.seed)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=functools.partial(
        _lr_factor, warmup=args.warmup, total=args.steps))
    latest = autopar.latest_checkpoint(args.ckpt_dir)
    pm = autopar.parallelize(model, example_inputs=(tokens[:args.batch, :-1],), example_kwargs={"use_cache": False},
                             plan=args.plan, loss_fn=_loss, lr_scheduler=schedule,
                             optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=0.01),
                             init_weights=None if latest else model._init_weights)
    sampler = autopar.DistributedBatchSampler(args.samples, args.batch, pm, shuffle=True, seed=args.seed)
    _say(f"plan {pm.plan} on {pm.plan.world_size} ranks")
    if latest:
        pm.load(latest, data=sampler)  # saved under any plan, on any number of ranks
        _say(f"resumed from {latest} at step {pm.num_steps_taken}")
    return pm, sampler, tokens


def _train(args, pm, sampler, tokens) -> None:
    slc = pm.batch_slice(args.batch, seq_len=args.seq)
    saved = pm.num_steps_taken
    epoch = sampler.epoch
    while pm.num_steps_taken < args.steps:
        sampler.set_epoch(epoch)
        for rows in sampler:
            ids, target = tokens[rows, :-1], tokens[rows, 1:]
            loss = pm.train_step((slc.take_positions(ids),), slc.take_positions(target), local=True)
            n = pm.num_steps_taken
            _say(f"step {n} loss {loss:.6f} time {time.time():.3f}")
            if n % args.save_every == 0 or n == args.steps:
                pm.save(os.path.join(args.ckpt_dir, f"step-{n:08d}"), blocking=False, keep=args.keep or None,
                        data=sampler, overlap_steps=args.overlap_steps)  # bounds the steps a failure loses
                saved = n
            if n >= args.steps:
                break
        epoch += 1
    pm.wait_checkpoint()
    _say(f"done at step {pm.num_steps_taken} (last checkpoint at step {saved})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt-dir", required=True, help="where checkpoints go and are resumed from")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (0: all)")
    p.add_argument("--overlap-steps", type=int, default=1, help="steps a background write may overlap")
    p.add_argument("--plan", default="auto", help="'auto': the plan the search picks for the world at each start")
    p.add_argument("--config", default=None, help="a Hugging Face config.json (or its directory); default: tiny")
    p.add_argument("--dropout", type=float, default=0.1, help="attention dropout of the default tiny model")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=8, help="global batch, in sequences")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective waits for a dead or stuck peer (default: autopar's, 10 min)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import autopar
    import torch.distributed as dist

    autopar.init_distributed(timeout=args.timeout)
    _line(f"worker rank {dist.get_rank()} pid {os.getpid()} world {dist.get_world_size()}")
    torch.manual_seed(args.seed)  # every rank alike: the initial weights and dropout's base seed
    pm, sampler, tokens = _setup(args)
    _train(args, pm, sampler, tokens)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from autopar.error_report import exit_on_error  # an autopar: error: one line, once per torchrun job

    sys.exit(exit_on_error(main))
