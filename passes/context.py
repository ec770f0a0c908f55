"""The pass contract: frozen inputs, frozen decisions so far, and a typed result per pass.

Every pass has the signature ``some_pass(gm, ctx: PassContext) -> PassResult`` (the runner
is ``passes/runner.py``).  ``ctx`` is frozen: the :class:`PassInputs` (plan, analysed
structure, symbols, options) and the :class:`Decisions` of the passes before it.  A pass
rewrites ``gm`` and returns what it decided in its :class:`PassResult` (parameter layouts,
partial gradients, gradient buckets, experts, the pipeline program); the runner merges
each result into the decisions the next pass sees, and returns one frozen
:class:`CompiledProgram` that the runtime builds a rank's program from.  Passes
communicate through the graph (node metadata) and these decisions only.

Provenance of every inserted node lives in ``node.meta["autopar"]`` (:func:`provenance`).
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any, Mapping

from torch.fx import Node

from autopar.plan_space import DEFAULT_BUCKET_BYTES

__all__ = ["GradBucket", "ParamShard", "PassInputs", "Decisions", "PassContext", "CompiledProgram", "PassResult",
           "Provenance", "provenance", "META_KEY", "PLACEMENT_KEY", "SOURCE_META", "COPIED_META"]

META_KEY = "autopar"
PLACEMENT_KEY = "autopar_placement"
# Where a node came from: the model module and the source line (errors and views name them).
SOURCE_META = ("nn_module_stack", "stack_trace")
# What a node that stands for another (the same value, rewritten or moved) takes over from it:
# its value and placements, and where it came from.
COPIED_META = ("val", PLACEMENT_KEY, "tensor_meta", *SOURCE_META, "source_fn_stack")


def _empty() -> Mapping:
    return MappingProxyType({})


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
    # Full size along ``dim`` when the axis does not divide it (a vocabulary tp does not divide):
    # each rank holds ceil(size/n) rows, the last ranks' rows past ``size`` are zero padding.
    size: int | None = None
    # Per block of ``blocks``: kept whole on every rank instead of sharded (a fused QKV's single
    # KV head under KV-head replication); None: every block sharded.
    whole: tuple[bool, ...] | None = None

    def local_blocks(self, n: int) -> tuple[int, ...]:
        """Each block's size along ``dim`` on one of ``n`` ranks."""
        whole = self.whole or (False,) * len(self.blocks or ())
        return tuple(b if w else b // n for b, w in zip(self.blocks or (), whole))


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """Gradients synchronised by one collective after backward (written by the DP pass)."""

    axis: str
    params: tuple[str, ...]
    average: bool  # divide by the axis size (data parallel) or plain sum (partial gradients)
    num_bytes: int  # local bytes of the flattened bucket
    divisor: int | None = None  # divide by this instead of the axis size (expert gradients)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassInputs:
    """What every pass reads and none writes: the plan, the analysed structure, the options."""

    plan: Any  # autopar.plan.Plan
    structure: Any  # autopar.frontend.analyze.ModelStructure (analysed after cleanup)
    axis_sizes: Mapping[str, int]
    seq_symbol: Any = None
    batch_symbol: Any = None
    num_inputs: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    pipeline_split: tuple[int, ...] | None = None  # user-given layers per pipeline chunk


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decisions:
    """What the passes decided so far (each pass sees those of the passes before it).

    ``param_shards``: parameter -> mesh axis -> layout (TP, EP), which the runtime uses to cut
    the user's full tensors; ``grad_partial_axes``: parameter -> axes over which its gradient
    is a partial sum (shard propagation; e.g. norm weights on sequence shards under SP);
    ``grad_buckets``: the gradient sync after backward (DP); ``expert_params``: MoE expert
    weights (EP); ``pipeline``: the cut program (PP)."""

    param_shards: Mapping[str, Mapping[str, ParamShard]] = dataclasses.field(default_factory=_empty)
    grad_partial_axes: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=_empty)
    grad_buckets: tuple[GradBucket, ...] = ()
    expert_params: tuple[str, ...] = ()
    pipeline: Any = None  # passes.pipeline.PipelineProgram
    # Mesh axes whose placements vary inside the graph and are tracked by shard propagation
    # (``tp``; data-parallel axes shard every tensor uniformly, whole experts need no tracking).
    sharded_axes: tuple[str, ...] = ()

    def merge(self, result: "PassResult") -> "Decisions":
        """These decisions plus ``result``'s (a later decision about the same thing adds to it)."""
        shards = {k: dict(v) for k, v in self.param_shards.items()}
        for name, axes in result.param_shards.items():
            shards.setdefault(name, {}).update(axes)
        partial = {k: set(v) for k, v in self.grad_partial_axes.items()}
        for name, axes in result.grad_partial_axes.items():
            partial.setdefault(name, set()).update(axes)
        return Decisions(
            param_shards=MappingProxyType({k: MappingProxyType(v) for k, v in shards.items()}),
            grad_partial_axes=MappingProxyType({k: frozenset(v) for k, v in partial.items()}),
            grad_buckets=self.grad_buckets + tuple(result.grad_buckets),
            expert_params=self.expert_params + tuple(p for p in result.expert_params if p not in self.expert_params),
            pipeline=result.pipeline if result.pipeline is not None else self.pipeline,
            sharded_axes=tuple(dict.fromkeys(self.sharded_axes + tuple(result.sharded_axes))))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassContext(PassInputs, Decisions):
    """A pass's view: its frozen inputs and the frozen decisions of the passes before it."""

    @classmethod
    def of(cls, inputs: PassInputs, decided: Decisions) -> "PassContext":
        fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(PassInputs)}
        fields.update({f.name: getattr(decided, f.name) for f in dataclasses.fields(Decisions)})
        return cls(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledProgram(PassContext):
    """The runner's result: the inputs, every pass's decisions, and the runner's log."""

    log: tuple[str, ...] = ()


@dataclasses.dataclass
class PassResult:
    """What one pass did to the graph (counts, notes) and what it decided (typed fields)."""

    name: str
    num_inserted: int = 0
    num_rewritten: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    param_shards: dict[str, dict[str, ParamShard]] = dataclasses.field(default_factory=dict)
    grad_partial_axes: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    grad_buckets: list[GradBucket] = dataclasses.field(default_factory=list)
    expert_params: list[str] = dataclasses.field(default_factory=list)
    pipeline: Any = None
    sharded_axes: list[str] = dataclasses.field(default_factory=list)

    def shard_param(self, name: str, axis: str, shard: ParamShard, *, propagate: bool = True) -> None:
        """Decide that parameter ``name`` is laid out as ``shard`` on mesh ``axis``; ``propagate``:
        shard propagation tracks placements on ``axis`` through the graph."""
        self.param_shards.setdefault(name, {})[axis] = shard
        if propagate and axis not in self.sharded_axes:
            self.sharded_axes.append(axis)


@dataclasses.dataclass
class Provenance:
    """Why a pass inserted or rewrote a node: ``node.meta["autopar"]``.

    ``bytes``: phase -> (collective, predicted bytes this rank sends, a sympy expression in the
    batch and sequence symbols), filled in by shard propagation (or by the pass itself for
    CP and EP); ``calls``: phase -> collectives issued per call when more than one; ``role``:
    what the node is to later passes (e.g. ``row_output``, which SP turns into a
    reduce-scatter); ``params``: the parameters a ZeRO-3 gather returns; ``routed``: what the
    routed-row symbols of ``bytes`` mean, when they depend on the realised MoE routing."""

    pass_name: str
    axis: str | None
    reason: str
    bytes: dict | None = None
    calls: dict | None = None
    role: str | None = None
    params: tuple[str, ...] = ()
    routed: str | None = None

    # Read access by key, as node metadata is usually read (``meta["axis"]``); "pass" is pass_name.
    def __getitem__(self, key: str) -> Any:
        return getattr(self, "pass_name" if key == "pass" else key)

    def get(self, key: str, default: Any = None) -> Any:
        value = self[key] if key == "pass" or key in self.__dataclass_fields__ else None
        return default if value is None else value


def provenance(node: Node, pass_name: str, axis: str | None, reason: str, **extra: Any) -> Node:
    """Record why ``node`` was inserted; the predicted bytes are filled in by shard propagation."""
    node.meta[META_KEY] = Provenance(pass_name=pass_name, axis=axis, reason=reason, **extra)
    return node
