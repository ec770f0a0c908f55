"""Benchmark: autopar's generated programs against PyTorch's own parallelisms, pair by pair.

Each pair trains the same Hugging Face ``LlamaForCausalLM`` (``tests/support/models.py``
``hf_llama``, a tiny config: hidden 256, 4 layers, 8 heads, 4 KV heads, FFN 768,
vocab 2048) from the same seed, on the same batches, with the same ``AdamW`` factory:

- ``tp``: ``tp=4,sp`` against ``parallelize_module`` (Colwise / Rowwise / SequenceParallel,
  PrepareModuleInput) with ``loss_parallel()``;
- ``dp``: ``dp=2`` against ``DistributedDataParallel``;
- ``zero3``: ``dp=2,zero=3`` against FSDP2 (``fully_shard`` on each decoder layer and the root);
- ``pp``: ``pp=2:1f1b,mb=4`` against ``torch.distributed.pipelining``: a hand-written
  ``PipelineStage`` of each half, ``Schedule1F1B``, 4 micro-batches (autopar is given the same split);
- ``cp``: ``cp=2:allgather`` against ``context_parallel()`` (its default all-gather rotation,
  causal load balancing), with DDP averaging the gradients;
- ``compile``: ``dp=2`` with ``parallelize(..., compile=True)`` against
  ``torch.compile(DistributedDataParallel(model))``: both through Inductor;
- ``zero1``: ``dp=2,zero=1`` against DDP with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1);
- ``fused``: ``dp=2`` (autopar's flat parameters stepped by the fused AdamW) against DDP with
  ``AdamW(fused=True)``;
- ``pp_compile``: ``pp=2:1f1b,mb=4`` with ``compile=True`` against the ``pp`` pair's torch side
  with each decoder layer ``torch.compile``'d (torchtitan's way of compiling pipeline stages).

The ranks are spawned once per world size (4 for ``tp``, 2 for the others) and every pair
of that size runs inside the one process group, one pair after the other.  For each
pair:

1. both sides are built from the same seed;
2. **equal work**: the first two steps (the forward, then the first update) must give
   the same global mean loss on both sides within ``LOSS_RTOL`` relative; otherwise the
   pair is reported as unequal and not timed;
3. warm-up (``--warmup`` steps of each side);
4. ``--steps`` timed samples interleaved A, B, A, B, ...; every sample starts after a
   barrier, runs one step (``zero1``: three consecutive steps, so that ZeRO-1's after-step
   all-gathers overlap the next forward as in training) and ends when the side's work in
   flight is done; its time per step is the slowest rank's (an all-reduce MAX at the end);
5. the report is the median of the per-pair ratios autopar/torch (below 1: autopar is
   faster), with their min and max and each side's median step.

A pair whose PyTorch side cannot run here (``context_parallel`` needs a flash, efficient
or cuDNN SDPA kernel, which CPUs lack) is reported as ``not run: <reason>``.  With CUDA
and at least as many GPUs as ranks the pairs run on NCCL, else on CPU with gloo.

Run: ``python benchmarks/runtime_vs_torch.py [--pairs tp,dp,zero3,pp,cp,compile,zero1,fused,pp_compile] [--steps N]
[--warmup N] [--json PATH]``.  Results and their discussion: ``docs/performance.md``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from autopar.verification.launch import run_spawned  # noqa: E402

_RUN_TIMEOUT_S = 24 * 3600.0  # one world size's plans, all of them (each step has its own gloo timeout)
from benchmarks.torch_baselines import MODEL_SIZE, TORCH_BUILDERS, _first_error, _loss, _model  # noqa: E402

__all__ = ["BenchConfig", "PAIRS", "MODEL_SIZE", "run_benchmark", "main"]

# Relative loss agreement required between the two sides before anything is timed (fp32).
LOSS_RTOL = 1e-4


@dataclass(frozen=True)
class Pair:
    """One comparison: an autopar plan against PyTorch's own implementation of it."""

    name: str
    world: int
    plan: str
    torch_side: str
    # pp: give autopar the torch side's split (half of the layers per stage) instead of its
    # cost-model balance, so that both pipelines hold the same layers.
    pipeline_halves: bool = False
    # both sides through torch.compile (autopar: parallelize(..., compile=True))
    compiled: bool = False
    # Consecutive steps of one side per timed sample: ZeRO-1/2's after-step all-gathers run on
    # into the next step's forward, as in training; a barrier after every step would hide them
    # in the untimed gap, so a sample runs ``chain`` steps and then waits for what is in flight.
    chain: int = 1


PAIRS = {p.name: p for p in (
    Pair("tp", 4, "tp=4,sp", "parallelize_module (ColwiseParallel, RowwiseParallel, SequenceParallel, "
                             "PrepareModuleInput) + loss_parallel()"),
    Pair("dp", 2, "dp=2", "DistributedDataParallel"),
    Pair("zero3", 2, "dp=2,zero=3", "FSDP2 fully_shard (each decoder layer + root)"),
    Pair("pp", 2, "pp=2:1f1b,mb=4", "torch.distributed.pipelining PipelineStage per half + Schedule1F1B",
         pipeline_halves=True),
    Pair("cp", 2, "cp=2:allgather", "context_parallel() (all-gather rotation, load-balanced) + DDP"),
    Pair("compile", 2, "dp=2", "torch.compile(DistributedDataParallel(model)) (Inductor, DDPOptimizer)",
         compiled=True),
    Pair("zero1", 2, "dp=2,zero=1", "DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)", chain=3),
    Pair("fused", 2, "dp=2", "DistributedDataParallel + AdamW(fused=True)"),
    Pair("pp_compile", 2, "pp=2:1f1b,mb=4", "torch.distributed.pipelining, each decoder layer torch.compile'd "
                                             "(Inductor) + Schedule1F1B", pipeline_halves=True, compiled=True),
)}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What one benchmark run measures."""

    pairs: tuple[str, ...] = tuple(PAIRS)
    steps: int = 10
    warmup: int = 2
    batch: int = 4
    seq: int = 128
    threads_per_rank: int = 1
    seed: int = 0
    layers: int = MODEL_SIZE["num_hidden_layers"]  # an even number: pp cuts the layers in two
    device: str = "auto"  # auto: CUDA + NCCL when there are enough GPUs, else CPU + gloo
    # Enough for a 4-rank compile on 2 shared cores; a hung collective fails instead of waiting 30 minutes.
    timeout_s: int = 600
    # tp pair, torch side only: all-reduce the norm weights' Partial gradients once before the step.
    replicate_partial_grads: bool = False

    def __post_init__(self):
        unknown = [p for p in self.pairs if p not in PAIRS]
        if unknown or not self.pairs:
            raise ValueError(f"BenchConfig: unknown pairs {unknown}; choose from {', '.join(PAIRS)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"BenchConfig: need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.layers < 2 or self.layers % 2:
            raise ValueError(f"BenchConfig: layers {self.layers} must be even and at least 2 (pp=2 halves them)")
        if self.seq % 4 or self.batch % 4:
            raise ValueError(f"BenchConfig: batch {self.batch} and seq {self.seq} must be multiples of 4 "
                             "(tp=4 shards the sequence, pp takes 4 micro-batches, cp 2 x 2 chunks)")


# --- one pair --------------------------------------------------------------------------------------


def _say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"[runtime_vs_torch] {msg}", file=sys.stderr, flush=True)


def _agree(ok: bool) -> bool:
    """True when every rank reports ok (a side that fails on one rank is skipped on all)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64,
                        device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag) == 0


def _not_run(result: dict, error: BaseException | None) -> dict:
    reason = _first_error(error) if error is not None else "failed on another rank"
    result["status"] = f"not run: torch side failed: {reason}"
    _say(f"{result['pair']}: {result['status']}")
    return result


def _equal_work(result: dict, sides: dict, batches: list) -> BaseException | None:
    """Equal work: the same global mean loss on the same batches (step 0: the forward; step 1:
    after one update, so the backward and the optimizer step too).  Records the check in
    ``result`` (with a ``status`` when the losses differ); returns the torch side's error, if any."""
    check, error = [], None
    for i in range(2):
        ids, target = batches[i % len(batches)]
        a, t = sides["autopar"](ids, target), float("nan")
        try:
            t = sides["torch"](ids, target)
        except Exception as exc:  # noqa: BLE001
            error = exc
        check.append({"autopar": a, "torch": t, "rel_diff": abs(a - t) / max(abs(a), 1e-12)})
        if not _agree(error is None):
            return error if error is not None else RuntimeError("failed on another rank")
    result["equal_work"] = {"losses": check, "rtol": LOSS_RTOL,
                            "max_rel_diff": max(c["rel_diff"] for c in check)}
    if not result["equal_work"]["max_rel_diff"] <= LOSS_RTOL:
        diff = result["equal_work"]["max_rel_diff"]
        result["status"] = f"not timed: unequal work (first losses differ by {diff:.2e} relative > {LOSS_RTOL})"
        _say(f"{result['pair']}: {result['status']}: {check}")
    return None


def _timed_steps(sides: dict, cfg: BenchConfig, batches: list, device: torch.device, chain: int = 1,
                 drain=None) -> dict:
    """Warm-up, then interleaved timed samples of each side, each ``chain`` consecutive steps after a
    barrier, ending when ``drain[name]()`` (what the side left in flight) returns; a sample's time
    per step is its slowest rank's."""
    times = {"autopar": [], "torch": []}
    for i in range(2, 2 + cfg.warmup + cfg.steps):
        for name, step in sides.items():
            dist.barrier()
            start = time.perf_counter()
            for k in range(chain):
                ids, target = batches[(i * chain + k) % len(batches)]
                step(ids, target)
            if drain is not None and name in drain:
                drain[name]()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2 + cfg.warmup:
                times[name].append((time.perf_counter() - start) / chain)
    slowest = {}
    for name, ts in times.items():  # a step lasts as long as its slowest rank
        t = torch.tensor(ts, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        slowest[name] = t.tolist()
    return slowest


def _run_pair(pair: Pair, cfg: BenchConfig, batches: list, device: torch.device) -> dict:
    import autopar

    result = {"pair": pair.name, "plan": pair.plan, "torch": pair.torch_side, "world": pair.world,
              "backend": dist.get_backend()}
    make_opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    base = _model(cfg)
    torch_model = copy.deepcopy(base).to(device)  # the same weights (parallelize leaves base untouched)
    ids0 = batches[0][0]
    with torch.no_grad():  # the unparallelized model's first loss, a third witness
        result["reference_first_loss"] = float(_loss(base.to(device)(ids0, use_cache=False), batches[0][1]))
    base.cpu()

    _say(f"{pair.name}: building torch side: {pair.torch_side} ...")
    error = None
    try:
        torch_step = TORCH_BUILDERS[pair.name](torch_model, make_opt, cfg, device)
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the other pairs still run
        error = exc
    if not _agree(error is None):
        return _not_run(result, error)

    _say(f"{pair.name}: compiling autopar plan {pair.plan} ...")
    t0 = time.perf_counter()
    pm = autopar.parallelize(base, example_inputs=(ids0.cpu(),), example_kwargs={"use_cache": False},
                             plan=pair.plan, loss_fn=_loss, optimizer=make_opt,
                             pipeline_split=(cfg.layers // 2,) * 2 if pair.pipeline_halves else None,
                             compile=pair.compiled)
    result["autopar_compile_s"] = round(time.perf_counter() - t0, 2)
    sides = {"autopar": lambda ids, target: pm.train_step((ids,), target), "torch": torch_step}

    error = _equal_work(result, sides, batches)
    if error is not None or "status" in result:
        return result if error is None else _not_run(result, error)
    _say(f"{pair.name}: equal work ok (max relative loss diff {result['equal_work']['max_rel_diff']:.1e}); "
         f"{cfg.warmup} warm-up + {cfg.steps} interleaved timed steps of each side ...")
    load_before = os.getloadavg()[0]
    # ZeRO-1/2 leave the after-step all-gathers in flight: each sample waits for them at its end
    drain = {"autopar": getattr(pm.grad_sync, "await_parameters", lambda: None)}
    slowest = _timed_steps(sides, cfg, batches, device, pair.chain, drain)
    ratios = [a / t for a, t in zip(slowest["autopar"], slowest["torch"])]
    result.update({
        "status": "ok",
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "autopar_median_s": statistics.median(slowest["autopar"]),
        "torch_median_s": statistics.median(slowest["torch"]),
        "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        "step_s": slowest,
    })
    _say(f"{pair.name}: ratio autopar/torch {result['ratio_median']:.3f} "
         f"(autopar {result['autopar_median_s'] * 1e3:.1f} ms, torch {result['torch_median_s'] * 1e3:.1f} ms)")
    return result


# --- the ranks of one world size -------------------------------------------------------------------


def _device_for(world: int, choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"
    return choice


def _worker(rank: int, world: int, port: int, cfg: BenchConfig, names: list[str], *, post) -> list[dict]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(cfg.threads_per_rank)
    # autopar's collectives call all_gather_into_tensor / reduce_scatter_tensor, deprecated in torch 2.13.
    warnings.filterwarnings("ignore", message="`torch.distributed.* is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)  # DTensor / pipelining / FSDP chatter
    kind = _device_for(world, cfg.device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if kind == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    from benchmarks.models import make_batch

    batches = [tuple(t.to(device) for t in make_batch(MODEL_SIZE["vocab_size"], cfg.batch, cfg.seq, cfg.seed + i))
               for i in range(4)]
    results = []
    for name in names:
        _say(f"world {world} ({dist.get_backend()}): pair {name} "
             f"({names.index(name) + 1}/{len(names)} of this world size)")
        results.append(_run_pair(PAIRS[name], cfg, batches, device))
        gc.collect()
        dist.barrier()
    return results




def run_benchmark(cfg: BenchConfig) -> dict:
    """Spawn the ranks once per world size, run the selected pairs and return the report."""
    started = time.perf_counter()
    by_world: dict[int, list[str]] = {}
    for name in PAIRS:  # the table's order, whatever order --pairs gave
        if name in cfg.pairs:
            by_world.setdefault(PAIRS[name].world, []).append(name)
    results = []
    for world, names in sorted(by_world.items(), reverse=True):
        results += run_spawned(_worker, world, (cfg, names), what=f"timing {len(names)} pairs",
                               timeout=_RUN_TIMEOUT_S)[0]
    order = list(PAIRS)
    results.sort(key=lambda r: order.index(r["pair"]))
    return {
        "config": {**asdict(cfg), "model": {"class": "transformers.LlamaForCausalLM", **MODEL_SIZE,
                                            "num_hidden_layers": cfg.layers, "max_position_embeddings": cfg.seq}},
        "machine": {"cpu_count": os.cpu_count(), "torch_version": torch.__version__,
                    "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0},
        "wall_s": round(time.perf_counter() - started, 1),
        "pairs": results,
    }


def _table(report: dict) -> str:
    c, m = report["config"], report["machine"]
    lines = [
        f"autopar vs PyTorch: HF Llama hidden {c['model']['hidden_size']}, {c['model']['num_hidden_layers']} layers, "
        f"batch {c['batch']} x seq {c['seq']}, AdamW; {c['warmup']} warm-up + {c['steps']} interleaved steps; "
        f"{m['cpu_count']} CPU cores, {c['threads_per_rank']} thread/rank, torch {m['torch_version']}; "
        f"{report['wall_s']} s in all",
        "",
        f"{'pair':<6} {'plan':<16} {'world':>5} {'backend':>7} {'autopar ms':>11} {'torch ms':>9} "
        f"{'ratio':>6} {'range':>12} {'loss rel diff':>14}",
    ]
    for r in report["pairs"]:
        diff = r.get("equal_work", {}).get("max_rel_diff", float("nan"))
        head = f"{r['pair']:<6} {r['plan']:<16} {r['world']:>5} {r['backend']:>7} "
        if r["status"] != "ok":
            lines.append(head + f"{r['status']}")
            continue
        lines.append(head + f"{r['autopar_median_s'] * 1e3:>11.1f} {r['torch_median_s'] * 1e3:>9.1f} "
                            f"{r['ratio_median']:>6.3f} {r['ratio_min']:>5.2f}-{r['ratio_max']:<6.2f} {diff:>14.1e}")
    lines.append("")
    lines.append("ratio: median over the interleaved steps of autopar/torch (below 1: autopar faster)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default=",".join(PAIRS),
                        help=f"comma-separated pairs to run (default: all of {','.join(PAIRS)})")
    parser.add_argument("--steps", type=int, default=BenchConfig.steps, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup, help="untimed steps per side")
    parser.add_argument("--batch", type=int, default=BenchConfig.batch, help="global batch size")
    parser.add_argument("--seq", type=int, default=BenchConfig.seq, help="sequence length (a multiple of 4)")
    parser.add_argument("--layers", type=int, default=BenchConfig.layers, help="decoder layers (even)")
    parser.add_argument("--threads", type=int, default=BenchConfig.threads_per_rank,
                        help="torch intra-op threads per rank")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=BenchConfig.device,
                        help="auto: CUDA + NCCL when there are as many GPUs as ranks, else CPU + gloo")
    parser.add_argument("--torch-replicate-grads", action="store_true",
                        help="tp pair, torch side: all-reduce the Partial (norm weight) gradients once before the "
                             "optimizer step instead of letting AdamW's ops do it lazily")
    parser.add_argument("--timeout", type=int, default=BenchConfig.timeout_s,
                        help="seconds a collective may wait before the run fails (the process groups' timeout)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    args = parser.parse_args(argv)
    try:
        cfg = BenchConfig(pairs=tuple(p.strip() for p in args.pairs.split(",") if p.strip()), steps=args.steps,
                          warmup=args.warmup, batch=args.batch, seq=args.seq, layers=args.layers,
                          threads_per_rank=args.threads, device=args.device, timeout_s=args.timeout,
                          replicate_partial_grads=args.torch_replicate_grads)
    except ValueError as exc:
        parser.error(str(exc))
    report = run_benchmark(cfg)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(_table(report))
    return report


if __name__ == "__main__":
    main()
