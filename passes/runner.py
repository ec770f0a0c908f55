"""The one pass runner: applies passes in order, checks and recompiles after each.

For every pass it logs the wall time and the change in op counts, lints the graph and
recompiles the module.  When a pass fails, the error names the pass and the passes that
ran before it, so a user (or a developer) knows where in the pipeline the problem is.

Neighbours: the passes themselves (``passes/*.py``), :mod:`passes.context` for the shared
state, :func:`default_passes` for the order the runtime uses.
"""
from __future__ import annotations

import collections
import logging
import time
from typing import Callable, Sequence

from torch.fx import GraphModule

from autopar.errors import AutoparError
from .context import PassContext, PassResult

__all__ = ["run_passes", "default_passes", "op_counts"]

log = logging.getLogger("autopar.passes")

Pass = Callable[[GraphModule, object, PassContext], PassResult]


def op_counts(gm: GraphModule) -> collections.Counter:
    return collections.Counter(
        getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"
    )


def _diff(before: collections.Counter, after: collections.Counter) -> str:
    keys = sorted(set(before) | set(after))
    parts = [f"{k} {after[k] - before[k]:+d}" for k in keys if after[k] != before[k]]
    return ", ".join(parts) if parts else "no op-count change"


def run_passes(gm: GraphModule, plan, ctx: PassContext, passes: Sequence[Pass]) -> list[PassResult]:
    results: list[PassResult] = []
    done: list[str] = []
    for p in passes:
        name = getattr(p, "__name__", str(p))
        before = op_counts(gm)
        start = time.perf_counter()
        try:
            result = p(gm, plan, ctx)
            gm.graph.lint()
            gm.recompile()
        except AutoparError as exc:
            ran = ", ".join(done) or "none"
            raise AutoparError(f"{exc}\n  (in pass {name}; passes that ran before it: {ran})") from exc
        except Exception as exc:
            ran = ", ".join(done) or "none"
            raise RuntimeError(f"autopar: pass {name} failed (passes that ran before it: {ran}): {exc}") from exc
        elapsed = time.perf_counter() - start
        change = _diff(before, op_counts(gm))
        msg = f"{name}: {elapsed * 1e3:.1f} ms, {change}"
        log.info(msg)
        ctx.log.append(msg)
        results.append(result)
        done.append(name)
    return results


def default_passes(plan) -> list[Pass]:
    """The passes for ``plan``, in order (dimensions the plan does not use are skipped)."""
    from .cleanup import cleanup_pass
    from .data_parallel import data_parallel_pass
    from .sequence_parallel import sequence_parallel_pass
    from .shard_propagation import shard_propagation_pass
    from .tensor_parallel import tensor_parallel_pass

    passes: list[Pass] = [cleanup_pass]
    if plan.tp > 1:
        passes.append(tensor_parallel_pass)
        if plan.sp:
            passes.append(sequence_parallel_pass)
    from .expert_parallel import expert_parallel_pass

    passes.append(expert_parallel_pass)  # MoE experts -> dispatch / local experts / combine (any ep)
    passes.append(shard_propagation_pass)
    if plan.cp > 1:
        from .context_parallel import context_parallel_pass

        passes.append(context_parallel_pass)  # attention -> CP variant, positions -> global
    passes.append(data_parallel_pass)  # gradient sync: dp, and axes where gradients are partial
    if plan.zero == 3:
        from .zero import zero3_pass

        passes.append(zero3_pass)  # parameters gathered per unit before use
    if plan.pp > 1:
        from .pipeline import pipeline_pass

        passes.append(pipeline_pass)  # last: cuts the rewritten graph into chunks
    return passes
