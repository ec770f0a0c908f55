"""State shared by the graph passes: the plan, the model structure, placements and results.

Every pass has the signature ``some_pass(gm, plan, ctx) -> PassResult`` (see
``passes/runner.py``).  Passes communicate only through the graph (node metadata) and
through :class:`PassContext`:

- ``param_shards``: how each parameter is laid out on each mesh axis (written by the TP pass,
  later by EP/ZeRO), which the runtime uses to cut the user's full tensors into local ones;
- ``grad_partial_axes``: axes over which a parameter's gradient is a partial sum (written
  by the shard-propagation pass, e.g. norm weights on sequence shards under SP);
- ``sharded_axes``: mesh axes whose placements vary inside the graph and are tracked by
  shard propagation (``tp`` today; data-parallel axes shard every tensor uniformly and
  need no tracking).

Provenance of every inserted node lives in ``node.meta["autopar"]`` (:func:`provenance`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from torch.fx import Node

__all__ = ["GradBucket", "ParamShard", "PassContext", "PassResult", "provenance", "META_KEY", "PLACEMENT_KEY"]

META_KEY = "autopar"
PLACEMENT_KEY = "autopar_placement"


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """A parameter sharded along ``dim``; ``blocks`` splits that dim into parts that are each
    sharded on their own (fused QKV / gate-up projections), so each rank keeps its heads of
    every part instead of a contiguous slice of the fused dimension."""

    dim: int
    blocks: tuple[int, ...] | None = None
    # Whole tensor on rank ``owner`` of the axis, empty (size 0 along ``dim``) elsewhere:
    # a ModuleList expert under expert parallelism.
    owner: int | None = None


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """Gradients synchronised by one collective after backward (written by the DP pass)."""

    axis: str
    params: tuple[str, ...]
    average: bool  # divide by the axis size (data parallel) or plain sum (partial gradients)
    num_bytes: int  # local bytes of the flattened bucket
    divisor: int | None = None  # divide by this instead of the axis size (expert gradients)


@dataclasses.dataclass
class PassContext:
    plan: Any  # autopar.plan.Plan
    structure: Any  # autopar.analyze.ModelStructure
    axis_sizes: dict[str, int]
    seq_symbol: Any = None
    batch_symbol: Any = None
    num_inputs: int = 1
    param_shards: dict[str, dict[str, ParamShard]] = dataclasses.field(default_factory=dict)
    grad_partial_axes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    sharded_axes: list[str] = dataclasses.field(default_factory=list)
    grad_buckets: list["GradBucket"] = dataclasses.field(default_factory=list)
    bucket_bytes: int = 25 * 1024 * 1024
    log: list[str] = dataclasses.field(default_factory=list)
    pipeline_split: tuple[int, ...] | None = None  # user-given layers per pipeline chunk
    pipeline: Any = None  # passes.pipeline.PipelineProgram, written by the pipeline pass
    expert_params: list[str] = dataclasses.field(default_factory=list)  # MoE experts (EP pass)

    def shard_param(self, name: str, axis: str, shard: ParamShard) -> None:
        self.param_shards.setdefault(name, {})[axis] = shard
        if axis not in self.sharded_axes:
            self.sharded_axes.append(axis)


@dataclasses.dataclass
class PassResult:
    name: str
    num_inserted: int = 0
    num_rewritten: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def provenance(node: Node, pass_name: str, axis: str | None, reason: str, **extra: Any) -> Node:
    """Record why ``node`` was inserted; the predicted bytes are filled in by shard propagation."""
    node.meta[META_KEY] = {"pass": pass_name, "axis": axis, "reason": reason, "bytes": None, **extra}
    return node
