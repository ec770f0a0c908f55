"""Benchmark: autopar's tensor + sequence parallel program against PyTorch's own TP.

Both sides train the same example decoder (``examples/model.py``) from the same
weights, on the same batches, on 4 gloo ranks of this machine:

- **autopar**: ``autopar.parallelize(model, ..., plan="tp=4,sp")`` — the traced graph
  rewritten by ``passes/tensor_parallel.py`` and ``passes/sequence_parallel.py``, with
  the collectives of ``autopar/collectives.py``.
- **torch**: ``torch.distributed.tensor.parallel.parallelize_module`` with
  ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
  ``PrepareModuleInput`` in the layout of Megatron-style TP+SP (DTensor).

The work is the same on both sides: a vocabulary-parallel embedding whose output is
reduce-scattered to sequence shards, norms and residuals on sequence shards,
all-gather before each column-parallel region and reduce-scatter after each
row-parallel projection, a column-parallel LM head over the vocabulary, and the
cross-entropy computed on vocabulary-sharded logits (autopar's
``vocab_parallel_cross_entropy``; torch's ``loss_parallel()`` context).  The torch
side is given the one model edit PyTorch's TP needs: each attention module's head
counts divided by tp, because its ``view`` calls use them.  Both use the same
``torch.optim.AdamW`` factory.  ``--torch-replicate-grads`` gives the torch side one
more help: the norm weights' Partial gradients are all-reduced once before the
optimizer step (otherwise DTensor all-reduces each inside AdamW, once per op that
reads it).  Before timing, the first two steps' losses of the two sides are compared
(the first checks the forward, the second the backward and the optimizer step).

Steps are interleaved (autopar, torch, autopar, ...) after warm-up; every step starts
after a barrier, and a step's time is the slowest rank's.  The report gives each
side's median step time and the median of the per-pair ratios autopar/torch.

Run: ``python benchmarks/runtime_vs_torch_tp.py [--steps N] [--warmup N] [--json]
[--torch-replicate-grads]``.
Results and their discussion: ``docs/performance.md``.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

__all__ = ["BenchConfig", "MODEL_SIZE", "torch_tp_plan", "build_torch_tp", "run_benchmark", "main"]

WORLD_SIZE = 4
PLAN = "tp=4,sp"
# Sizes chosen so that each rank's matmuls are non-trivial on a CPU core (512 tokens of the
# default 4 x 128 batch against [256 x 32..192] weight shards) while a step stays under a second.
MODEL_SIZE = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                  intermediate_size=768)
# Loss agreement required between the two sides before anything is timed (fp32).
LOSS_TOLERANCE = 1e-4


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one benchmark run measures."""

    steps: int = 20
    warmup: int = 3
    batch: int = 4
    seq: int = 128
    threads_per_rank: int = 1
    seed: int = 0
    # Torch side only: all-reduce Partial gradients once before the optimizer step.
    replicate_partial_grads: bool = False

    def __post_init__(self):
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"BenchConfig: need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.seq % WORLD_SIZE:
            raise ValueError(f"BenchConfig: seq {self.seq} must be divisible by tp={WORLD_SIZE}")


def _example_module():
    from tests.models import example_module

    return example_module()


def torch_tp_plan(model) -> dict:
    """PyTorch's parallelize_module plan for ``Decoder``: Megatron TP + SP, vocab-parallel head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {
        # Vocabulary-parallel lookup; the partial sum is reduce-scattered to sequence shards.
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Logits stay sharded over the vocabulary for loss_parallel().
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update({
            p + "input_norm": SequenceParallel(),
            # forward(x, cos, sin): gather x's sequence shards; cos/sin are plain tensors.
            p + "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                           desired_input_layouts=(Replicate(), None, None)),
            p + "attn.q_proj": ColwiseParallel(),
            p + "attn.k_proj": ColwiseParallel(),
            p + "attn.v_proj": ColwiseParallel(),
            p + "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attn_norm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def build_torch_tp(model, tp_mesh):
    """Parallelize ``model`` in place with PyTorch TP on the 1-D ``tp_mesh``; returns it."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    for layer in model.layers:
        # The attention forward views q/k/v with its head counts; PyTorch TP leaves local
        # tensors with 1/tp of the heads, so the counts must be the local ones.
        layer.attn.num_heads //= tp
        layer.attn.num_kv_heads //= tp
    return parallelize_module(model, tp_mesh, torch_tp_plan(model))


def _torch_step(model, optimizer, ids, target, loss_fn, replicate_partial_grads: bool = False) -> float:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = loss_fn(model(ids), target)
        loss.backward()
    if replicate_partial_grads:
        # The norm weights' gradients come out of SP as Partial DTensors; left alone, the
        # optimizer all-reduces each of them once per op that reads it (3 times in AdamW).
        for p in model.parameters():
            if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = loss.detach()
    return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)


def _worker(rank: int, port: int, cfg: BenchConfig, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
    torch.set_num_threads(cfg.threads_per_rank)
    # autopar's collectives call all_gather_into_tensor / reduce_scatter_tensor, deprecated in torch 2.13.
    warnings.filterwarnings("ignore", message="`torch.distributed.* is deprecated", category=FutureWarning)
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    autopar.init_distributed("gloo")
    em = _example_module()
    make_opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    torch.manual_seed(cfg.seed)
    config = em.DecoderConfig(**MODEL_SIZE)
    base = em.Decoder(config)
    num_params = sum(p.numel() for p in base.parameters())
    torch_model = em.Decoder(config)
    torch_model.load_state_dict(base.state_dict())
    batches = [em.make_batch(config.vocab_size, cfg.batch, cfg.seq, seed=cfg.seed + i) for i in range(4)]
    with torch.no_grad():  # the unparallelized model's first loss, as a third witness
        reference_loss = float(em.lm_loss(base(batches[0][0]), batches[0][1]))

    t0 = time.perf_counter()
    pm = autopar.parallelize(base, example_inputs=(batches[0][0],), example_kwargs={}, plan=PLAN,
                             loss_fn=em.lm_loss, optimizer=make_opt)
    compile_s = time.perf_counter() - t0
    mesh = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("tp",))
    build_torch_tp(torch_model, mesh)
    torch_opt = make_opt(torch_model.parameters())

    def autopar_step(i: int) -> float:
        ids, target = batches[i % len(batches)]
        return pm.train_step((ids,), target)

    def torch_step(i: int) -> float:
        ids, target = batches[i % len(batches)]
        return _torch_step(torch_model, torch_opt, ids, target, em.lm_loss, cfg.replicate_partial_grads)

    # Equal work: the same losses on the same batches (step 0: forward; step 1: after one update).
    check = [(autopar_step(i), torch_step(i)) for i in range(2)]
    for i, (a, t) in enumerate(check):
        if abs(a - t) > LOSS_TOLERANCE:
            raise RuntimeError(f"loss mismatch at step {i}: autopar {a!r} vs torch {t!r} "
                               f"(tolerance {LOSS_TOLERANCE}); the two programs do not do the same work")

    times = {"autopar": [], "torch": []}
    load_before = os.getloadavg()[0]
    for i in range(2, 2 + cfg.warmup + cfg.steps):
        for name, step in (("autopar", autopar_step), ("torch", torch_step)):
            dist.barrier()
            start = time.perf_counter()
            step(i)
            elapsed = time.perf_counter() - start
            if i >= 2 + cfg.warmup:
                times[name].append(elapsed)
    # A step lasts as long as its slowest rank.
    slowest = {}
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
    if rank == 0:
        ratios = [a / t for a, t in zip(slowest["autopar"], slowest["torch"])]
        result = {
            "plan": PLAN,
            "world_size": WORLD_SIZE,
            "backend": "gloo",
            "model": {**MODEL_SIZE, "num_params": num_params},
            "batch": cfg.batch,
            "seq": cfg.seq,
            "steps": cfg.steps,
            "warmup": cfg.warmup,
            "threads_per_rank": cfg.threads_per_rank,
            "torch_replicate_partial_grads": cfg.replicate_partial_grads,
            "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
            "cpu_count": os.cpu_count(),
            "torch_version": torch.__version__,
            "autopar_compile_s": compile_s,
            "reference_first_loss": reference_loss,
            "check_losses": [{"autopar": a, "torch": t, "abs_diff": abs(a - t)} for a, t in check],
            "median_step_s": {k: statistics.median(v) for k, v in slowest.items()},
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios),
            "max_ratio": max(ratios),
            "step_s": slowest,
        }
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_benchmark(cfg: BenchConfig) -> dict:
    """Spawn the 4 gloo ranks, run the benchmark and return rank 0's result dict."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(_free_port(), cfg, out_path), nprocs=WORLD_SIZE)
        return json.loads(Path(out_path).read_text())


def _table(r: dict) -> str:
    m = r["model"]
    lines = [
        f"autopar vs PyTorch TP: plan {r['plan']} on {r['world_size']} {r['backend']} ranks "
        f"({r['cpu_count']} CPU cores, {r['threads_per_rank']} thread/rank, torch {r['torch_version']})",
        f"model: Decoder hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']} heads, "
        f"{m['num_kv_heads']} KV heads, ffn {m['intermediate_size']}, vocab {m['vocab_size']} "
        f"({m['num_params'] / 1e6:.2f}M params); batch {r['batch']} x seq {r['seq']}",
        "equal work: first-step losses autopar {a:.6f} / torch {t:.6f} (|diff| {d:.1e}; unparallelized "
        "{ref:.6f}), second-step |diff| {d2:.1e}".format(
            a=r["check_losses"][0]["autopar"], t=r["check_losses"][0]["torch"], ref=r["reference_first_loss"],
                                             d=r["check_losses"][0]["abs_diff"],
                                             d2=r["check_losses"][1]["abs_diff"]),
        f"{r['steps']} interleaved steps after {r['warmup']} warm-up steps (slowest rank per step); "
        f"torch grads replicated before step: {r['torch_replicate_partial_grads']}; "
        "load average {:.1f} -> {:.1f}".format(*r["load_average_1min_before_after"]),
        "",
        f"{'':<24}{'median step (ms)':>18}",
        f"{'autopar':<24}{r['median_step_s']['autopar'] * 1e3:>18.1f}",
        f"{'torch parallelize_module':<24}{r['median_step_s']['torch'] * 1e3:>18.1f}",
        f"{'ratio autopar/torch':<24}{r['median_ratio']:>18.3f}"
        f"   (median of per-pair ratios; range {r['min_ratio']:.3f}-{r['max_ratio']:.3f})",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=BenchConfig.steps, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed steps per side")
    parser.add_argument("--batch", type=int, default=BenchConfig.batch, help="global batch size")
    parser.add_argument("--seq", type=int, default=BenchConfig.seq, help="sequence length (divisible by 4)")
    parser.add_argument("--threads", type=int, default=BenchConfig.threads_per_rank,
                        help="torch intra-op threads per rank")
    parser.add_argument("--torch-replicate-grads", action="store_true",
                        help="torch side: all-reduce Partial (norm weight) gradients once before the "
                             "optimizer step instead of letting AdamW's ops do it lazily")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = parser.parse_args(argv)
    cfg = BenchConfig(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq,
                      threads_per_rank=args.threads, replicate_partial_grads=args.torch_replicate_grads)
    result = run_benchmark(cfg)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return result


if __name__ == "__main__":
    main()
