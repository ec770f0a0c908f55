"""``autopar inspect MODULE:FUNCTION --plan PLAN [--world N] --rank R`` (N: the plan's world size by default).

Compiles a model for a plan in one process, without a cluster or process group, and
prints the generated program of one rank with every collective marked (op, mesh axis,
local shape, predicted bytes), followed by one summary line per collective kind.

``FUNCTION()`` returns ``(model, example_inputs)`` or ``(model, example_inputs,
example_kwargs)``; ``MODULE`` is a file path (``examples/model.py``) or an importable
module name.  The loss traced with the model is cross-entropy of its logits against a
target shaped like the first input (``--loss none`` traces the model alone).
"""
from __future__ import annotations

import argparse

from autopar.errors import AutoparError
from autopar.frontend.target import load_target  # re-exported: measure_cmd and plan_cmd import it here

__all__ = ["register", "load_target", "lm_cross_entropy", "run_inspect", "world_of"]


def lm_cross_entropy(output, target):
    """Cross-entropy of a language model's logits (a tensor or an object with ``.logits``)."""
    import torch.nn.functional as F  # here, not at the top: `autopar plan` never loads torch

    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def run_inspect(spec: str, plan: str, world_size: int, rank: int, loss: str = "ce", schedule: bool = False) -> str:
    import torch

    from autopar.passes.compile import compile_program
    from autopar.plan import Plan
    from autopar.runtime.mesh import MESH_AXES
    from autopar.views.program import format_program

    p = Plan.parse(plan)
    if not 0 <= rank < world_size:
        raise AutoparError(f"autopar: --rank {rank} is outside the world of {world_size} ranks (0..{world_size - 1}).")
    model, inputs, kwargs = load_target(spec)
    loss_fn = lm_cross_entropy if loss == "ce" else None
    with torch.no_grad():
        traced, ctx = compile_program(model, inputs, kwargs, p, loss_fn, world_size=world_size)
    coords, rest = {}, rank
    for axis in reversed(MESH_AXES):
        coords[axis] = rest % p.degrees[axis]
        rest //= p.degrees[axis]
    coords = {a: coords[a] for a in MESH_AXES}
    if ctx.pipeline is None:
        text = format_program(traced.gm, ctx, rank_coords={"rank": rank, **coords})
    else:  # this rank's pipeline chunks
        text = "\n\n".join(f"# pipeline chunk {c} (layers {list(ctx.pipeline.chunks[c].layers)})\n"
                             + format_program(ctx.pipeline.chunks[c].gm, ctx, rank_coords={"rank": rank, **coords})
                             for c in ctx.pipeline.rank_chunks(coords["pp"]))
    if schedule:
        from autopar.views.schedule import format_schedule

        text += "\n\n" + format_schedule(p)
    return text


def world_of(plan: str, world: int | None) -> int:
    """``--world``, or when it is omitted the plan's world size (the product of its degrees)."""
    from autopar.plan import Plan

    return Plan.parse(plan).world_size if world is None else world


def _cmd(args: argparse.Namespace) -> int:
    print(run_inspect(args.target, args.plan, world_of(args.plan, args.world), args.rank, args.loss, args.schedule))
    return 0


def register(sub) -> None:
    p = sub.add_parser("inspect", help="print one rank's generated program with its collectives marked",
                       description="Compile a model for a plan in this process (no cluster, no process group) and "
                                   "print one rank's generated program, every collective marked with its mesh axis, "
                                   "local shape and predicted bytes, then one summary line per collective kind.")
    p.add_argument("target", help="MODULE:FUNCTION returning (model, example_inputs[, example_kwargs])")
    p.add_argument("--plan", required=True, help="plan text, e.g. tp=2,sp")
    p.add_argument("--world", type=int, default=None,
                   help="number of ranks (default: the plan's pp*dp*cp*tp; if given, it must equal that)")
    p.add_argument("--rank", type=int, default=0, help="which rank's program to print")
    p.add_argument("--loss", choices=("ce", "none"), default="ce",
                   help="trace cross-entropy of the logits with the model (default) or the model alone")
    p.add_argument("--schedule", action="store_true",
                   help="also print the pipeline schedule's step x rank grid (F, B, W per micro-batch)")
    p.set_defaults(func=_cmd)
