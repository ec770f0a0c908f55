"""Train a small Llama-style model with autopar, or with plain PyTorch for comparison.

    torchrun --nproc-per-node 4 examples/train_llama.py --plan tp=2,sp,dp=2 --steps 5
    python examples/train_llama.py --plan none --steps 5

Every rank builds the same model from ``--seed`` and draws the same global batch at
each step (from the seed and the step number). With a plan, ``autopar.parallelize``
shards the model and ``train_step`` takes the global batch, slicing what each rank
needs; with ``--plan none`` the same model, optimizer and batches are trained by
plain PyTorch on the CPU, without autopar. Both print ``step {i} loss {loss}`` on
rank 0, so the two runs can be compared line by line.

The data (``--data``): by default each row counts up by one from a random token, a task the model
learns, so the loss falls from ln(128) = 4.85 (to about 4.4 in 5 steps, 3.3 in 20, on the defaults);
``--data random`` draws uniform random tokens, which hold nothing to learn: the loss stays near 4.85,
and that is expected, not a broken run.  ``--report FILE``: after the last step, rank 0 writes the
plan's HTML page with the step's measurements beside the cost model's (``pm.report``, docs/report.md).

The model is the example decoder in ``examples/model.py`` (``--model example``) or a
tiny Hugging Face ``LlamaForCausalLM`` built from a config (``--model hf``, needs
``transformers``; nothing is downloaded).

A fuller recipe, the same on both paths:

    torchrun --nproc-per-node 4 examples/train_llama.py --plan tp=2,sp,dp=2 --steps 20 \
        --max-grad-norm 1.0 --warmup 4 --cosine --eval-every 5 --stats

clips the global gradient norm, warms the learning rate up linearly and decays it on a
cosine, evaluates a held-out batch every 5 steps (``eval step {i} loss {loss}``) and prints
each step's gradient norm, learning rate and throughput (``stats step {i} ...``: autopar's
``pm.last_step_stats``, with the cost model's predicted step time and MFU on GPUs).

``--bf16`` trains in bf16 mixed precision: ``mixed_precision="bf16"`` with a plan (on GPUs
under torchrun this is the usual way to train), and on the plain path the same recipe by
hand (a bf16 copy for forward and backward, the loss on fp32 logits, fp32 masters stepped).
"""
from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Decoder, DecoderConfig, lm_loss, make_batch  # noqa: E402

__all__ = ["build_model", "make_optimizer_factory", "batch_for_step", "main"]

VOCAB = 128


def _hf_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def build_model(kind: str, seed: int, seq: int):
    """``(model, loss_fn, example_kwargs)`` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    if kind == "example":
        return Decoder(DecoderConfig(vocab_size=VOCAB)), lm_loss, {}
    if kind == "moe":  # 4 experts, top-2, in every layer: try --plan ep=2,dp=2,tp=2,sp
        return Decoder(DecoderConfig(vocab_size=VOCAB, num_experts=4, top_k=2, intermediate_size=64)), lm_loss, {}
    if kind == "hf":
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError:
            raise SystemExit("--model hf needs transformers: pip install 'transformers>=5'") from None
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=max(64, seq), attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config), _hf_loss, {"use_cache": False}
    raise SystemExit(f"unknown --model {kind!r}; expected example, moe or hf")


def make_optimizer_factory(name: str, lr: float):
    """An optimizer factory ``params -> Optimizer`` (what autopar.parallelize expects)."""
    if name == "adamw":
        return functools.partial(torch.optim.AdamW, lr=lr)
    if name == "sgd":
        return functools.partial(torch.optim.SGD, lr=lr)
    raise SystemExit(f"unknown --optimizer {name!r}; expected adamw or sgd")


def counting_batch(vocab_size: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable task: each row counts up by one from a random start (mod the vocabulary), so the next
    token follows from the current one and the loss falls from ln(vocab) within a few steps."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (batch, 1), generator=gen, dtype=torch.int64)
    tokens = (start + torch.arange(seq + 1, dtype=torch.int64)) % vocab_size
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _batch(args, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    make = counting_batch if args.data == "counting" else make_batch
    return make(VOCAB, args.batch, args.seq, seed=seed)


def batch_for_step(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    return _batch(args, args.seed * 1_000_003 + step)


def eval_batch(args) -> tuple[torch.Tensor, torch.Tensor]:
    """A held-out batch, never trained on."""
    return _batch(args, args.seed * 1_000_003 - 1)


def lr_factor(args, step: int) -> float:
    """Linear warm-up over ``--warmup`` steps, then constant or (``--cosine``) down to 10%."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if not args.cosine:
        return 1.0
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def scheduler_factory(args):
    """What ``autopar.parallelize(lr_scheduler=...)`` expects: called with the optimizer."""
    return functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=functools.partial(lr_factor, args))


def _report(args, step: int, rank: int, loss: float, grad_norm, lr: float, seconds: float,
            evaluate, predicted: dict | None = None) -> None:
    evaluated = evaluate() if args.eval_every and (step + 1) % args.eval_every == 0 else None  # every rank
    if rank != 0:
        return
    print(f"step {step} loss {loss:.6f}", flush=True)
    if args.stats:
        norm = "-" if grad_norm is None else f"{grad_norm:.4f}"
        extra = "".join(f" {k} {v:.4g}" for k, v in (predicted or {}).items())
        print(f"stats step {step} grad_norm {norm} lr {lr:.3g} tokens/s {args.batch * args.seq / seconds:.1f}"
              f"{extra}", flush=True)
    if evaluated is not None:
        print(f"eval step {step} loss {evaluated:.6f}", flush=True)


def _fp32_outputs(output):
    """The model's floating outputs in fp32 (the bf16 recipe computes the loss in fp32)."""
    if hasattr(output, "logits"):
        output.logits = output.logits.float()
        return output
    return output.float()


def _train_plain(args, model, loss_fn, kwargs, optimizer_factory, rank: int) -> None:
    model.train()
    optimizer = optimizer_factory(model.parameters())
    scheduler = scheduler_factory(args)(optimizer)
    # --bf16: a bf16 working copy runs forward and backward; the fp32 model holds the masters.
    work = copy.deepcopy(model).to(torch.bfloat16) if args.bf16 else model
    run = (lambda ids: _fp32_outputs(work(ids, **kwargs))) if args.bf16 else (lambda ids: model(ids, **kwargs))

    def evaluate() -> float:
        work.eval()
        with torch.no_grad():
            ids, target = eval_batch(args)
            value = loss_fn(run(ids), target).item()
        work.train()
        return value

    for step in range(args.steps):
        start = time.perf_counter()
        ids, target = batch_for_step(args, step)
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        loss = loss_fn(run(ids), target)
        loss.backward()
        if args.bf16:  # the bf16 gradients into the fp32 masters' .grad
            for master, p in zip(model.parameters(), work.parameters()):
                master.grad, p.grad = p.grad.float(), None
        norm = None
        if args.max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        optimizer.step()
        scheduler.step()
        if args.bf16:
            with torch.no_grad():
                for master, p in zip(model.parameters(), work.parameters()):
                    p.copy_(master)
        _report(args, step, rank, loss.item(), norm, lr, time.perf_counter() - start, evaluate)


def _train_autopar(args, model, loss_fn, kwargs, optimizer_factory) -> None:
    import autopar
    import torch.distributed as dist

    autopar.init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    ids, _ = batch_for_step(args, 0)
    pm = autopar.parallelize(
        model,
        example_inputs=(ids,),
        example_kwargs=kwargs,
        plan=args.plan,
        loss_fn=loss_fn,
        optimizer=optimizer_factory,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler=scheduler_factory(args),
        mixed_precision="bf16" if args.bf16 else None,
    )

    def evaluate() -> float:
        return pm.eval_step(eval_batch(args)[:1], eval_batch(args)[1])

    for step in range(args.steps):
        ids, target = batch_for_step(args, step)
        lr = pm.optimizer.param_groups[0]["lr"]
        loss = pm.train_step((ids,), target)
        stats = pm.last_step_stats
        predicted = {k: v for k, v in stats.items() if k.startswith("predicted")}
        _report(args, step, rank, float(loss), pm.last_grad_norm if args.max_grad_norm else None, lr,
                stats["seconds"], evaluate, predicted)
    if args.report and rank == 0:
        print(f"report: {pm.report(args.report, inputs=(ids,))}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="none",
                        help="autopar plan, e.g. 'tp=2,sp,dp=2', 'auto', or 'none' for plain PyTorch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", choices=("example", "moe", "hf"), default="example")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=8, help="global batch size")
    parser.add_argument("--seq", type=int, default=32, help="sequence length")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm")
    parser.add_argument("--warmup", type=int, default=0, help="linear learning-rate warm-up steps")
    parser.add_argument("--cosine", action="store_true", help="cosine decay to 10%% after the warm-up")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate a held-out batch every N steps")
    parser.add_argument("--stats", action="store_true", help="print gradient norm, lr and throughput per step")
    parser.add_argument("--data", choices=("counting", "random"), default="counting",
                        help="counting: rows that count up from a random token, learnable, the loss falls; random: "
                             "uniform random tokens, nothing to learn, the loss stays near ln(vocab) = 4.85")
    parser.add_argument("--report", default=None, metavar="FILE",
                        help="with a plan: after the last step, rank 0 writes the plan's page with the step's "
                             "measurements (pm.report, autopar report's page; needs matplotlib)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 mixed precision (bf16 compute, fp32 masters, gradients and loss)")
    args = parser.parse_args(argv)
    if args.data == "random":
        print(f"note: --data random has nothing to learn: the loss stays near ln({VOCAB}) = {math.log(VOCAB):.2f}, "
              "as expected (the default, --data counting, falls)", file=sys.stderr, flush=True)

    plain = args.plan.strip().lower() != "auto"
    if plain:
        from autopar.plan import Plan

        plain = Plan.parse(args.plan) == Plan()  # a bad plan: one autopar: line (exit_on_error below)
    model, loss_fn, kwargs = build_model(args.model, args.seed, args.seq)
    optimizer_factory = make_optimizer_factory(args.optimizer, args.lr)
    if plain:
        _train_plain(args, model, loss_fn, kwargs, optimizer_factory,
                     rank=int(os.environ.get("RANK", "0")))
    else:
        _train_autopar(args, model, loss_fn, kwargs, optimizer_factory)
    return 0


if __name__ == "__main__":
    from autopar.error_report import exit_on_error  # an autopar: error: one line, once per torchrun job

    sys.exit(exit_on_error(main))
