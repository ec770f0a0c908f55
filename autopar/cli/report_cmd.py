"""``autopar report`` and ``autopar plan --report DIR``: a plan's page as one self-contained HTML file.

``autopar report --model M --plan P --gpus N --seq S --global-batch B -o plan.html`` scores the plan as
``autopar explain`` does (the same options, :func:`autopar.cli.plan_cmd.load_model_spec`,
:func:`~autopar.cli.plan_cmd.make_cluster`) and writes its page (autopar/views/report.py,
report_html.py, report_plots.py); ``--simulate`` adds the full-width simulation's measurements
(autopar/cli/simulate_cmd.py) and ``--measure MODULE:FUNCTION --world N`` one step of that model on N
local gloo processes (autopar/cli/measure_cmd.py), each beside its prediction.
``autopar plan --report DIR`` writes its pages through autopar/cli/report_files.py (which imports no
command module: plan_cmd.py calls it).  docs/report.md describes the page.
"""
from __future__ import annotations

import os
import sys

from autopar.cli.report_files import write_page
from autopar.errors import AutoparError

__all__ = ["register", "run_report"]


def register(sub) -> None:
    from autopar.cli.plan_cmd import _add_common

    p = sub.add_parser(
        "report", help="write one plan's page: mesh, schedule, memory, collectives, time (self-contained HTML)",
        description="Score one plan as `autopar explain` does and write its page as one self-contained HTML "
                    "file (no network needed to open it): the mesh, the pipeline schedule, the fullest rank's "
                    "memory over the step, bytes per axis and collective, the step's time split with the "
                    "formulas, and predicted against measured where a measurement is asked for.",
        usage="autopar report --plan P --model M --gpus N --seq S --global-batch B [-o FILE] [options]\n"
              "       autopar report --plan P --measure MODULE:FUNCTION --world N [-o FILE] [options]")
    _add_common(p, required=False)
    p.add_argument("--plan", required=True, help="plan text, e.g. 'tp=8,sp,pp=4:interleaved,vpp=2,dp=32,mb=8'")
    p.add_argument("-o", "--output", default="plan.html", metavar="FILE", help="the page to write (default plan.html)")
    p.add_argument("--simulate", action="store_true",
                   help="also step the fullest rank at full width on the meta device and show torch's measured "
                        "peak and FLOPs beside the prediction (transformers needed)")
    p.add_argument("--measure", metavar="MODULE:FUNCTION", default=None,
                   help="also run one training step of FUNCTION()'s (model, input_ids) on --world local gloo "
                        "processes and show measured against predicted memory")
    p.add_argument("--world", type=int, default=None, metavar="N", help="processes for --measure")
    p.set_defaults(func=run_report)


def _preset_cost(args):
    from autopar.cli.plan_cmd import hardware_record, scored_inputs
    from autopar.cost import estimate

    spec, cluster, plan = scored_inputs(args, "report")
    cost = estimate(spec, cluster, plan, args.seq, args.global_batch)
    measured = []
    if args.simulate:
        from autopar.cli.simulate_cmd import simulate_rank
        from autopar.views.report import simulated_rows

        measured = simulated_rows(simulate_rank(spec, cluster, plan, args.seq, args.global_batch,
                                                log=lambda msg: print(msg, file=sys.stderr, flush=True)))
    return cost, hardware_record(cluster), measured, f"{spec.name}: cost model ({cluster.gpu})"


def _measured_cost(args):
    from autopar.cli.measure_cmd import measured_cost
    from autopar.views.report import measured_memory_rows

    if args.simulate:
        raise AutoparError("autopar: --measure runs the model on this machine, --simulate a preset at full width on "
                           "the meta device; give one of them")
    cost, rows = measured_cost(args.measure, args.plan, args.world, args.hardware,
                               given=(("--model", args.model), ("--seq", args.seq),
                                      ("--global-batch", args.global_batch)))
    return cost, None, measured_memory_rows(rows, args.measure), f"{args.measure}, measured on this machine"


def run_report(args) -> int:
    """``autopar report``: score the plan, then write its page."""
    from autopar.views.report import plan_page
    from autopar.views.report_html import plan_html
    from autopar.views.report_plots import pyplot

    pyplot()  # matplotlib missing: say so before any work
    cost, hardware, measured, source = _measured_cost(args) if args.measure else _preset_cost(args)
    page = plan_page(cost, hardware=hardware, measured=measured, source=source)
    path = write_page(args.output, plan_html(page))
    print(f"autopar: wrote {path} ({os.path.getsize(path) / 1024:.0f} KiB): plan {cost.plan}, step "
          f"{cost.step_time:.4g} s, MFU {cost.mfu * 100:.1f}%, {cost.memory_per_gpu / 2**30:.2f} GiB per GPU")
    return 0
