"""``autopar plan`` and ``autopar explain``: the offline cost model on the command line.

``plan`` searches every plan for a model on a cluster (:func:`autopar.planning.search.search`)
and prints the best ones as a ranked table (or JSON); ``explain`` scores one plan
(:func:`autopar.cost.estimate`) and prints its full breakdown: the collectives one rank
issues per step (like sections 6.7 and 6.8 of the reference, with docs/architecture.md's byte
convention), memory by category, the time budget and the pipeline bubble, optionally
with each term's formula.

autopar/cli/__init__.py builds the parser and calls :func:`register`; everything that can go
wrong with the user's input raises :class:`autopar.errors.AutoparError`, which it
prints. The cost model lives in ``autopar.cost`` (cost/), the search in
autopar/planning/search.py. ``explain --measure MODULE:FUNCTION --world N`` also runs one training
step of that model on N local gloo processes and prints predicted against measured memory
(autopar/cli/measure_cmd.py).

The hardware is a GPU preset's published figures (``--gpu``, cost/hardware.py) or a profile measured
on the machine by ``autopar calibrate`` (``--hardware PROFILE``, cost/profile.py); both commands say
which (:func:`hardware_record`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from autopar.errors import AutoparError
from autopar.cli.cost_tables import format_explain, format_plan_table
from autopar.views.explain import dominant_terms, explain_record, plan_record  # re-exported

__all__ = [
    "register",
    "run_plan",
    "run_explain",
    "load_model_spec",
    "make_cluster",
    "hardware_record",
    "scored_inputs",
    "dominant_terms",
    "plan_record",
    "format_plan_table",
    "explain_record",
    "format_explain",
]

_GIB = 2.0**30


# ---------------------------------------------------------------------- parser
def register(subparsers) -> None:
    """Add the ``plan`` and ``explain`` subcommands to the ``autopar`` parser."""
    plan = subparsers.add_parser(
        "plan",
        help="search the best parallel plans for a model on a cluster (offline)",
        description="Score every parallel plan with the cost model and print the best ones.",
    )
    _add_common(plan)
    plan.add_argument("--top", type=int, default=10, metavar="K",
                      help="how many plans to print (default 10)")
    plan.add_argument("--no-progress", action="store_true",
                      help="do not report search progress on stderr")
    plan.add_argument("--check", type=int, default=0, metavar="N",
                      help="step the fullest rank of each of the top N plans at full width on the meta device "
                           "(MemTracker, FlopCounterMode) and mark any whose measured peak would not fit")
    plan.add_argument("--report", metavar="DIR", default=None,
                      help="also write DIR/index.html (the top plans side by side) and DIR/plan-1.html (the winner's "
                           "page; autopar/cli/report_cmd.py)")
    plan.set_defaults(func=run_plan)

    explain = subparsers.add_parser(
        "explain",
        help="show the cost breakdown of one plan: collectives, memory, time, bubble",
        description="Score one plan with the cost model and print every term.",
        usage="autopar explain --plan P --model M --gpus N --seq S --global-batch B [options]\n"
              "       autopar explain --plan P --measure MODULE:FUNCTION --world N [options]",
    )
    _add_common(explain, required=False)
    explain.add_argument("--plan", required=True,
                         help="plan text, e.g. 'tp=8,sp,pp=4:1f1b,dp=32,zero=1,mb=8'")
    explain.add_argument("--pp-rank", "--stage", dest="pp_rank", type=int, default=None, metavar="I",
                         help="pp rank whose collectives and memory are listed (default: the slowest)")
    explain.add_argument("--formulas", action="store_true",
                         help="print the symbolic formula of every time and memory term")
    explain.add_argument("--measure", metavar="MODULE:FUNCTION", default=None,
                         help="also run one training step of FUNCTION()'s (model, input_ids) under the "
                              "plan on --world local gloo processes and print predicted against "
                              "measured memory; model, sequence and batch come from the example inputs")
    explain.add_argument("--world", type=int, default=None, metavar="N",
                         help="processes for --measure (the plan's world size)")
    explain.add_argument("--simulate", action="store_true",
                         help="also step the fullest rank at full width on the meta device under a fake process "
                              "group and print torch's MemTracker peak and FlopCounterMode FLOPs beside the "
                              "prediction, term by term (no GPU needed)")
    explain.add_argument("--simulate-layers", type=int, default=None, metavar="K",
                         help="layers to simulate (default: one per pipeline chunk, at least 2; the prediction "
                              "shown beside the measurement is for the same depth)")
    explain.set_defaults(func=run_explain)


def _add_common(p: argparse.ArgumentParser, required: bool = True) -> None:
    # explain checks these itself: --measure takes them from the measured model instead.
    p.add_argument("--model", required=required,
                   help="a preset (llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, "
                        "reference-moe) or the path of a transformers config.json")
    p.add_argument("--gpu", default=None,
                   help="GPU preset, its vendor's published figures: a100, h100, h200, b200, gb200, "
                        "mi300x (default h100)")
    p.add_argument("--hardware", default=None, metavar="PROFILE",
                   help="a hardware profile measured by `autopar calibrate` instead of a --gpu preset")
    p.add_argument("--gpus", type=int, required=required, metavar="N", help="number of GPUs")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs per fast-link domain (default: the preset's, 8; 72 for gb200; a "
                        "profile's own)")
    p.add_argument("--seq", type=int, required=required, metavar="S", help="sequence length")
    p.add_argument("--global-batch", type=int, required=required, metavar="B",
                   help="sequences per optimizer step")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


# ---------------------------------------------------------------------- inputs
def load_model_spec(model: str):
    """A ModelSpec from a preset name or a config.json path (file or directory)."""
    from autopar.cost import ModelSpec
    from autopar.cost.spec import PRESETS

    looks_like_path = (
        model.endswith(".json") or os.sep in model or (os.altsep or os.sep) in model
        or os.path.exists(model)
    )
    if not looks_like_path:
        if model.lower().replace("_", "-") not in PRESETS:
            raise AutoparError(
                f"autopar: unknown model {model!r}; expected a preset "
                f"({', '.join(sorted(PRESETS))}) or the path of a transformers config.json"
            )
        return ModelSpec.preset(model)
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise AutoparError(
            f"autopar: model config {path!r} does not exist; pass the path of a transformers "
            f"config.json (or its directory), or a preset such as llama3-70b"
        )
    return ModelSpec.from_hf_config(path)


def make_cluster(gpu: str | None, gpus: int, gpus_per_node: int | None, hardware: str | None = None):
    """A Cluster of ``gpus`` GPUs of the preset ``gpu`` (None: h100) or of the hardware profile at
    ``hardware`` (never both); fewer GPUs than one node make a single partial node;
    ``gpus_per_node`` None takes the preset's (or the profile's) fast-link domain."""
    from autopar.cost import Cluster
    from autopar.cost.hardware import GPU_PRESETS, whole_nodes

    if hardware is not None and gpu is not None:
        raise AutoparError(
            f"autopar: --gpu {gpu} and --hardware {hardware} both name the hardware; give --gpu for a "
            f"preset's published figures or --hardware for a profile measured by `autopar calibrate`, "
            f"not both"
        )
    if hardware is None and (gpu or "h100").lower() not in GPU_PRESETS:
        raise AutoparError(
            f"autopar: unknown GPU {gpu!r}; expected one of {', '.join(GPU_PRESETS)}, or --hardware "
            f"PROFILE for a machine measured by `autopar calibrate`"
        )
    base = Cluster.from_profile(hardware) if hardware is not None else Cluster(gpu=gpu or "h100")
    num_nodes, per_node = whole_nodes(gpus, base.gpus_per_node if gpus_per_node is None else gpus_per_node)
    return base.replace(num_nodes=num_nodes, gpus_per_node=per_node)


def hardware_record(cluster) -> dict:
    """Where the cluster's figures come from, as a JSON-ready dict; ``line`` says it in one line."""
    from autopar.cost.profile import FIGURES

    figures = {name: getattr(cluster, name) for name in FIGURES}
    if cluster.profile is not None:
        return {"source": "measured profile", "name": cluster.gpu, "profile": cluster.profile, "figures": figures,
                "line": f"hardware: measured profile {cluster.profile} ({cluster.gpu})"}
    return {"source": "published figures", "name": cluster.gpu, "profile": None, "figures": figures,
            "line": f"hardware: {cluster.gpu} preset (published figures; run `autopar calibrate` on your "
                    f"machine for measured ones)"}


def _check_positive(args) -> None:
    for flag, value in (("--seq", args.seq), ("--global-batch", args.global_batch),
                        ("--top", getattr(args, "top", 1))):
        if value < 1:
            raise AutoparError(f"autopar: {flag} must be a positive integer, got {value}")


# ---------------------------------------------------------------------- plan
def _progress(state: dict, show: bool):
    """The search's progress callback: ``state["total"]`` kept, a line on stderr at most twice a second."""
    tty = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        state["total"] = total
        now = time.perf_counter()
        if show and (done == total or now - state["last"] > 0.5):
            state["last"] = now
            end = "\n" if (done == total or not tty) else ""
            print(f"\rautopar: scored {done:,}/{total:,} candidate plans", end=end,
                  file=sys.stderr, flush=True)
    return progress


def run_plan(args) -> int:
    """``autopar plan``: search, then print the ranked table (or JSON)."""
    from autopar.planning.search import search

    _check_positive(args)
    spec = load_model_spec(args.model)
    cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node, args.hardware)
    state = {"total": 0, "last": 0.0}
    progress = _progress(state, show=not args.no_progress)
    if not args.no_progress:
        print(f"autopar: searching plans for {spec.name} on {cluster.world_size} x "
              f"{cluster.gpu} (seq {args.seq}, global batch {args.global_batch})",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    results = search(spec, cluster, args.seq, args.global_batch, top=args.top, progress=progress)
    elapsed = time.perf_counter() - start
    if not results:
        raise AutoparError(
            f"autopar: no plan for {spec.name} fits in {cluster.usable_memory / _GIB:.1f} GiB per "
            f"{cluster.gpu} on {cluster.world_size} GPUs; use more GPUs, a larger GPU, a shorter "
            f"sequence or a smaller global batch"
        )
    records = [plan_record(i + 1, plan, cost) for i, (plan, cost) in enumerate(results)]
    checked = None
    if args.check > 0:
        from autopar.cli.simulate_cmd import checked_records

        checked = checked_records(spec, cluster, results, args.seq, args.global_batch, args.check,
                                  log=lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({
            "model": spec.name, "gpu": cluster.gpu, "gpus": cluster.world_size,
            "gpus_per_node": cluster.gpus_per_node, "seq_len": args.seq,
            "global_batch": args.global_batch, "candidates": state["total"],
            "search_seconds": elapsed, "hardware": hardware_record(cluster), "plans": records,
            **({"checked": checked} if checked is not None else {}),
        }, indent=2))
    else:
        print(f"{spec.name} on {cluster.world_size} x {cluster.gpu}, seq {args.seq}, global batch "
              f"{args.global_batch}: best {len(records)} of {state['total']:,} candidate plans "
              f"({elapsed:.1f} s)")
        print(hardware_record(cluster)["line"])
        print(format_plan_table(records))
        if checked is not None:
            from autopar.cli.simulate_cmd import format_checked

            print("\n" + format_checked(checked))
    if args.report:
        from autopar.cli.report_files import write_search_report

        write_search_report(args.report, spec, cluster, results, records, checked,
                            f"{spec.name} on {cluster.world_size} x {cluster.gpu}, seq {args.seq}, global batch "
                            f"{args.global_batch}: best {len(records)} of {state['total']:,} candidate plans",
                            hardware_record(cluster))
    return 0


# ---------------------------------------------------------------------- explain
def scored_inputs(args, command: str):
    """(spec, cluster, plan) of ``explain``'s and ``report``'s preset options, checked (``autopar:`` errors)."""
    from autopar.plan import Plan

    missing = [flag for flag, value in (("--model", args.model), ("--gpus", args.gpus), ("--seq", args.seq),
                                        ("--global-batch", args.global_batch)) if value is None]
    if missing:
        raise AutoparError(f"autopar: {command} needs {', '.join(missing)}; give them, or --measure "
                           f"MODULE:FUNCTION --world N to take the model from a run on this machine")
    _check_positive(args)
    spec = load_model_spec(args.model)
    cluster = make_cluster(args.gpu, args.gpus, args.gpus_per_node, args.hardware)
    plan = Plan.parse(args.plan)
    if plan.world_size != cluster.world_size:
        raise AutoparError(
            f"autopar: plan '{plan}' uses pp*dp*cp*tp = {plan.world_size} GPUs but --gpus is "
            f"{cluster.world_size}; change a degree (usually dp) or --gpus so that they match"
        )
    return spec, cluster, plan


def run_explain(args) -> int:
    """``autopar explain``: score one plan and print its breakdown (or JSON)."""
    from autopar.cost import estimate

    if args.measure is not None:
        if args.simulate:
            raise AutoparError("autopar: --measure runs the model on this machine, --simulate a preset at full "
                               "width on the meta device; give one of them")
        return _run_explain_measured(args)
    spec, cluster, plan = scored_inputs(args, "explain")
    cost = estimate(spec, cluster, plan, args.seq, args.global_batch)
    rec = explain_record(cost, pp_rank=args.pp_rank, formulas=args.formulas)
    rec["hardware"] = hardware_record(cluster)
    text = format_explain(rec) + "\n\n" + rec["hardware"]["line"]
    if args.simulate:
        from autopar.cli.simulate_cmd import format_simulated, simulate_rank

        rec["simulated"] = simulate_rank(spec, cluster, plan, args.seq, args.global_batch,
                                         layers=args.simulate_layers,
                                         log=lambda msg: print(msg, file=sys.stderr, flush=True))
        text += "\n\n" + format_simulated(rec["simulated"])
    print(json.dumps(rec, indent=2) if args.json else text)
    return 0


def _run_explain_measured(args) -> int:
    """``explain --measure``: the breakdown for the measured model, then predicted vs measured memory."""
    from autopar.cost import Cluster, ModelSpec, estimate
    from autopar.cli.inspect_cmd import load_target
    from autopar.cli.measure_cmd import format_memory_comparison, measure_memory, memory_comparison
    from autopar.plan import Plan

    given = [flag for flag, value in (("--model", args.model), ("--seq", args.seq),
                                      ("--global-batch", args.global_batch)) if value is not None]
    if given:
        raise AutoparError(f"autopar: --measure takes the model, sequence length and batch from "
                           f"{args.measure}'s example inputs; drop {', '.join(given)}")
    plan = Plan.parse(args.plan)
    world = args.world if args.world is not None else args.gpus
    if world is None or world != plan.world_size:
        raise AutoparError(f"autopar: plan '{plan}' uses pp*dp*cp*tp = {plan.world_size} processes but "
                           f"--world is {world}; pass --world {plan.world_size}")
    model, inputs, kwargs = load_target(args.measure)
    if not inputs or not hasattr(inputs[0], "shape") or len(inputs[0].shape) < 2:
        raise AutoparError(f"autopar: --measure needs input_ids [batch, seq] as {args.measure}'s first "
                           f"example input")
    batch, seq = int(inputs[0].shape[0]), int(inputs[0].shape[1])
    spec = ModelSpec.from_module(model, inputs, kwargs)
    cluster = (Cluster.from_profile(args.hardware, gpus_per_node=world) if args.hardware is not None
               else Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world))
    cost = estimate(spec, cluster, plan, seq, batch, dtype_bytes=4)
    reports = measure_memory(args.measure, str(plan), world)
    rows = memory_comparison(cost, reports)
    rec = explain_record(cost, pp_rank=args.pp_rank, formulas=args.formulas)
    if args.json:
        rec["measured_memory"] = {"ranks": reports, "comparison": rows}
        print(json.dumps(rec, indent=2))
    else:
        print(format_explain(rec))
        print()
        print(format_memory_comparison(rows, str(plan), args.measure, world))
    return 0


# ---------------------------------------------------------------------- formatting