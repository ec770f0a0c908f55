"""Benchmark: the time model's fidelity on this machine, predicted against measured step time per plan.

Each plan trains a causal LM of transformers (``--arch``: by default ``GraniteForCausalLM``, which
no test uses, so that nothing in the cost model was tuned on it; hidden 512, 4 layers, 8 heads,
4 KV heads, FFN 1376, vocab 4096, untied; batch 8 x 256 tokens, fp32, AdamW) on local gloo
ranks of this machine, one thread per rank; the ranks are spawned once per world size (1, 2 and
4) and run every plan of that size one after the other in one process group.  For each plan:

1. ``autopar.parallelize`` compiles it; the program's own prediction (``pm.predicted_cost``, the
   cost model with the hardware profile that ``$AUTOPAR_HARDWARE_PROFILE`` names: this machine,
   measured by ``autopar calibrate``) is the predicted side;
2. ``--warmup`` untimed steps, then ``--steps`` timed ones, each after a barrier; a step lasts as
   long as its slowest rank, and the reported time is the median over the timed steps;
3. per term, on the slowest rank of each step (medians over steps), what the runtime can time:
   * ``comm``: seconds blocked in collectives (every ``Work.wait``: a blocking collective waits on
     its work too), but the pipeline's point-to-point waits;
   * ``bubble``: seconds blocked in the pipeline schedule's point-to-point waits (the bubble and
     the transfers the model charges to P2P);
   * ``optimizer``: the optimizer step (``grad_sync.step``), less any collective inside it;
   * ``compute``: the rest of the step.
   The predicted terms are the cost model's: compute (every ``compute.*`` term), exposed
   collectives (all but the pipeline's P2P, per step), bubble (plus the exposed P2P) and optimizer.
   On a CPU the split between compute and comm is loose: gloo's threads do a collective's copies
   and sums on the cores the compute uses, so an asynchronous collective that finished before its
   wait shows up as slower compute, not as comm;
4. the slowest rank's process CPU seconds per step (its threads'): far below the step when the
   rank waited on others (pp) or when other processes took its cores (a loaded machine).

The report: a table of plans (predicted, measured, relative error, per term, rank CPU), the median
and the worst absolute relative error of the step time, and per world size how the predictions
rank the plans against the clock (Kendall's tau; the regret of the plan predicted fastest: its
measured time over the measured fastest's, less 1).  ``--markdown`` prints the table as Markdown
(docs/performance.md, "Time-model fidelity").  ``--profile PATH`` takes a profile; without it the
benchmark runs ``autopar calibrate --device cpu --world 2`` first (``--calibrate-out`` keeps it).

Run: ``python benchmarks/fidelity.py [--profile PROFILE.json] [--plans 'dp=2;tp=2,sp'] [--steps N]
[--warmup N] [--markdown] [--json PATH]``.  Results: docs/performance.md.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from autopar.verification.launch import run_spawned  # noqa: E402

_RUN_TIMEOUT_S = 24 * 3600.0  # one world size's plans, all of them (each step has its own gloo timeout)

__all__ = ["PLANS", "FidelityConfig", "run_benchmark", "main"]

# (plan, world size): on one rank, full recompute and gradient accumulation; on two, plain dp,
# ZeRO-1 and ZeRO-3, a pipeline, TP + SP and ring CP; on four (a 2-core machine: two ranks a core,
# time-sharing), dp, ZeRO-1, tp x dp and pp x dp.
PLANS: tuple[tuple[str, int], ...] = (
    ("none", 1),
    ("recompute=full", 1),
    ("mb=2", 1),
    ("dp=2", 2),
    ("dp=2,zero=1", 2),
    ("dp=2,zero=3", 2),
    ("pp=2:1f1b,mb=4", 2),
    ("tp=2,sp", 2),
    ("cp=2:ring", 2),
    ("dp=4", 4),
    ("dp=4,zero=1", 4),
    ("tp=2,dp=2", 4),
    ("pp=2:1f1b,dp=2,mb=2", 4),
)
# Model families the benchmark builds (transformers' configs): ``granite`` is held out (no test
# uses it, so nothing was tuned on it); ``llama`` is the model of the earlier tables.
ARCHS = ("granite", "llama")
TERMS = ("compute", "comm", "bubble", "optimizer")


# The model's size, by transformers' config keys; the CLI's flags that set them.
MODEL_SIZE = (("hidden_size", 512), ("num_hidden_layers", 4), ("num_attention_heads", 8),
              ("num_key_value_heads", 4), ("intermediate_size", 1376), ("vocab_size", 4096))
SIZE_FLAGS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "ffn": "intermediate_size",
              "vocab": "vocab_size"}


@dataclass(frozen=True, kw_only=True)
class FidelityConfig:
    """What one run measures (``size``: the model's, as :data:`MODEL_SIZE`)."""

    plans: tuple[tuple[str, int], ...] = PLANS
    arch: str = "granite"
    steps: int = 5
    warmup: int = 3
    batch: int = 8
    seq: int = 256
    size: tuple[tuple[str, int], ...] = MODEL_SIZE
    threads_per_rank: int = 1
    seed: int = 0
    profile: str = ""
    timeout_s: int = 600

    def model_config(self) -> dict:
        return dict(self.size, max_position_embeddings=self.seq, tie_word_embeddings=False)

    def with_sizes(self, **flags: int) -> "FidelityConfig":
        """This config with the sizes named by :data:`SIZE_FLAGS` (``hidden=1024``) replaced."""
        size = dict(self.size) | {SIZE_FLAGS[k]: v for k, v in flags.items()}
        return replace(self, size=tuple(size.items()))


def _say(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


# --- what the runtime can time -------------------------------------------------------------------


class TermTimer:
    """Seconds one rank spends blocked in collectives, in pipeline P2P waits and in the optimizer.

    ``Work.wait`` is patched on the class (a blocking collective of ``torch.distributed`` waits on
    its work too); waits inside the pipeline schedule's ``_wait_batch_p2p`` count as ``bubble``.
    ``install`` once per process; ``watch(pm)`` wraps one program's optimizer step."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(TERMS[1:], 0.0)
        self._kind = "comm"

    def install(self) -> None:
        from torch.distributed.pipelining import schedules

        work = torch._C._distributed_c10d.Work
        wait, p2p = work.wait, schedules._wait_batch_p2p
        timer = self

        def timed_wait(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return wait(self, *args, **kwargs)
            finally:
                timer.totals[timer._kind] += time.perf_counter() - start

        def timed_p2p(*args, **kwargs):
            timer._kind = "bubble"
            try:
                return p2p(*args, **kwargs)
            finally:
                timer._kind = "comm"

        work.wait = timed_wait
        schedules._wait_batch_p2p = timed_p2p

    def watch(self, pm) -> None:
        step = pm.grad_sync.step

        def timed_step(*args, **kwargs):
            start, blocked = time.perf_counter(), self.totals["comm"]
            try:
                return step(*args, **kwargs)
            finally:
                self.totals["optimizer"] += time.perf_counter() - start - (self.totals["comm"] - blocked)

        pm.grad_sync.step = timed_step

    def reset(self) -> None:
        self.totals = dict.fromkeys(TERMS[1:], 0.0)


def _predicted_terms(cost) -> dict[str, float]:
    """The cost model's step time split as the runtime times it (see the module docstring)."""
    terms = dict.fromkeys(TERMS, 0.0)
    for t in cost.breakdown(formulas=False):
        if t.category == "compute":
            terms["compute"] += t.value
        elif t.category == "comm" and t.name.endswith("(exposed)"):
            terms["bubble" if ".pp." in t.name and ".pp_embed." not in t.name else "comm"] += t.value
        elif t.category == "step":
            terms["optimizer"] += t.value
    terms["bubble"] += cost.bubble
    return terms


# --- one plan on the ranks of its world size -----------------------------------------------------


def _model(cfg: FidelityConfig):
    """The ``cfg.arch`` causal LM of transformers at the configured size, fp32, weights from the seed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(cfg.arch, **cfg.model_config())
    config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(config).float()


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy from the model's ``CausalLMOutput`` (its ``.logits``)."""
    return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def _batch(vocab: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _timed_steps(pm, timer: TermTimer, cfg: FidelityConfig, batches: list) -> list[list[float]]:
    """Per timed step, the slowest rank's [step, comm, bubble, optimizer, process CPU] seconds."""
    rows = []
    for i in range(cfg.warmup + cfg.steps):
        ids, target = batches[i % len(batches)]
        dist.barrier()
        timer.reset()
        start, cpu = time.perf_counter(), time.process_time()
        pm.train_step((ids,), target)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if i >= cfg.warmup:
            rows.append([seconds] + [timer.totals[k] for k in TERMS[1:]] + [cpu])
    mine = torch.tensor(rows, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    stacked = torch.stack(every)                       # [rank, step, value]
    slowest = stacked[:, :, 0].argmax(dim=0)           # the slowest rank of each step
    return [stacked[r, s].tolist() for s, r in enumerate(slowest.tolist())]


def _measured(steps: list[list[float]]) -> dict:
    """Medians over the timed steps: the step time, each term (compute = the rest) and the slowest
    rank's process CPU seconds (its threads' CPU time: well below the step when the rank waited, or
    when other processes took its cores)."""
    step = statistics.median(s[0] for s in steps)
    terms = {k: statistics.median(s[i + 1] for s in steps) for i, k in enumerate(TERMS[1:])}
    terms["compute"] = statistics.median(s[0] - sum(s[1:4]) for s in steps)
    return {"step_s": step, "terms": {k: terms[k] for k in TERMS}, "steps_s": [s[0] for s in steps],
            "cpu_s": statistics.median(s[4] for s in steps)}


def _run_plan(plan: str, cfg: FidelityConfig, timer: TermTimer, batches: list) -> dict:
    import autopar

    t0 = time.perf_counter()
    pm = autopar.parallelize(_model(cfg), example_inputs=(batches[0][0],), example_kwargs={"use_cache": False},
                             plan=plan, loss_fn=_loss,
                             optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    compile_s = time.perf_counter() - t0
    timer.watch(pm)
    measured = _measured(_timed_steps(pm, timer, cfg, batches))
    stats, cost = dict(pm.last_step_stats), pm.predicted_cost
    result = {"plan": plan, "world": dist.get_world_size(), "compile_s": round(compile_s, 1), **measured,
              "last_step_stats": stats, "load_average": os.getloadavg()[0]}
    if cost is None:
        result["status"] = "no prediction (no hardware profile?)"
        return result
    result.update(status="ok", predicted_s=cost.step_time, predicted_terms=_predicted_terms(cost),
                  error=cost.step_time / measured["step_s"] - 1)
    del pm
    gc.collect()
    return result


def _worker(rank: int, world: int, port: int, cfg: FidelityConfig, plans: list[str], *, post) -> list[dict]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), AUTOPAR_HARDWARE_PROFILE=cfg.profile)
    torch.set_num_threads(cfg.threads_per_rank)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.timeout_s))
    batches = [_batch(dict(cfg.size)["vocab_size"], cfg.batch, cfg.seq, cfg.seed + i) for i in range(4)]
    timer = TermTimer()
    timer.install()
    results = []
    for plan in plans:
        _say(f"world {world}: {plan} ({plans.index(plan) + 1}/{len(plans)}): compiling, "
             f"{cfg.warmup} warm-up + {cfg.steps} timed steps ...")
        result = _run_plan(plan, cfg, timer, batches)
        results.append(result)
        if result["status"] == "ok":
            _say(f"world {world}: {plan}: predicted {result['predicted_s'] * 1e3:.0f} ms, measured "
                 f"{result['step_s'] * 1e3:.0f} ms ({result['error'] * 100:+.1f}%)")
        dist.barrier()
    return results




# --- the run and its report ----------------------------------------------------------------------


def calibrate(out: str) -> str:
    """Run ``autopar calibrate --device cpu --world 2 --out OUT`` (this machine's profile)."""
    _say(f"measuring this machine: autopar calibrate --device cpu --world 2 --out {out} ...")
    code = "import sys; from autopar.cli import main; sys.exit(main(sys.argv[1:]))"
    subprocess.run([sys.executable, "-c", code, "calibrate", "--device", "cpu", "--world", "2", "--out", out],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def run_benchmark(cfg: FidelityConfig) -> dict:
    """Spawn the ranks once per world size, run its plans, return the report."""
    started = time.perf_counter()
    by_world: dict[int, list[str]] = {}
    for plan, world in cfg.plans:
        by_world.setdefault(world, []).append(plan)
    results = []
    for world, plans in sorted(by_world.items()):
        results += run_spawned(_worker, world, (cfg, plans), what=f"timing {len(plans)} plans",
                               timeout=_RUN_TIMEOUT_S)[0]
    errors = [abs(r["error"]) for r in results if r["status"] == "ok"]
    return {"config": asdict(cfg), "profile": json.loads(Path(cfg.profile).read_text()),
            "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__},
            "wall_s": round(time.perf_counter() - started, 1), "plans": results,
            "median_abs_error": statistics.median(errors) if errors else float("nan"),
            "worst_abs_error": max(errors) if errors else float("nan"),
            "ranking": ranking(results)}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-a of two orderings of the same items (1: the same order, -1: reversed)."""
    n, score = len(xs), 0
    for i in range(n):
        for j in range(i + 1, n):
            score += ((xs[i] > xs[j]) - (xs[i] < xs[j])) * ((ys[i] > ys[j]) - (ys[i] < ys[j]))
    return score / (n * (n - 1) / 2) if n > 1 else float("nan")


def ranking(results: list[dict]) -> dict[int, dict]:
    """Per world size, how the predictions order the plans against the clock: Kendall's tau, the
    plan predicted fastest, the plan measured fastest and the regret (the measured time of the
    predicted-fastest plan over the measured fastest, less 1)."""
    out = {}
    for world in sorted({r["world"] for r in results}):
        ok = [r for r in results if r["world"] == world and r["status"] == "ok"]
        if not ok:
            continue
        picked = min(ok, key=lambda r: r["predicted_s"])
        best = min(ok, key=lambda r: r["step_s"])
        out[world] = {"plans": len(ok), "tau": kendall_tau([r["predicted_s"] for r in ok], [r["step_s"] for r in ok]),
                      "predicted_best": picked["plan"], "measured_best": best["plan"],
                      "regret": picked["step_s"] / best["step_s"] - 1}
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}"


def _rows(report: dict) -> list[list[str]]:
    rows = []
    for r in report["plans"]:
        if r["status"] != "ok":
            rows.append([f"`{r['plan']}`", str(r["world"]), "-", _ms(r["step_s"]), r["status"]] + [""] * 5)
            continue
        p, m = r["predicted_terms"], r["terms"]
        rows.append([f"`{r['plan']}`", str(r["world"]), _ms(r["predicted_s"]), _ms(r["step_s"]),
                     f"{r['error'] * 100:+.1f}%"] + [f"{_ms(p[k])} / {_ms(m[k])}" for k in TERMS]
                    + [_ms(r["cpu_s"])])
    return rows


def format_report(report: dict, markdown: bool = False) -> str:
    head = (["plan", "ranks", "predicted ms", "measured ms", "error"] + [f"{k} ms (pred / meas)" for k in TERMS]
            + ["rank CPU ms"])
    rows = _rows(report)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in (head, *rows)]
    c, prof = report["config"], report["profile"]
    size = dict(map(tuple, c["size"]))
    med, worst = report["median_abs_error"] * 100, report["worst_abs_error"] * 100
    lines += [""] + [f"{w} rank{'s' * (w > 1)}: Kendall tau {r['tau']:+.2f} over {r['plans']} plans; predicted fastest "
                     f"`{r['predicted_best']}`, measured fastest `{r['measured_best']}`, regret {r['regret'] * 100:.1f}%"
                     for w, r in sorted(report["ranking"].items(), key=lambda kv: int(kv[0]))]
    lines += ["", f"median |error| {med:.1f}%, worst {worst:.1f}% "
                  f"over {sum(r['status'] == 'ok' for r in report['plans'])} plans; {report['wall_s']:.0f} s in all",
              f"model: {c['arch']} hidden {size['hidden_size']}, {size['num_hidden_layers']} layers, "
              f"{size['num_attention_heads']} heads ({size['num_key_value_heads']} KV), "
              f"FFN {size['intermediate_size']}, vocab {size['vocab_size']}; batch {c['batch']} x {c['seq']}, fp32, AdamW; "
              f"{c['warmup']} warm-up + {c['steps']} timed steps, medians",
              f"machine: {report['machine']['cpu_count']} cores, {c['threads_per_rank']} thread per rank, gloo, torch "
              f"{report['machine']['torch']}; profile {c['profile']} ({prof['peak_flops'] / 1e9:.0f} GFLOP/s, "
              f"{prof['hbm_bandwidth'] / 1e9:.1f} GB/s, links {prof['intra_node_bandwidth'] / 1e9:.2f} GB/s "
              f"+ {prof['intra_node_latency'] * 1e6:.0f} us)"]
    return "\n".join(lines)


def _parse_plans(text: str) -> tuple[tuple[str, int], ...]:
    """``"dp=2;tp=2,dp=2"``: plans separated by ';', each on the ranks its degrees multiply to."""
    from autopar.plan import Plan

    return tuple((p.strip(), Plan.parse(p.strip()).world_size) for p in text.split(";") if p.strip())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="hardware profile (autopar calibrate); default: measure one first")
    parser.add_argument("--calibrate-out", help="where to keep the profile measured first (default: a temporary file)")
    parser.add_argument("--plans", help="plans separated by ';' (default: " + "; ".join(p for p, _ in PLANS) + ")")
    parser.add_argument("--arch", choices=ARCHS, default=FidelityConfig.arch,
                        help="the model's family (default: granite, which no test uses)")
    parser.add_argument("--steps", type=int, default=FidelityConfig.steps, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=FidelityConfig.warmup, help="untimed steps per plan")
    for name in ("batch", "seq"):
        parser.add_argument(f"--{name}", type=int, default=getattr(FidelityConfig, name))
    for flag, key in SIZE_FLAGS.items():
        parser.add_argument(f"--{flag}", type=int, default=dict(MODEL_SIZE)[key], help=f"the model's {key}")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        profile = args.profile or calibrate(args.calibrate_out or os.path.join(tmp, "profile.json"))
        cfg = FidelityConfig(plans=_parse_plans(args.plans) if args.plans else PLANS, steps=args.steps,
                             warmup=args.warmup, profile=os.path.abspath(profile), arch=args.arch,
                             batch=args.batch, seq=args.seq).with_sizes(**{f: getattr(args, f) for f in SIZE_FLAGS})
        report = run_benchmark(cfg)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    print(format_report(report, markdown=args.markdown))
    return report


if __name__ == "__main__":
    main()
