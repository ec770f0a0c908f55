"""``autopar calibrate``: measure this machine and write a hardware profile (cost/profile.py).

    autopar calibrate --out profile.json [--device cpu|cuda] [--world N] [--quick]

It times, on this machine:

* matrix products of shapes a transformer layer runs (square; skinny: many tokens against a
  hidden size or a tp shard of it), bf16 on CUDA, fp32 on the CPU -> ``peak_flops``, the best
  FLOP/s, with ``gemm_efficiency`` 1 (:func:`autopar.cost.profile.fit_gemm`);
* memory-bound kernels (a copy and an add of large buffers) -> ``hbm_bandwidth``
  (:func:`autopar.cost.profile.fit_memory`);
* the device's memory -> ``hbm_bytes``: ``torch.cuda.get_device_properties``, or on the CPU the
  host's memory divided by the ranks that share it;
* the element-wise kernels of one eager decoder layer (RMSNorms, RoPE, the grouped-query copies, the
  attention output's transpose, residual adds, SwiGLU), forward and backward, without its matrix
  products -> ``elementwise_bandwidth`` (:func:`autopar.cost.profile.fit_elementwise`), and one
  ``torch.optim.AdamW`` step -> ``optimizer_bandwidth`` (:func:`autopar.cost.profile.fit_optimizer`):
  the bandwidths at which the time model's byte counts reproduce them; causal
  ``scaled_dot_product_attention`` over the layer's tokens -> ``attention_factor``, its seconds over
  the time model's price of its FLOPs as a matrix product (:func:`autopar.cost.profile.fit_attention`);
* all-reduce, all-gather and reduce-scatter at several message sizes over every group size 2..world, on
  ``--world`` local processes (NCCL on CUDA, gloo on the CPU) -> ``intra_node_bandwidth`` and
  ``intra_node_latency`` by the time model's alpha-beta formula, least squares
  (:func:`autopar.cost.profile.fit_alpha_beta`), and each collective alone ->
  ``all_reduce_bandwidth``, ``all_gather_bandwidth``, ``reduce_scatter_bandwidth``. One host measures no network: the
  ``inter_node`` figures repeat the ``intra_node`` ones, and the profile's notes say so;
* on the same ranks, an asynchronous all-reduce under matrix products against each alone ->
  ``comm_overlap``, the share of the collective the compute hides (:func:`autopar.cost.profile.fit_overlap`;
  on a CPU gloo's threads need the cores the compute runs on).

On the CPU the compute and memory kernels run with a rank's share of the cores (cores // world
threads) and each collective rank with one thread, as the ranks of a gloo run do; the profile
records ``host_cores`` and ``threads_per_rank``, so that a cluster with more ranks on the host than
that time-shares its cores (:func:`autopar.cost.profile.host_share`). Progress goes
to stderr as it goes; the figures to stdout. ``--quick`` times fewer shapes and sizes, for
shorter (under a minute on a CPU). ``autopar plan --hardware`` / ``autopar explain --hardware``
and ``autopar.Cluster.from_profile`` read the profile (docs/cost-model.md, "Hardware profiles").
"""
from __future__ import annotations

import math
import os
import sys
import time

from autopar.errors import AutoparError

from .calibrate_kernels import (device_memory, measure_attention, measure_elementwise, measure_gemm,
                                measure_memory_bandwidth, measure_optimizer)
from .calibrate_kernels import sync as _device_sync

__all__ = ["register", "run_calibrate", "measure_gemm", "measure_memory_bandwidth", "device_memory",
           "measure_elementwise", "measure_optimizer", "measure_collectives", "SETTINGS", "LAYER", "OPTIMIZER_PARAMS"]

_KIB, _MIB, _GIB = 2**10, 2**20, 2**30
COLLECTIVE_TIMEOUT_S = 600.0
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")  # the ring collectives timed, each at every size

# What each run times: matrix shapes [m, k] @ [k, n], the memory kernels' buffer, collective
# message sizes (bytes of the all-reduce buffer / the all-gather shard), and the seconds each
# measurement may take (split over a warm-up and three timed rounds, the best round kept).
SETTINGS = {
    ("cpu", True): dict(
        gemm=[(512, 512, 512), (1024, 1024, 1024), (2048, 512, 512), (4096, 256, 1024), (256, 1024, 1024)],
        memory_bytes=256 * _MIB, sizes=[4 * _KIB, 64 * _KIB, 1 * _MIB, 8 * _MIB], budget=0.15),
    ("cpu", False): dict(
        gemm=[(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (2048, 512, 512), (4096, 256, 1024),
              (4096, 1024, 1024), (2048, 1024, 4096), (256, 1024, 1024), (128, 2048, 2048)],
        memory_bytes=512 * _MIB, sizes=[_KIB * 4**i for i in range(9)], budget=0.5),
    ("cuda", True): dict(
        gemm=[(4096, 4096, 4096), (8192, 4096, 4096), (8192, 4096, 1024), (1024, 4096, 4096)],
        memory_bytes=1 * _GIB, sizes=[64 * _KIB, 1 * _MIB, 16 * _MIB, 256 * _MIB], budget=0.15),
    ("cuda", False): dict(
        gemm=[(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (16384, 4096, 14336),
              (16384, 14336, 4096), (8192, 8192, 1024), (8192, 1024, 8192), (1024, 4096, 4096),
              (2048, 8192, 8192)],
        memory_bytes=2 * _GIB, sizes=[16 * _KIB * 4**i for i in range(9)], budget=0.4),
}
# The decoder layer whose element-wise kernels measure_elementwise times (tokens on the rank, hidden,
# heads, KV heads, head dim, FFN width), and the parameters of the optimizer step measure_optimizer times.
LAYER = {"cpu": dict(tokens=4096, seq=256, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=1536),
         "cuda": dict(tokens=8192, seq=4096, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336)}
OPTIMIZER_PARAMS = {"cpu": 16 * _MIB, "cuda": 256 * _MIB}
# Operands the matrix products cycle through (calibrate_kernels.measure_gemm): beyond a CPU's
# last-level cache, as in a step; a GPU's products are timed on one pair (its L2 is small beside them).
ROTATE_BYTES = {"cpu": 128 * _MIB}


def register(subparsers) -> None:
    """Add the ``calibrate`` subcommand to the ``autopar`` parser."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure this machine and write a hardware profile for plan/explain --hardware",
        description="Time matrix products, a memory-bound kernel and collectives on this machine and "
                    "write the cost model's hardware figures as a profile (JSON).",
    )
    p.add_argument("--out", required=True, metavar="PROFILE.json", help="where to write the profile")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="what to measure (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--world", type=int, default=None, metavar="N",
                   help="ranks for the collectives (default: every GPU on cuda, 2 on cpu); 1 measures none "
                        "and takes the link figures of the nearest preset")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes, sizes and repeats (under a minute on a CPU)")
    p.set_defaults(func=run_calibrate)


# ---------------------------------------------------------------------- collectives
def _time_collective(torch, dist, collective: str, nbytes: int, group, n: int, device, budget: float):
    """(seconds per call: the slowest member's, calls per round) of one collective in ``group``."""
    elems = max(1, nbytes // 4)
    if collective == "all_reduce":
        buf = torch.zeros(elems, device=device)

        def op():
            dist.all_reduce(buf, group=group)
    elif collective == "reduce_scatter":  # nbytes: the input, n shards of it
        full = torch.zeros(max(1, elems // n) * n, device=device)
        out = torch.empty(full.numel() // n, device=device)

        def op():
            dist.reduce_scatter_single(out, full, group=group)
    else:
        shard = torch.zeros(elems, device=device)
        full = torch.empty(elems * n, device=device)

        def op():
            dist.all_gather_single(full, shard, group=group)
    sync = _device_sync(torch, device)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t.item())

    op()
    sync()
    start = time.perf_counter()
    op()
    sync()
    once = slowest(time.perf_counter() - start)  # the same on every member: the same call counts
    calls = max(1, min(200, int(budget / 3 / max(once, 1e-9))))
    best = once
    for _ in range(3):
        slowest(0.0)  # line the members up
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        sync()
        best = min(best, slowest((time.perf_counter() - start) / calls))
    return best, calls


def _time_overlap(torch, dist, device, nbytes: int) -> dict:
    """Matrix products alone, an all-reduce of ``nbytes`` alone, and the all-reduce started
    asynchronously under the same products, over every rank (the slowest member's seconds), five
    times in turn -> ``comm_overlap``, the median of the five (:func:`autopar.cost.profile.fit_overlap`):
    taken side by side, the three see the same load from other processes."""
    from autopar.cost.profile import fit_overlap

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out, buf = torch.empty_like(a), torch.zeros(max(1, nbytes // 4), device=device)
    sync = _device_sync(torch, device)

    def products(count: int) -> None:
        for _ in range(count):
            torch.mm(a, b, out=out)

    def both(count: int) -> None:
        work = dist.all_reduce(buf, async_op=True)
        products(count)
        work.wait()

    def timed(fn) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        t = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    timed(lambda: both(1))  # warm-up
    once, collective = timed(lambda: products(1)), timed(lambda: dist.all_reduce(buf))
    count = max(1, math.ceil(2 * collective / once))  # about twice the collective's time: a whole window
    rounds = [[timed(fn) for fn in (lambda: products(count), lambda: dist.all_reduce(buf), lambda: both(count))]
              for _ in range(5)]
    overlaps = sorted(fit_overlap(*r) for r in rounds)
    return dict(bytes=nbytes, products=count, rounds=rounds, comm_overlap=overlaps[len(overlaps) // 2])


def _collective_rank(rank: int, world: int, port: int, kind: str, sizes, budget: float, *, post) -> None:
    """One spawned rank: time every collective of every group size it belongs to; rank 0 posts them."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if kind == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    else:
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    groups = {n: dist.new_group(list(range(n))) for n in range(2, world + 1)}  # every rank creates each
    for n, group in groups.items():
        if rank < n:
            for collective in COLLECTIVES:
                for nbytes in sizes:
                    seconds, calls = _time_collective(torch, dist, collective, nbytes, group, n, device, budget)
                    if rank == 0:
                        post("sample", dict(collective=collective, group=n, bytes=nbytes, seconds=seconds,
                                            calls=calls))
        dist.barrier()
    overlap = _time_overlap(torch, dist, device, max(sizes))
    if rank == 0:
        post("overlap", overlap)


def measure_collectives(kind: str, world: int, sizes, budget: float, log,
                        timeout: float = COLLECTIVE_TIMEOUT_S) -> tuple[list[dict], dict]:
    """Timed all-reduces and all-gathers on ``world`` spawned local ranks (NCCL on cuda, gloo on cpu), and
    the overlap of an all-reduce with matrix products (:func:`_time_overlap`): ``(samples, overlap)``."""
    from autopar.verification.launch import run_spawned

    samples, overlap = [], {}

    def received(what: str, rank: int, payload: dict) -> None:
        if what == "overlap":
            overlap.update(payload)
            log(f"all-reduce of {_fmt_bytes(payload['bytes'])} under matrix products: "
                f"{payload['comm_overlap'] * 100:.0f}% of it hidden")
            return
        samples.append(payload)
        log(f"{payload['collective'].replace('_', '-')} over {payload['group']} ranks, "
            f"{_fmt_bytes(payload['bytes'])}: {payload['seconds'] * 1e6:,.0f} us")

    run_spawned(_collective_rank, world, (kind, sizes, budget), timeout=timeout, on_post=received,
                what="timing collectives (try --quick)")
    return samples, overlap


# ---------------------------------------------------------------------- the command
def _machine(torch, threads: int | None) -> dict:
    import platform
    import socket
    from datetime import datetime, timezone

    return {"hostname": socket.gethostname(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "threads": threads, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _fmt_flops(x: float) -> str:
    return f"{x / 1e12:,.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.1f} GFLOP/s"


def _ranks(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("GiB", _GIB), ("MiB", _MIB), ("KiB", _KIB)):
        if x >= scale:
            return f"{x / scale:g} {unit}"
    return f"{x:g} B"


def _summary(profile: dict, out: str) -> str:
    f = profile
    lines = [f"hardware profile of {f['device']} ({_ranks(f['gpus_per_node'])} per node) -> {out}",
             f"  peak_flops            {_fmt_flops(f['peak_flops'])} (gemm_efficiency {f['gemm_efficiency']:g})",
             f"  hbm_bandwidth         {f['hbm_bandwidth'] / 1e9:,.1f} GB/s",
             f"  hbm_bytes             {f['hbm_bytes'] / _GIB:,.1f} GiB per rank",
             f"  intra_node_bandwidth  {f['intra_node_bandwidth'] / 1e9:,.2f} GB/s",
             f"  intra_node_latency    {f['intra_node_latency'] * 1e6:,.1f} us",
             f"  inter_node_bandwidth  {f['inter_node_bandwidth'] / 1e9:,.2f} GB/s",
             f"  inter_node_latency    {f['inter_node_latency'] * 1e6:,.1f} us"]
    gbs = lambda x: f"{x / 1e9:,.2f} GB/s"  # noqa: E731
    for key, text in (("elementwise_bandwidth", gbs), ("optimizer_bandwidth", gbs), ("all_reduce_bandwidth", gbs),
                      ("all_gather_bandwidth", gbs), ("reduce_scatter_bandwidth", gbs),
                      ("attention_factor", lambda x: f"{x:.2f}"),
                      ("comm_overlap", lambda x: f"{x:.2f}"), ("host_cores", str), ("threads_per_rank", str)):
        if key in f:
            lines.append(f"  {key:<24} {text(f[key])}")
    lines += [f"  note: {n}" for n in f["notes"]]
    lines.append(f"use it: autopar plan --hardware {out} --model MODEL --gpus N --seq S --global-batch B")
    return "\n".join(lines)


def _links(kind: str, world: int, settings: dict, notes: list[str], log) -> tuple[float, float, dict]:
    """(bandwidth, latency, details) of the collectives over ``world`` ranks (a preset's with one rank);
    appends how they were obtained to ``notes``."""
    from autopar.cost.hardware import GPU_PRESETS
    from autopar.cost.profile import fit_alpha_beta
    from autopar.cost.time import CALIBRATED

    if world >= 2:
        log(f"starting {world} {'NCCL' if kind == 'cuda' else 'gloo'} ranks for the collectives")
        samples, overlap = measure_collectives(kind, world, settings["sizes"], settings["budget"], log)
        links = fit_alpha_beta(samples, CALIBRATED["epsilon"])
        bandwidth, latency = links["bandwidth"], links["latency"]
        by_collective = {c: {k: v for k, v in fit_alpha_beta([x for x in samples if x["collective"] == c],
                                                             CALIBRATED["epsilon"]).items()
                             if k in ("bandwidth", "latency")} for c in COLLECTIVES}
        collectives = {"backend": "nccl" if kind == "cuda" else "gloo", "world": world,
                       "group_sizes": list(range(2, world + 1)), "sizes_bytes": settings["sizes"], **links,
                       "by_collective": by_collective, "overlap": overlap}
        notes.append(f"intra_node figures: least squares of t = sent / (bandwidth * epsilon) + passes * (n - 1) "
                     f"* latency over {len(samples)} timed all-reduces, all-gathers and reduce-scatters (groups of "
                     f"2..{world} ranks), epsilon {CALIBRATED['epsilon']} as in the time model")
        ranked = sorted(by_collective, key=lambda c: -by_collective[c]["bandwidth"])
        ratio = by_collective[ranked[0]]["bandwidth"] / by_collective[ranked[-1]]["bandwidth"]
        notes.append(f"all_reduce_bandwidth, all_gather_bandwidth, reduce_scatter_bandwidth fit each collective alone "
                     f"(measured.collectives.by_collective); the time model prices each at its own rate "
                     f"({ranked[-1].replace('_', '-')} is {ratio:.1f}x slower per byte than "
                     f"{ranked[0].replace('_', '-')} here)")
    else:
        from autopar.planning.autoplan import local_gpu

        preset = local_gpu() if kind == "cuda" else "cpu"
        bandwidth, latency = GPU_PRESETS[preset]["intra_node_bandwidth"], GPU_PRESETS[preset]["intra_node_latency"]
        collectives = {"world": 1, "note": f"not measured: one rank; the links of the {preset} preset"}
        notes.append(f"intra_node figures not measured (--world 1): the {preset} preset's")
    return bandwidth, latency, collectives


def _host_cores() -> int:
    """The cores this process may run on (its affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _local_figures(torch, kind: str, device, settings: dict, world: int, ranks_per_host: int,
                   log) -> tuple[dict, dict, list[str]]:
    """What one process measures: matrix products, memory bandwidth, element-wise kernels, the optimizer
    step and the memory size -> (figures, measured details, notes)."""
    from autopar.cost.profile import (attention_model_seconds, fit_attention, fit_elementwise, fit_gemm, fit_memory,
                                      fit_optimizer)
    from autopar.cost.time import CALIBRATED

    threads = max(1, _host_cores() // world) if kind == "cpu" else None
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        gemm_samples = measure_gemm(torch, device, dtype, settings["gemm"], settings["budget"], log,
                                    rotate_bytes=ROTATE_BYTES.get(kind, 0))
        memory = fit_memory(measure_memory_bandwidth(torch, device, settings["memory_bytes"], settings["budget"],
                                                     log))
        ew = measure_elementwise(torch, device, dtype, LAYER[kind], settings["budget"], log)
        attn = measure_attention(torch, device, dtype, LAYER[kind], settings["budget"], log)
        opt = measure_optimizer(torch, device, OPTIMIZER_PARAMS[kind], settings["budget"], log)
        hbm_bytes, hbm_details = device_memory(torch, device, ranks_per_host)
    finally:
        torch.set_num_threads(saved_threads)
    gemm = fit_gemm(gemm_samples, memory["hbm_bandwidth"], CALIBRATED["kappa"])
    figures = {"gemm_efficiency": gemm["gemm_efficiency"], "peak_flops": gemm["peak_flops"], "hbm_bytes": hbm_bytes,
               "hbm_bandwidth": memory["hbm_bandwidth"],
               "elementwise_bandwidth": fit_elementwise(ew["model_bytes"], ew["seconds"]),
               "optimizer_bandwidth": fit_optimizer(opt["model_bytes"], opt["seconds"])}
    attn["model_seconds"] = attention_model_seconds(attn["batch"], attn["heads"], attn["seq"], attn["head_dim"],
                                                    gemm_samples[0]["dtype_bytes"], gemm["peak_flops"],
                                                    memory["hbm_bandwidth"], CALIBRATED["kappa"])
    figures["attention_factor"] = fit_attention(attn["seconds"], attn["model_seconds"])
    notes = [f"peak_flops is the best FLOP/s of {len(gemm_samples)} timed matrix products "
             f"({gemm_samples[0]['dtype']}) and gemm_efficiency 1.0, so the time model's large-GEMM rate "
             f"equals it; smaller and skinnier products follow the roofline knee (measured.gemm sets each "
             f"measured rate beside the model's)",
             f"hbm_bandwidth is the best of a copy and an add of {_fmt_bytes(settings['memory_bytes'])} buffers "
             f"(bytes read + written per second)",
             "elementwise_bandwidth and optimizer_bandwidth are the time model's element-wise bytes of one "
             "decoder layer (forward + backward) and its optimizer bytes over the measured seconds of eager "
             "kernels and of torch.optim.AdamW's step (measured.elementwise, measured.optimizer)",
             "attention_factor is the measured seconds of causal scaled_dot_product_attention over the time "
             "model's price of its FLOPs as a matrix product of its size (measured.attention)",
             "hbm_bytes is " + ("the device's memory" if kind == "cuda" else
                                f"the host's memory shared by {_ranks(ranks_per_host)}")]
    if threads:
        figures.update(host_cores=_host_cores(), threads_per_rank=threads)
        notes.append(f"compute and memory were timed with {threads} thread(s), a rank's share of "
                     f"{_host_cores()} cores over {_ranks(world)}; more ranks than cores on this host "
                     f"time-share them (host_cores, threads_per_rank)")
    measured = {"gemm": gemm["samples"], "memory": memory["samples"], "elementwise": ew, "attention": attn,
                "optimizer": opt, "hbm_bytes": hbm_details}
    return figures, measured, notes


def run_calibrate(args) -> int:
    """``autopar calibrate``: measure, fit (cost/profile.py), write the profile, print its figures."""
    import torch

    from autopar.cost.profile import FORMAT, SOURCE, save_profile

    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise AutoparError("autopar: --device cuda, but torch sees no CUDA device here; use --device cpu")
    gpus = torch.cuda.device_count() if kind == "cuda" else None
    world = args.world if args.world is not None else (gpus if kind == "cuda" else 2)
    if world < 1 or (gpus is not None and world > gpus):
        most = f" and {gpus}, the GPUs torch sees" if gpus is not None else " or more"
        raise AutoparError(f"autopar: --world must be 1{most}; got {world}")
    settings = SETTINGS[(kind, bool(args.quick))]
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if kind == "cuda" else "cpu"
    ranks_per_host = gpus if kind == "cuda" else world

    def log(msg: str) -> None:
        print(f"autopar calibrate: {msg}", file=sys.stderr, flush=True)

    begin = time.perf_counter()
    log(f"measuring {name}{' (quick)' if args.quick else ''}: matrix products, memory bandwidth, element-wise "
        f"kernels, the optimizer step, then collectives on {_ranks(world)}")
    figures, measured, notes = _local_figures(torch, kind, device, settings, world, ranks_per_host, log)
    bandwidth, latency, collectives = _links(kind, world, settings, notes, log)
    notes.append("one host: no network was measured, so inter_node_bandwidth and inter_node_latency repeat "
                 "the intra_node figures")
    for collective, fit in collectives.get("by_collective", {}).items():
        figures[f"{collective}_bandwidth"] = fit["bandwidth"]
    if collectives.get("overlap"):
        figures["comm_overlap"] = collectives["overlap"]["comm_overlap"]
        notes.append("comm_overlap is the share of an all-reduce that matrix products running meanwhile hide "
                     "(measured.collectives.overlap, the median of 5 rounds); it replaces the time model's phi"
                     + ("; on a host whose ranks fill every core gloo's threads have none of their own, and "
                        "Cluster.from_profile takes 0" if kind == "cpu" else ""))
    profile = {
        "format": FORMAT, "device": name, "gpus_per_node": ranks_per_host, **figures,
        "intra_node_bandwidth": bandwidth, "intra_node_latency": latency, "inter_node_bandwidth": bandwidth,
        "inter_node_latency": latency, "notes": notes,
        "measured": {"quick": bool(args.quick), "seconds": None, **measured, "collectives": collectives},
        "machine": _machine(torch, figures.get("threads_per_rank")),
        "source": SOURCE,
    }
    if not all(math.isfinite(profile[k]) for k in ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth")):
        raise AutoparError("autopar: a measured figure is not finite; the timings are too short to resolve on "
                           "this machine, run without --quick")
    profile["measured"]["seconds"] = round(time.perf_counter() - begin, 1)
    save_profile(profile, args.out)
    log(f"done in {profile['measured']['seconds']:.0f} s")
    print(_summary(profile, args.out))
    return 0
