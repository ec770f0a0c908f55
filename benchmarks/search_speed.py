"""Plan-search speed: full searches at the scales users run, timed end to end.

Runs :func:`autopar.search` (autopar/planning/search.py over the lambdified cost model in cost/)
for two cases and prints, for each, the candidate plans scored, the wall time and the
candidates per second, plus the one-off cost of compiling the model (sympy lambdify,
paid once per process):

  * llama3-70b on 1,024 H100s, seq 8192, global batch 512 (goal: under 1 s);
  * llama3-405b on 16,384 H100s, seq 8192, global batch 2048 (16M tokens per step, the
    Llama 3 405B pre-training batch; goal: under 5 s).

Usage: ``python benchmarks/search_speed.py [--repeat N] [--json]``. The numbers go in
docs/performance.md ("Plan search speed"). Not a test: timings depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

__all__ = ["CASES", "run_case", "main"]

CASES = (
    dict(model="llama3-70b", gpus=1024, seq=8192, global_batch=512, goal_s=1.0),
    dict(model="llama3-405b", gpus=16384, seq=8192, global_batch=2048, goal_s=5.0),
)


def run_case(model: str, gpus: int, seq: int, global_batch: int, repeat: int = 3) -> dict:
    """Best-of-``repeat`` wall time of one full search (top 10), with its candidate count."""
    from autopar.cost import Cluster
    from autopar.planning.search import search

    cluster = Cluster.for_world("h100", gpus)
    walls, total = [], 0
    best = None
    for _ in range(repeat):
        seen = {"total": 0}
        start = time.perf_counter()
        results = search(model, cluster, seq, global_batch, top=10,
                         progress=lambda done, tot: seen.__setitem__("total", tot))
        walls.append(time.perf_counter() - start)
        total = seen["total"]
        best = results[0] if results else None
    wall = min(walls)
    return {
        "model": model, "gpus": gpus, "seq": seq, "global_batch": global_batch,
        "candidates": total, "wall_s": wall, "wall_s_all": walls,
        "candidates_per_s": total / wall if wall > 0 else float("inf"),
        "best_plan": str(best[0]) if best else None,
        "best_step_s": best[1].step_time if best else None,
        "best_mfu": best[1].mfu if best else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per case; the best is reported")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    import autopar.cost.model as cost_model  # compile once, outside the timed searches

    cost_model.model_formulas("derived", False)
    cost_model.model_formulas("derived", True)
    compile_s = time.perf_counter() - start

    results = []
    for case in CASES:
        res = run_case(case["model"], case["gpus"], case["seq"], case["global_batch"], args.repeat)
        res["goal_s"] = case["goal_s"]
        res["meets_goal"] = res["wall_s"] < case["goal_s"]
        results.append(res)
    machine = f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    if args.json:
        print(json.dumps({"machine": machine, "compile_s": compile_s, "cases": results}, indent=2))
        return 0
    print(f"machine: {machine}; cost-model compile (once per process): {compile_s:.2f} s")
    print(f"{'model':<12} {'GPUs':>6} {'seq':>5} {'batch':>5} {'candidates':>11} {'wall':>8} "
          f"{'cand/s':>10} {'goal':>6}  best plan")
    for r in results:
        print(f"{r['model']:<12} {r['gpus']:>6} {r['seq']:>5} {r['global_batch']:>5} "
              f"{r['candidates']:>11,} {r['wall_s']:>7.2f}s {r['candidates_per_s']:>10,.0f} "
              f"{'<' + format(r['goal_s'], 'g') + 's':>6}{' ok' if r['meets_goal'] else ' MISS'}  "
              f"{r['best_plan']} ({r['best_step_s']:.2f} s/step, MFU {r['best_mfu'] * 100:.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
