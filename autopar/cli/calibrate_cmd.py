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
* all-reduce and all-gather at several message sizes over every group size 2..world, on
  ``--world`` local processes (NCCL on CUDA, gloo on the CPU) -> ``intra_node_bandwidth`` and
  ``intra_node_latency`` by the time model's alpha-beta formula, least squares
  (:func:`autopar.cost.profile.fit_alpha_beta`). One host measures no network: the
  ``inter_node`` figures repeat the ``intra_node`` ones, and the profile's notes say so.

On the CPU the compute and memory kernels run with a rank's share of the cores (cores // world
threads) and each collective rank with one thread, as the ranks of a gloo run do. Progress goes
to stderr as it goes; the figures to stdout. ``--quick`` times fewer shapes and sizes, for
shorter (under a minute on a CPU). ``autopar plan --hardware`` / ``autopar explain --hardware``
and ``autopar.Cluster.from_profile`` read the profile (docs/cost-model.md, "Hardware profiles").
"""
from __future__ import annotations

import math
import os
import sys
import time
import traceback

from autopar.errors import AutoparError

__all__ = ["register", "run_calibrate", "measure_gemm", "measure_memory_bandwidth", "device_memory",
           "measure_collectives", "SETTINGS"]

_KIB, _MIB, _GIB = 2**10, 2**20, 2**30
COLLECTIVE_TIMEOUT_S = 600.0

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


# ---------------------------------------------------------------------- timing
def _best_seconds(fn, sync, budget: float) -> tuple[float, int]:
    """(seconds per call, calls per round): a warm-up, then three rounds sized to ``budget``, the best kept."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - start
    calls = max(1, min(1000, int(budget / 3 / max(once, 1e-9))))
    best = once
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best, calls


def _sync(torch, device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_gemm(torch, device, dtype, shapes, budget: float, log) -> list[dict]:
    """One sample per ``(m, k, n)``: seconds of ``[m, k] @ [k, n]`` in ``dtype`` on ``device``."""
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        seconds, calls = _best_seconds(lambda: torch.mm(a, b, out=out), _sync(torch, device), budget)
        rows.append(dict(m=m, k=k, n=n, dtype=str(dtype).removeprefix("torch."), dtype_bytes=a.element_size(),
                         seconds=seconds, calls=calls))
        log(f"matrix product [{m}, {k}] @ [{k}, {n}] {rows[-1]['dtype']}: "
            f"{2.0 * m * k * n / seconds / 1e9:,.1f} GFLOP/s")
    return rows


def measure_memory_bandwidth(torch, device, nbytes: int, budget: float, log) -> list[dict]:
    """A copy (reads and writes ``nbytes``) and an add (reads 2x, writes 1x) of fp32 buffers."""
    x = torch.ones(nbytes // 4, device=device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    rows = []
    for kernel, fn, moved in (("copy", lambda: y.copy_(x), 2 * nbytes),
                              ("add", lambda: torch.add(x, y, out=z), 3 * nbytes)):
        seconds, calls = _best_seconds(fn, _sync(torch, device), budget)
        rows.append(dict(kernel=kernel, bytes=nbytes, bytes_moved=moved, seconds=seconds, calls=calls))
        log(f"memory {kernel} of {nbytes / _MIB:,.0f} MiB buffers: {moved / seconds / 1e9:,.1f} GB/s")
    return rows


def device_memory(torch, device, ranks_per_host: int) -> tuple[float, dict]:
    """(``hbm_bytes`` per rank, how it was found)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total), {"total_bytes": total, "source": "torch.cuda.get_device_properties"}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / ranks_per_host, {"total_bytes": total, "ranks_sharing": ranks_per_host,
                                    "source": "os.sysconf: host memory / ranks on the host"}


# ---------------------------------------------------------------------- collectives
def _time_collective(torch, dist, collective: str, nbytes: int, group, n: int, device, budget: float):
    """(seconds per call: the slowest member's, calls per round) of one collective in ``group``."""
    elems = max(1, nbytes // 4)
    if collective == "all_reduce":
        buf = torch.zeros(elems, device=device)

        def op():
            dist.all_reduce(buf, group=group)
    else:
        shard = torch.zeros(elems, device=device)
        full = torch.empty(elems * n, device=device)

        def op():
            dist.all_gather_single(full, shard, group=group)
    sync = _sync(torch, device)

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


def _collective_rank(rank: int, world: int, port: int, kind: str, sizes, budget: float, results) -> None:
    """One spawned rank: time every collective of every group size it belongs to; rank 0 reports."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    try:
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
                for collective in ("all_reduce", "all_gather"):
                    for nbytes in sizes:
                        seconds, calls = _time_collective(torch, dist, collective, nbytes, group, n, device, budget)
                        if rank == 0:
                            results.put(("sample", rank, dict(collective=collective, group=n, bytes=nbytes,
                                                              seconds=seconds, calls=calls)))
            dist.barrier()
        results.put(("done", rank, None))
    except BaseException as exc:  # reported to the parent, which raises a clear error
        results.put(("err", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_collectives(kind: str, world: int, sizes, budget: float, log,
                        timeout: float = COLLECTIVE_TIMEOUT_S) -> list[dict]:
    """Timed all-reduces and all-gathers on ``world`` spawned local ranks (NCCL on cuda, gloo on cpu)."""
    import queue

    import torch.multiprocessing as mp

    from autopar.verification.launch import free_port, stop_processes

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, world, port, kind, sizes, budget, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    samples, done = [], set()
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world:
            try:
                status, rank, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in done]
                if dead or time.monotonic() > deadline:
                    why = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}" if dead else \
                        f"the ranks did not finish within {timeout:.0f} s"
                    raise AutoparError(f"autopar: timing collectives on {world} local ranks failed: {why}; "
                                       f"try a smaller --world or --quick") from None
                continue
            if status == "err":
                raise AutoparError(f"autopar: calibration rank {rank} failed while timing collectives: "
                                   f"{payload.splitlines()[0]}\n{payload}")
            if status == "done":
                done.add(rank)
                continue
            samples.append(payload)
            log(f"{payload['collective'].replace('_', '-')} over {payload['group']} ranks, "
                f"{_fmt_bytes(payload['bytes'])}: {payload['seconds'] * 1e6:,.0f} us")
    finally:
        stop_processes(procs)
    return samples


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
        samples = measure_collectives(kind, world, settings["sizes"], settings["budget"], log)
        links = fit_alpha_beta(samples, CALIBRATED["epsilon"])
        bandwidth, latency = links["bandwidth"], links["latency"]
        by_collective = {c: {k: v for k, v in fit_alpha_beta([x for x in samples if x["collective"] == c],
                                                             CALIBRATED["epsilon"]).items()
                             if k in ("bandwidth", "latency")} for c in ("all_reduce", "all_gather")}
        collectives = {"backend": "nccl" if kind == "cuda" else "gloo", "world": world,
                       "group_sizes": list(range(2, world + 1)), "sizes_bytes": settings["sizes"], **links,
                       "by_collective": by_collective}
        notes.append(f"intra_node figures: least squares of t = sent / (bandwidth * epsilon) + passes * (n - 1) "
                     f"* latency over {len(samples)} timed all-reduces and all-gathers (groups of "
                     f"2..{world} ranks), epsilon {CALIBRATED['epsilon']} as in the time model")
        fast, slow = sorted(by_collective, key=lambda c: -by_collective[c]["bandwidth"])
        ratio = by_collective[fast]["bandwidth"] / by_collective[slow]["bandwidth"]
        if ratio > 1.5:
            notes.append(f"{slow.replace('_', '-')} moves its bytes {ratio:.1f}x slower than {fast.replace('_', '-')} "
                         f"here; the time model takes one bandwidth for every ring collective, so the fit lies "
                         f"between (measured.collectives.by_collective fits each alone)")
    else:
        from autopar.planning.autoplan import local_gpu

        preset = local_gpu() if kind == "cuda" else "cpu"
        bandwidth, latency = GPU_PRESETS[preset]["intra_node_bandwidth"], GPU_PRESETS[preset]["intra_node_latency"]
        collectives = {"world": 1, "note": f"not measured: one rank; the links of the {preset} preset"}
        notes.append(f"intra_node figures not measured (--world 1): the {preset} preset's")
    return bandwidth, latency, collectives


def run_calibrate(args) -> int:
    """``autopar calibrate``: measure, fit (cost/profile.py), write the profile, print its figures."""
    import torch

    from autopar.cost.profile import FORMAT, SOURCE, fit_gemm, fit_memory, save_profile
    from autopar.cost.time import CALIBRATED

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
    log(f"measuring {name}{' (quick)' if args.quick else ''}: matrix products, memory bandwidth, then "
        f"collectives on {_ranks(world)}")
    threads = max(1, (os.cpu_count() or 1) // world) if kind == "cpu" else None
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        gemm_samples = measure_gemm(torch, device, dtype, settings["gemm"], settings["budget"], log)
        memory = fit_memory(measure_memory_bandwidth(torch, device, settings["memory_bytes"], settings["budget"],
                                                     log))
        hbm_bytes, hbm_details = device_memory(torch, device, ranks_per_host)
    finally:
        torch.set_num_threads(saved_threads)
    gemm = fit_gemm(gemm_samples, memory["hbm_bandwidth"], CALIBRATED["kappa"])
    notes = [f"peak_flops is the best FLOP/s of {len(gemm_samples)} timed matrix products "
             f"({gemm_samples[0]['dtype']}) and gemm_efficiency 1.0, so the time model's large-GEMM rate "
             f"equals it; smaller and skinnier products follow the roofline knee (measured.gemm sets each "
             f"measured rate beside the model's)",
             f"hbm_bandwidth is the best of a copy and an add of {_fmt_bytes(settings['memory_bytes'])} buffers "
             f"(bytes read + written per second)",
             "hbm_bytes is " + ("the device's memory" if kind == "cuda" else
                                f"the host's memory shared by {_ranks(ranks_per_host)}")]
    if threads:
        notes.append(f"compute and memory were timed with {threads} thread(s), a rank's share of "
                     f"{os.cpu_count()} cores over {_ranks(world)}")
    bandwidth, latency, collectives = _links(kind, world, settings, notes, log)
    notes.append("one host: no network was measured, so inter_node_bandwidth and inter_node_latency repeat "
                 "the intra_node figures")
    profile = {
        "format": FORMAT, "device": name, "gpus_per_node": ranks_per_host,
        "gemm_efficiency": gemm["gemm_efficiency"], "peak_flops": gemm["peak_flops"], "hbm_bytes": hbm_bytes,
        "hbm_bandwidth": memory["hbm_bandwidth"], "intra_node_bandwidth": bandwidth,
        "intra_node_latency": latency, "inter_node_bandwidth": bandwidth, "inter_node_latency": latency,
        "notes": notes,
        "measured": {"quick": bool(args.quick), "seconds": None, "gemm": gemm["samples"],
                     "memory": memory["samples"], "hbm_bytes": hbm_details, "collectives": collectives},
        "machine": _machine(torch, threads),
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
