"""GPU check: one GPU, bf16 training through autopar against eager PyTorch, and the cost model's view of it.

Ready for the first GPU a session is lent (issue 14, item 8); about 3 minutes on one H100 / H200.
It trains a Llama-shaped ``LlamaForCausalLM`` of about 1.1B parameters (hidden 2048, 16
layers, 16 heads, 8 KV heads, FFN 8192, vocab 32000) at sequence 4096, micro-batch 1, with
AdamW, on NCCL at world 1, three ways:

- ``autopar``: ``autopar.parallelize(model, plan="dp=1", mixed_precision="bf16")`` (bf16
  parameters and activations, fp32 masters, main gradients and optimizer state);
- ``eager``: the same model in PyTorch's usual recipe, fp32 parameters under
  ``torch.autocast(dtype=bfloat16)``, AdamW on the fp32 parameters;
- ``compiled``: ``parallelize(..., compile=True)`` when autopar offers that option (else
  reported as not available), against ``torch.compile`` of the eager model.

Method: both sides are built from the same seed and must give the same first loss within
``LOSS_RTOL`` (equal work, else the pair is not timed); after ``--warmup`` steps each,
``--steps`` steps run interleaved A, B, A, B, ... (``torch.cuda.synchronize`` around each),
and the report is the median per-pair ratio autopar/eager (below 1: autopar is faster), each
side's median step, its MFU (the cost model's FLOPs of the step over the measured time and
the GPU's bf16 peak) and its peak memory (``torch.cuda.max_memory_allocated``) next to the
cost model's ``memory_per_gpu`` for the same plan and dtype.

``--dry-run`` runs the same code on the CPU (gloo, a 2-layer hidden-256 model, sequence 128,
2 steps), to check the script itself; its times mean nothing.  Record GPU results in
``docs/performance.md``.

Run: ``python benchmarks/gpu_check.py [--dry-run] [--steps N] [--warmup N] [--seq S] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autopar  # noqa: E402

LOSS_RTOL = 2e-2  # bf16 recipes differ in where they round (bf16 parameters vs autocast)
FULL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=8192, vocab_size=32000)
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=768, vocab_size=2048)


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def _model(shape: dict, seq: int, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(cfg)


def _init(device_type: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1)


class _Eager:
    """PyTorch's usual bf16 recipe: fp32 parameters, autocast, AdamW (optionally torch.compile)."""

    def __init__(self, model, device, compiled: bool):
        self.model = model.to(device)
        self.forward = torch.compile(self.model) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.device = device

    def step(self, ids) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = _loss(self.forward(input_ids=ids), ids)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class _Autopar:
    def __init__(self, model, ids, compiled: bool):
        options = {"compile": True} if compiled else {}
        self.pm = autopar.parallelize(model, (ids,), {"use_cache": False}, plan="dp=1", loss_fn=_loss,
                                      optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                                      mixed_precision="bf16", **options)

    def step(self, ids) -> float:
        return self.pm.train_step((ids,), ids)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(side, ids, device) -> float:
    _sync(device)
    start = time.perf_counter()
    side.step(ids)
    _sync(device)
    return time.perf_counter() - start


def _peak(device, run) -> tuple[float, int]:
    """(seconds, peak bytes) of ``run()`` on a fresh peak counter (0 bytes on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = run()
    return seconds, (torch.cuda.max_memory_allocated() if device.type == "cuda" else 0)


def _pair(name: str, make_a, make_b, ids, args, device, flops: float, peak_flops: float) -> dict:
    """Build both sides, check equal work, warm up, time interleaved; the pair's report."""
    a = make_a()
    loss_a = a.step(ids)
    b = make_b()
    loss_b = b.step(ids)
    if abs(loss_a - loss_b) > LOSS_RTOL * abs(loss_b):
        return {"pair": name, "equal": False, "loss_autopar": loss_a, "loss_torch": loss_b}
    for _ in range(args.warmup):
        a.step(ids)
        b.step(ids)
    times_a, times_b, peak_a, peak_b = [], [], 0, 0
    for i in range(args.steps):
        sa, pa = _peak(device, lambda: _timed(a, ids, device))
        sb, pb = _peak(device, lambda: _timed(b, ids, device))
        times_a.append(sa)
        times_b.append(sb)
        peak_a, peak_b = max(peak_a, pa), max(peak_b, pb)
        print(f"  {name}: step {i + 1}/{args.steps}: autopar {sa:.3f} s, torch {sb:.3f} s", flush=True)
    ratios = [x / y for x, y in zip(times_a, times_b)]
    med_a, med_b = statistics.median(times_a), statistics.median(times_b)
    return {"pair": name, "equal": True, "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "autopar_s": med_a, "torch_s": med_b,
            "mfu_autopar": flops / med_a / peak_flops if peak_flops else None,
            "mfu_torch": flops / med_b / peak_flops if peak_flops else None,
            "peak_autopar_bytes": peak_a, "peak_torch_bytes": peak_b}


def _predicted(model, seq: int, device) -> tuple[autopar.Cost | None, float]:
    """The cost model's view of ``dp=1`` on this GPU (None on the CPU) and the GPU's bf16 peak FLOP/s."""
    if device.type != "cuda":
        return None, 0.0
    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in ("h200", "h100", "a100") if g in name), "h100")
    cluster = autopar.Cluster(gpu=gpu, num_nodes=1, gpus_per_node=1)
    ids = torch.zeros(1, seq, dtype=torch.long)
    spec = autopar.ModelSpec.from_module(model, (ids,), {"use_cache": False})
    cost = autopar.estimate(spec, cluster, "dp=1", seq_len=seq, global_batch=1, dtype_bytes=2)
    return cost, float(cluster.peak_flops)


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cpu" and not args.dry_run:
        raise SystemExit("gpu_check: no GPU here; run with --dry-run to check the script on the CPU")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    shape, seq = (TINY, min(args.seq, 128)) if args.dry_run else (FULL, args.seq)
    _init(device.type)
    try:
        base = _model(shape, seq)
        params = sum(p.numel() for p in base.parameters())
        ids = torch.randint(0, shape["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
        cost, peak_flops = _predicted(base, seq, device)
        flops = cost.mfu * cost.step_time * peak_flops if cost is not None and peak_flops else 0.0
        print(f"gpu_check: {params / 1e6:,.0f}M parameters, seq {seq}, on {device.type}"
              f"{' (dry run: the times mean nothing)' if args.dry_run else ''}", flush=True)
        pairs = [_pair("eager", lambda: _Autopar(copy.deepcopy(base), ids, False),
                       lambda: _Eager(copy.deepcopy(base), device, False), ids, args, device, flops, peak_flops)]
        if "compile" in inspect.signature(autopar.parallelize).parameters and not args.dry_run:
            pairs.append(_pair("compiled", lambda: _Autopar(copy.deepcopy(base), ids, True),
                               lambda: _Eager(copy.deepcopy(base), device, True), ids, args, device, flops,
                               peak_flops))
        else:
            pairs.append({"pair": "compiled", "not_run": "parallelize(compile=True) is not available yet"
                          if "compile" not in inspect.signature(autopar.parallelize).parameters else "dry run"})
        return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "params": params,
                "seq": seq, "predicted_step_s": cost.step_time if cost else None,
                "predicted_mfu": cost.mfu if cost else None,
                "predicted_memory_bytes": cost.memory_per_gpu if cost else None, "pairs": pairs}
    finally:
        dist.destroy_process_group()


def report(result: dict) -> list[str]:
    lines = [f"device {result['device']}, {result['params'] / 1e6:,.0f}M parameters, seq {result['seq']}"]
    if result["predicted_step_s"] is not None:
        lines.append(f"cost model (dp=1, bf16): step {result['predicted_step_s']:.3f} s, MFU "
                     f"{result['predicted_mfu']:.1%}, memory {result['predicted_memory_bytes'] / 2**30:.1f} GiB")
    for p in result["pairs"]:
        if "not_run" in p:
            lines.append(f"{p['pair']:>9}: not run: {p['not_run']}")
        elif not p["equal"]:
            lines.append(f"{p['pair']:>9}: unequal work (first loss {p['loss_autopar']:.5f} vs {p['loss_torch']:.5f})")
        else:
            mfu = (f", MFU {p['mfu_autopar']:.1%} vs {p['mfu_torch']:.1%}" if p["mfu_autopar"] is not None else "")
            peak = (f", peak {p['peak_autopar_bytes'] / 2**30:.1f} vs {p['peak_torch_bytes'] / 2**30:.1f} GiB"
                    if p["peak_autopar_bytes"] else "")
            lines.append(f"{p['pair']:>9}: autopar/torch {p['ratio']:.3f} (min {p['ratio_min']:.3f}, max "
                         f"{p['ratio_max']:.3f}); {p['autopar_s']:.3f} s vs {p['torch_s']:.3f} s{mfu}{peak}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="check the script on the CPU (tiny model)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per side (default 10; dry run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per side (default 3; dry run 1)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.dry_run else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    result = run(args)
    for line in report(result):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(p.get("equal", True) for p in result["pairs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
