"""The one pass runner: applies passes in order, lints the graph after each, recompiles once.

For every pass it lints the graph (``graph.lint()``), logs the wall time and the change in
op counts, and merges the pass's decisions into those the next pass sees; the module's
Python code is generated once (``gm.recompile()``), after the last pass of a run, or not at
all with ``recompile=False`` (no pass executes the module, and codegen of an 80-layer graph
costs as much as most passes: 0.1-0.2 s).  When a pass fails, the error names the pass and
the passes that ran before it, so a user (or a developer) knows where in the pipeline the
problem is.

Neighbours: the passes themselves (``passes/*.py``), :mod:`passes.context` for the pass
contract (inputs, decisions, results), :func:`default_passes` for the order the runtime uses,
:mod:`passes.compile` for the whole front half (cleanup, analysis, validation, passes).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Callable, Sequence

from torch.fx import GraphModule, Node

from autopar.errors import AutoparError, describe_node
from .context import CompiledProgram, Decisions, PassContext, PassInputs, PassResult
from .batch_propagation import batch_propagation_pass, needs_batch_propagation
from .context_parallel import context_parallel_pass
from .data_parallel import data_parallel_pass
from .dropout import dropout_pass, has_dropout
from .expert_parallel import expert_parallel_pass
from .pipeline import pipeline_pass
from .recompute import recompute_pass
from .sequence_parallel import sequence_parallel_pass
from .shard_propagation import shard_propagation_pass
from .tensor_parallel import tensor_parallel_pass
from .zero import zero3_pass

__all__ = ["run_passes", "default_passes", "op_counts", "failing_node"]

log = logging.getLogger("autopar.passes")

Pass = Callable[[GraphModule, PassContext], PassResult]


def op_counts(gm: GraphModule) -> collections.Counter:
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"
    )


def _diff(before: collections.Counter, after: collections.Counter) -> str:
    keys = sorted(set(before) | set(after))
    parts = [f"{k} {after[k] - before[k]:+d}" for k in keys if after[k] != before[k]]
    return ", ".join(parts) if parts else "no op-count change"


def run_passes(gm: GraphModule, inputs: PassInputs, passes: Sequence[Pass],
               decided: Decisions | None = None, *, recompile: bool = True) -> CompiledProgram:
    """Run ``passes`` in order on ``gm``; each sees the frozen inputs and the decisions before it.

    ``recompile=False`` leaves the module's code stale for a caller that runs more passes next.
    Returns the :class:`CompiledProgram`: the inputs, the merged decisions, and the log."""
    decided = decided if decided is not None else Decisions()
    done: list[str] = []
    lines: list[str] = []
    for p in passes:
        name = getattr(p, "__name__", str(p))
        before = op_counts(gm)
        start = time.perf_counter()
        try:
            result = p(gm, PassContext.of(inputs, decided))
            gm.graph.lint()
        except AutoparError as exc:
            ran = ", ".join(done) or "none"
            raise AutoparError(f"{exc}\n  (in pass {name}; passes that ran before it: {ran})") from exc
        except Exception as exc:  # a bug of the pass or a graph it does not understand: say where
            ran = ", ".join(done) or "none"
            node = failing_node(exc)
            where = f" at {describe_node(node)}" if node is not None else ""
            raise AutoparError(
                f"autopar: pass {name} failed{where}: {type(exc).__name__}: {exc}\n"
                f"  (passes that ran before it: {ran}). This is a gap in autopar, not in your model: please "
                "report it with this message; a plan without the dimension this pass implements avoids it.") from exc
        decided = decided.merge(result)
        elapsed = time.perf_counter() - start
        msg = f"{name}: {elapsed * 1e3:.1f} ms, {_diff(before, op_counts(gm))}"
        log.info(msg)
        lines.append(msg)
        done.append(name)
    if recompile:
        gm.recompile()
    fields = {f.name: getattr(PassContext.of(inputs, decided), f.name) for f in dataclasses.fields(PassContext)}
    return CompiledProgram(**fields, log=tuple(lines))


def failing_node(exc: BaseException) -> Node | None:
    """The graph node a failing pass was working on: the innermost frame of the traceback that
    holds an FX node in a local variable (passes name it ``node``, ``n``, ``user``, ...)."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, Node) and value.graph is not None:
                found = value
                break
        tb = tb.tb_next
    return found


def default_passes(plan, gm: GraphModule | None = None) -> list[Pass]:
    """The passes for ``plan`` after cleanup and analysis, in order (those of unused axes skipped;
    the dropout pass only when ``gm`` has a dropout that draws a mask, or ``gm`` is not given)."""
    passes: list[Pass] = []
    if plan.tp > 1:
        passes.append(tensor_parallel_pass)
        if plan.sp:
            passes.append(sequence_parallel_pass)
    passes.append(expert_parallel_pass)  # MoE experts -> dispatch / local experts / combine (any ep)
    passes.append(shard_propagation_pass)
    if plan.cp > 1:
        passes.append(context_parallel_pass)  # attention -> CP variant, positions -> global
    if needs_batch_propagation(plan):
        passes.append(batch_propagation_pass)  # statistics over the batch's rows -> all-reduced over dp
    if gm is None or has_dropout(gm):
        passes.append(dropout_pass)  # dropout -> its stream's generator, by placement
    passes.append(data_parallel_pass)  # gradient sync: dp, and axes where gradients are partial
    if plan.zero == 3:
        passes.append(zero3_pass)  # parameters gathered per unit before use
    if plan.recompute != "none":
        passes.append(recompute_pass)  # recomputed regions -> checkpointed bodies (before the cut)
    if plan.pp > 1:
        passes.append(pipeline_pass)  # last: cuts the rewritten graph into chunks
    return passes
