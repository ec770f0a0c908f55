"""Train a small Llama-style model with autopar, or with plain PyTorch for comparison.

    torchrun --nproc-per-node 4 examples/train_llama.py --plan tp=2,sp,dp=2 --steps 5
    python examples/train_llama.py --plan none --steps 5

Every rank builds the same model from ``--seed`` and draws the same global batch at
each step (from the seed and the step number). With a plan, ``autopar.parallelize``
shards the model and ``train_step`` takes the global batch, slicing what each rank
needs; with ``--plan none`` the same model, optimizer and batches are trained by
plain PyTorch on the CPU, without autopar. Both print ``step {i} loss {loss}`` on
rank 0, so the two runs can be compared line by line.

The model is the example decoder in ``examples/model.py`` (``--model example``) or a
tiny Hugging Face ``LlamaForCausalLM`` built from a config (``--model hf``, needs
``transformers``; nothing is downloaded).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

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


def batch_for_step(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    return make_batch(VOCAB, args.batch, args.seq, seed=args.seed * 1_000_003 + step)


def _train_plain(args, model, loss_fn, kwargs, optimizer_factory, rank: int) -> None:
    model.train()
    optimizer = optimizer_factory(model.parameters())
    for step in range(args.steps):
        ids, target = batch_for_step(args, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(ids, **kwargs), target)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


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
    )
    for step in range(args.steps):
        ids, target = batch_for_step(args, step)
        loss = pm.train_step((ids,), target)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
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
    args = parser.parse_args(argv)

    plain = args.plan.strip().lower() != "auto"
    if plain:
        from autopar.plan import Plan

        try:
            plain = Plan.parse(args.plan) == Plan()
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    model, loss_fn, kwargs = build_model(args.model, args.seed, args.seq)
    optimizer_factory = make_optimizer_factory(args.optimizer, args.lr)
    if plain:
        _train_plain(args, model, loss_fn, kwargs, optimizer_factory,
                     rank=int(os.environ.get("RANK", "0")))
    else:
        _train_autopar(args, model, loss_fn, kwargs, optimizer_factory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
