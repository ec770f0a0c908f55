"""Emit and run: ``init_distributed``, ``parallelize`` and :class:`ParallelModule`.

``parallelize`` runs the whole pipeline on the user's (unmodified) model: trace with the
loss (:mod:`autopar.trace`), analyze (:mod:`autopar.analyze`), validate the plan
(:mod:`autopar.plan`), rewrite with the passes (``passes/``), then build the device mesh
and cut this rank's parameters out of the user's full tensors.

:class:`ParallelModule` owns the rewritten graph, the local parameters, the optimizer and
the gradient-sync buckets.  ``train_step`` takes the *global* batch (the same on every
rank), slices what this rank needs, runs forward/backward, synchronises gradients,
steps the optimizer and returns the global mean loss.  Neighbours: :mod:`autopar.batching`
(which samples and tokens this rank computes), :mod:`autopar.grad_sync` (gradient sync and
the optimizer step), :mod:`autopar.layout` (cutting and gathering parameters),
:mod:`autopar.program` (the readable program).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from autopar import collectives as C
from autopar.analyze import analyze
from autopar.batching import local_micro_batches
from autopar.errors import AutoparError
from autopar.grad_sync import GradSync
from autopar.layout import gather_full, shard_local
from autopar.plan import Plan
from autopar.trace import trace_model

__all__ = ["init_distributed", "compile_program", "parallelize", "ParallelModule", "MESH_AXES"]

MESH_AXES = ("pp", "dp", "cp", "tp")


def init_distributed(backend: str | None = None) -> None:
    """Initialise the default process group from torchrun's environment (NCCL on GPUs, else gloo)."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def _unsupported(plan: Plan) -> None:
    missing = []
    if plan.pp > 1 and (plan.cp > 1 or plan.ep > 1 or plan.zero > 0):
        missing.append(f"pp={plan.pp} together with cp, ep or zero")  # pp runs with dp, tp, sp
    if plan.zero > 0 and (plan.cp > 1 or plan.ep > 1):
        missing.append(f"zero={plan.zero} together with cp or ep")  # ZeRO shards over dp only
    if plan.recompute != "none":
        missing.append(f"recompute={plan.recompute}")
    if missing:
        raise AutoparError(
            f"autopar: plan '{plan}' uses {', '.join(missing)}, which the runtime does not support yet; "
            "the runtime supports dp, tp, sp, cp, ep (with dp, cp, tp, sp), zero (with dp, tp, sp), "
            "pp (with dp, tp, sp) and mb "
            "(gradient accumulation). The offline cost model and search (autopar plan / autopar.estimate) "
            "cover every dimension.")


def expert_groups(plan: Plan) -> dict[str, C.AxisGroup]:
    """The ``ep`` groups (ranks of one stage and tp index holding different tokens, ep consecutive
    dp*cp indices) and the ``edp`` groups (ranks holding the same experts: the other dp*cp/ep
    token slices times tp), built on every rank in the same order."""
    import numpy as np

    num_dc = plan.dp * plan.cp
    ranks = np.arange(plan.world_size).reshape(plan.pp, num_dc // plan.ep, plan.ep, plan.tp)
    ep_lists = ranks.transpose(0, 1, 3, 2).reshape(-1, plan.ep).tolist()
    edp_lists = ranks.transpose(0, 2, 1, 3).reshape(-1, num_dc // plan.ep * plan.tp).tolist()
    out = {}
    for axis, lists in (("ep", ep_lists), ("edp", edp_lists)):
        group, _ = dist.new_subgroups_by_enumeration(lists)
        size = len(lists[0])
        out[axis] = C.AxisGroup(group, size, dist.get_rank(group) if size > 1 else 0)
    return out


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def compile_program(model: nn.Module, example_inputs: Sequence[Any], example_kwargs: dict | None,
                    plan: str | Plan, loss_fn: Callable | None, *, world_size: int,
                    example_target: Any = None, bucket_bytes: int = 25 * 1024 * 1024,
                    pipeline_split: Sequence[int] | None = None):
    """Trace, analyze, validate and rewrite; no process group needed. Returns (traced, ctx)."""
    from autopar.passes.context import PassContext
    from autopar.passes.runner import default_passes, run_passes

    plan = Plan.parse(plan)
    _unsupported(plan)
    traced = trace_model(model, example_inputs, example_kwargs, loss_fn, example_target)
    structure = analyze(traced.gm)
    from autopar.passes.expert_parallel import needs_rewrite

    if structure.moe_error is not None and needs_rewrite(plan):
        raise structure.moe_error
    if structure.moe and needs_rewrite(plan) and (plan.pp > 1 or plan.zero > 0):
        raise AutoparError(
            f"autopar: plan '{plan}' splits the experts or tokens of a mixture-of-experts model (ep, tp or capacity) "
            "together with pp or zero, which the runtime does not combine yet; use ep, tp+sp and capacity with "
            "dp and cp, or pp / zero without them (every rank then runs every expert on its own tokens).")
    plan.validate(world_size=world_size, num_heads=structure.num_heads or None,
                  num_kv_heads=structure.num_kv_heads or None,
                  vocab=structure.vocab if plan.tp > 1 and structure.embeddings else None,
                  num_experts=structure.num_experts)
    if structure.moe and plan.tp > 1 and not plan.sp:
        raise AutoparError(
            f"autopar: plan '{plan}' uses tp={plan.tp} without sp on a mixture-of-experts model; MoE blocks "
            "run on each rank's sequence shard (experts are not split by tp), so add sp to the plan "
            f"('{dataclasses.replace(plan, sp=True)}'), as Megatron-Core also requires.")
    ctx = PassContext(plan=plan, structure=structure, axis_sizes={**plan.degrees, "ep": plan.ep},
                      seq_symbol=traced.seq_symbol, batch_symbol=traced.batch_symbol,
                      num_inputs=traced.num_inputs, bucket_bytes=bucket_bytes)
    ctx.pipeline_split = tuple(pipeline_split) if pipeline_split is not None else None
    run_passes(traced.gm, plan, ctx, default_passes(plan))
    return traced, ctx


def parallelize(
    model: nn.Module,
    example_inputs: Sequence[Any],
    example_kwargs: dict | None = None,
    plan: str | Plan = "none",
    loss_fn: Callable | None = None,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    *,
    example_target: Any = None,
    bucket_bytes: int = 25 * 1024 * 1024,
    pipeline_split: Sequence[int] | None = None,
) -> "ParallelModule":
    """Compile ``model`` for ``plan`` on the current process group; the model is not modified.

    ``loss_fn(output, target)`` is traced with the model; ``optimizer`` is a factory called
    with this rank's parameters (default: ``torch.optim.AdamW``).
    """
    if loss_fn is None:
        raise AutoparError("autopar: parallelize needs loss_fn(output, target) to train the model; "
                           "for a Hugging Face model, e.g. lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).")
    world, _ = _world()
    if isinstance(plan, str) and plan.strip().lower() == "auto":
        plan = _auto_plan(model, example_inputs, example_kwargs, loss_fn, example_target, world)
    traced, ctx = compile_program(model, example_inputs, example_kwargs, plan, loss_fn,
                                  world_size=world, example_target=example_target, bucket_bytes=bucket_bytes,
                                  pipeline_split=pipeline_split)
    if ctx.plan.pp > 1:  # pipeline_split: layers per pipeline chunk (default: balanced by the cost model)
        from autopar.pipeline_runtime import PipelineParallelModule

        return PipelineParallelModule(model, traced, ctx, ctx.plan, optimizer or torch.optim.AdamW)
    return ParallelModule(model, traced, ctx, ctx.plan, optimizer or torch.optim.AdamW)


def _auto_plan(model, example_inputs, example_kwargs, loss_fn, example_target, world: int) -> Plan:
    from autopar.autoplan import choose_plan

    structure = analyze(trace_model(model, example_inputs, example_kwargs, loss_fn, example_target).gm)
    ids = example_inputs[0]
    seq = ids.shape[1] if ids.dim() > 1 else 1
    return choose_plan(structure, world, seq, ids.shape[0], _unsupported)


class ParallelModule:
    """One rank's compiled training program (see :func:`parallelize`)."""

    def __init__(self, model: nn.Module, traced, ctx, plan: Plan, make_optimizer: Callable):
        self.plan = plan
        self.gm = traced.gm
        self.ctx = ctx
        self.num_inputs = traced.num_inputs
        self._recorder = C.CommRecorder()
        self._mesh = None
        self._groups: dict[str, C.AxisGroup] = {}
        if dist.is_initialized():
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            shape = tuple(plan.degrees[a] for a in MESH_AXES)
            self._mesh = init_device_mesh(device, shape, mesh_dim_names=MESH_AXES)
            self._groups = {
                a: C.AxisGroup(self._mesh.get_group(a), self._mesh.size(i), self._mesh.get_local_rank(a))
                for i, a in enumerate(MESH_AXES)
            }
            if plan.cp > 1:  # dense gradients and the loss are averaged over dp*cp (cost model axis "dp_cp")
                flat = self._mesh["dp", "cp"]._flatten("dp_cp")
                self._groups["dp_cp"] = C.AxisGroup(flat.get_group(), flat.size(), flat.get_local_rank())
            if ctx.expert_params:
                self._groups.update(expert_groups(plan))
        self.device = torch.device("cuda", torch.cuda.current_device()) if (
            dist.is_initialized() and dist.get_backend() == "nccl") else torch.device("cpu")
        if any(p.is_meta for p in model.parameters()):
            # Scale simulation: a full-size model on the meta device (with a fake process
            # group) compiles and steps without memory; comm_stats() still counts bytes.
            self.device = torch.device("meta")
            if ctx.expert_params:
                raise AutoparError(
                    "autopar: the model has mixture-of-experts blocks and its parameters are on the meta device; "
                    "token routing depends on the data, so a MoE step cannot run without values. Materialise the "
                    "model, or price the plan offline with autopar.estimate (routing_imbalance=...).")
        self._aliases = self._original_names(model)
        self._materialize(model)
        if plan.zero > 0:
            from autopar.zero import ZeroSync

            self._sync = ZeroSync(self.gm, ctx, self._groups, make_optimizer, plan.zero)
        else:
            self._sync = GradSync(self.gm, ctx, self._groups, make_optimizer)
        self.optimizer = self._sync.optimizer
        from autopar.memory import MemoryMeter

        self._memory = MemoryMeter()

    # --- parameters -------------------------------------------------------------------

    def _original_names(self, model: nn.Module) -> dict[str, str]:
        """Original state-dict key -> graph attribute name (tied weights share one attribute)."""
        by_id = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            by_id.setdefault(id(t), []).append(name)
        graph_names = {}
        for name, t in list(self.gm.named_parameters(remove_duplicate=False)) + list(
                self.gm.named_buffers(remove_duplicate=False)):
            for orig in by_id.get(id(t), []):
                graph_names[orig] = name
        return {k: graph_names[k] for k in model.state_dict() if k in graph_names}

    def _coords(self) -> dict[str, tuple[int, int]]:
        return {a: (g.rank, g.size) for a, g in self._groups.items()}

    def _materialize(self, model: nn.Module) -> None:
        coords = self._coords()
        self._full_shapes = {name: tuple(p.shape) for name, p in self.gm.named_parameters()}
        for name, p in list(self.gm.named_parameters()):
            local = shard_local(p.detach(), self.ctx.param_shards.get(name, {}), coords)
            new = nn.Parameter(local.clone().to(self.device), requires_grad=p.requires_grad)
            _set_attr(self.gm, name, new)
        for name, b in list(self.gm.named_buffers()):
            _set_attr(self.gm, name, b.detach().clone().to(self.device), buffer=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded tensors under the original model's names (identical on every rank)."""
        coords = self._coords()
        out = {}
        with self._sync.full_parameters():
            for orig, name in self._aliases.items():
                t = _get_attr(self.gm, name).detach()
                shards = self.ctx.param_shards.get(name, {})
                out[orig] = gather_full(t, shards, self._groups, coords,
                                        self._full_shapes.get(name)).clone() if shards else t.clone()
        return out

    def _check_keys(self, state_dict: dict) -> None:
        missing = sorted(set(self._aliases) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(self._aliases))
        if missing or unexpected:
            raise AutoparError(f"autopar: state dict does not match the model: missing keys {missing[:5]}"
                               f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                               f"{'...' if len(unexpected) > 5 else ''}; expected the original model's keys.")

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (from ``state_dict()`` of any plan, or of the original model)."""
        self._check_keys(state_dict)
        coords = self._coords()
        with torch.no_grad(), self._sync.full_parameters(write_back=True):
            for orig, name in self._aliases.items():
                target = _get_attr(self.gm, name)
                local = shard_local(state_dict[orig], self.ctx.param_shards.get(name, {}), coords)
                if local.shape != target.shape:
                    raise AutoparError(f"autopar: state dict entry '{orig}' has shape {tuple(state_dict[orig].shape)}; "
                                       f"expected the full shape of the original parameter.")
                target.copy_(local)

    # --- training ---------------------------------------------------------------------

    def _begin_step(self, inputs: Sequence[Any]) -> tuple[tuple, dict[str, int]]:
        """Check the inputs, reset the step's comm records; return the inputs and this rank's coordinates."""
        inputs = tuple(inputs)
        if len(inputs) != self.num_inputs:
            raise AutoparError(f"autopar: train_step got {len(inputs)} inputs; the model was traced with "
                               f"{self.num_inputs} (pass the same structure as example_inputs).")
        self._recorder.clear()
        return inputs, {a: g.rank for a, g in self._groups.items()}

    def train_step(self, inputs: Sequence[Any], target: Any) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""
        inputs, coords = self._begin_step(inputs)
        with C.use_groups(self._groups, self._recorder):
            total = torch.zeros((), device=self.device)
            self._memory.begin_step()
            for chunk_inputs, chunk_target in local_micro_batches(inputs, target, self.plan, coords, self.device):
                # ZeRO: per-micro-batch gathers / reduce-scatters; the meter counts saved activations.
                with self._memory.micro_batch(self.gm), self._sync.micro_batch():
                    loss = self.gm(*chunk_inputs, chunk_target)
                    (loss / self.plan.mb).backward()
                total += loss.detach().float() / self.plan.mb
            self._memory.before_sync(self.gm, self._sync)
            self._sync.sync_and_step()
            self._memory.after_step(self.optimizer)
            loss_axis = "dp_cp" if self.plan.cp > 1 else "dp"
            if self.plan.dp * self.plan.cp > 1:
                total = C.all_reduce(total, loss_axis, "loss") / (self.plan.dp * self.plan.cp)
                self._relabel_last("loss")
        return float("nan") if total.is_meta else float(total)

    def _relabel_last(self, phase: str) -> None:
        last = self._recorder.records[-1]
        self._recorder.records[-1] = C.CommRecord(**{**last.__dict__, "phase": phase})

    # --- inspection -------------------------------------------------------------------

    def comm_stats(self) -> list[dict]:
        """What the last step's collectives moved on this rank (DESIGN.md byte convention)."""
        return [dict(r.__dict__) for r in self._recorder.records]

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank held in the last train_step: params, master_params, grads, optimizer,
        activations (peak saved for backward); definitions in autopar/memory.py."""
        return self._memory.report()

    # --- checkpoints (autopar/checkpoint.py) ------------------------------------------------

    def save(self, path) -> None:
        """Write model and optimizer state to ``path`` with torch.distributed.checkpoint (every rank)."""
        from autopar.checkpoint import save

        save(self, path)

    def load(self, path) -> None:
        """Read a checkpoint written by :meth:`save` under any plan (every rank)."""
        from autopar.checkpoint import load

        load(self, path)

    def code(self, stage: int = 0) -> str:
        """The generated per-rank program, readable, with every collective marked."""
        from autopar.program import format_program

        if stage != 0:
            raise AutoparError(f"autopar: stage {stage} does not exist; plan '{self.plan}' has 1 pipeline stage (0).")
        return format_program(self.gm, self.ctx)


def _set_attr(root: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = functools.reduce(getattr, path, root)
    if buffer:
        mod._buffers[leaf] = value  # keeps the buffer's persistence flag
    else:
        setattr(mod, leaf, value)


def _get_attr(root: nn.Module, name: str) -> torch.Tensor:
    return functools.reduce(getattr, name.split("."), root)

