"""Compile a model for a plan without a process group: trace, analyze, validate, run the passes.

:func:`compile_program` is the front half of ``autopar.parallelize`` and all of
``autopar inspect``: the user's model is traced with its loss (:mod:`autopar.frontend.trace`),
its structure found (:mod:`autopar.frontend.analyze`), the plan validated against it and
against what the runtime supports (:mod:`autopar.support`), and the graph rewritten by
the passes in :func:`passes.runner.default_passes`.  The runtime
(:mod:`autopar.runtime`) turns the result into one rank's program.
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Callable, Sequence

from autopar.errors import AutoparError, describe_node
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.plan import Plan
from autopar.plan_space import DEFAULT_BUCKET_BYTES
from autopar.support import check_runnable, check_supported, moe_needs_rewrite
from .causal_mask import causal_mask_pass
from .cleanup import cleanup_pass
from .context import PassInputs
from .runner import default_passes, run_passes

__all__ = ["compile_program", "DEFAULT_BUCKET_BYTES"]  # the default bucket cap: autopar.plan_space's


def compile_program(model, example_inputs: Sequence[Any], example_kwargs: dict | None,
                    plan: "str | Plan", loss_fn: Callable | None, *, world_size: int,
                    example_target: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    pipeline_split: Sequence[int] | None = None, upcast_outputs: bool = False):
    """Trace, clean up, analyze, validate and rewrite; no process group needed.

    Returns ``(traced, program)``: the traced model (its ``gm`` rewritten in place) and the
    :class:`passes.context.CompiledProgram` with every pass's decisions."""
    plan = Plan.parse(plan)
    check_supported(plan)
    traced = trace_model(model, example_inputs, example_kwargs, loss_fn, example_target, upcast_outputs)
    inputs = PassInputs(plan=plan, structure=None, axis_sizes=MappingProxyType({**plan.degrees, "ep": plan.ep}),
                        seq_symbol=traced.seq_symbol, batch_symbol=traced.batch_symbol,
                        num_inputs=traced.num_inputs, bucket_bytes=bucket_bytes,
                        pipeline_split=tuple(pipeline_split) if pipeline_split is not None else None)
    # Cleanup first, so the structure found next refers to the graph the passes rewrite; then
    # in-graph causal masks become is_causal (no s x s mask saved per layer).
    cleaned = run_passes(traced.gm, inputs, [cleanup_pass, causal_mask_pass], recompile=False)
    structure = analyze(traced.gm)
    _validate(plan, structure, world_size)
    program = run_passes(traced.gm, dataclasses.replace(inputs, structure=structure), default_passes(plan, traced.gm))
    return traced, dataclasses.replace(program, log=traced.log + cleaned.log + program.log)


def _validate(plan: Plan, structure, world_size: int) -> None:
    """The plan against the model's structure and what the runtime supports (``autopar:`` errors)."""
    if structure.moe_error is not None and moe_needs_rewrite(plan) and not _ep_only(plan, structure):
        raise structure.moe_error
    _check_dense_experts(plan, structure)
    check_runnable(plan, world_size=world_size, num_heads=structure.num_heads or None,
                   num_kv_heads=structure.num_kv_heads or None,
                   vocab=structure.vocab if structure.embeddings else None, num_experts=_num_experts(plan, structure),
                   tied=bool(structure.tied_embeddings and structure.lm_head))


def _num_experts(plan: Plan, structure) -> int:
    """The experts the plan checks ep against: the routed blocks', else under ep the dense blocks' (which only ep
    rewrites: without it they run as traced like any dense layer, recompute included)."""
    if structure.num_experts or plan.ep == 1 or not structure.dense_moe:
        return structure.num_experts
    return structure.dense_moe[0].num_experts


def _ep_only(plan: Plan, structure) -> bool:
    """Whether only ep asks for the experts rewrite and some block can take it: experts that cannot
    be cut out (``structure.moe_error``) then stay whole on every rank, run on its own tokens as
    under dp, while ep splits the blocks that can be."""
    return plan.tp == 1 and plan.capacity is None and bool(structure.moe)


def _check_dense_experts(plan: Plan, structure) -> None:
    """Experts that all run on every token (``analyze_moe.DenseExperts``) route no rows, so a capacity
    has none to drop: refused by name.  ep splits them (``passes/dense_expert_parallel.py``)."""
    if not structure.dense_moe or plan.capacity is None:
        return
    block = structure.dense_moe[0]
    raise AutoparError(
        f"autopar: capacity={plan.capacity!r} drops the tokens routed past an expert's capacity, but the "
        f"{block.num_experts} experts at {describe_node(block.node)} all run on every token (dense routing: "
        "the tokens repeated per expert, scaled by the router scores, one batched matmul over every "
        "expert), so no tokens are routed and none can be dropped. Use a plan without capacity (dp, ep, "
        "tp with sp, cp and pp run these experts exactly).")
