""":class:`ParallelModule`: one rank's compiled training program.

It owns the rewritten graph, this rank's parameters (cut from the user's full tensors),
the process groups (:mod:`autopar.runtime.mesh`), the step context the program's
operators read (:mod:`autopar.ops.step`), a gradient-sync strategy (plain or ZeRO,
:mod:`autopar.runtime.grad_sync`, :mod:`autopar.runtime.zero`) and an executor (flat or
pipelined, :mod:`autopar.runtime.executors`, :mod:`autopar.runtime.pipelined`).  One class
serves every plan: the executor says which parameters this rank holds and runs the
micro-batches; everything else is shared.

``train_step`` takes the *global* batch (the same on every rank), lets the executor slice
and run what this rank computes, synchronises gradients, steps the optimizer and returns
the global mean loss.  ``state_dict`` / ``load_state_dict`` speak full tensors under the
original model's names on every rank; ``checkpoint_state`` / ``load_checkpoint_state`` are
the same for the tensors this rank holds, with optimizer state, for
:mod:`autopar.runtime.checkpoint`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.compat import set_buffer
from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops.step import StepContext, activate
from autopar.runtime import checkpoint
from autopar.runtime.checkpoint import MODEL_PREFIX, OPTIM_PREFIX
from autopar.runtime.executors import FlatExecutor
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.layout import gather_full, shard_local
from autopar.runtime.memory import MemoryMeter
from autopar.runtime.mesh import build_groups, local_device
from autopar.runtime.pipelined import PipelineExecutor
from autopar.runtime.zero import ZeroSync
from autopar.views.program import format_program

__all__ = ["ParallelModule"]


class ParallelModule:
    """One rank's compiled training program (see :func:`autopar.parallelize`)."""

    def __init__(self, model: nn.Module, traced, program, plan, make_optimizer: Callable):
        self.plan = plan
        self.gm = traced.gm
        self.program = program
        self.num_inputs = traced.num_inputs
        self.groups = build_groups(plan, experts=bool(program.expert_params))
        self.step_context = StepContext(groups=self.groups)
        self.device = local_device()
        if any(p.is_meta for p in model.parameters()):
            # Scale simulation: a full-size model on the meta device (with a fake process
            # group) compiles and steps without memory; comm_stats() still counts bytes.
            self.device = torch.device("meta")
            if program.expert_params:
                raise AutoparError(
                    "autopar: the model has mixture-of-experts blocks and its parameters are on the meta device; "
                    "token routing depends on the data, so a MoE step cannot run without values. Materialise the "
                    "model, or price the plan offline with autopar.estimate (routing_imbalance=...).")
        self.executor = (PipelineExecutor if plan.pp > 1 else FlatExecutor)(self.gm, program, plan)
        self._aliases = _original_names(model, self.gm)
        self._full_meta = {name: (tuple(p.shape), p.dtype) for name, p in self.gm.named_parameters()}
        self._materialize()
        buckets = self._held_buckets(program.grad_buckets)
        if plan.zero > 0:
            self.grad_sync = ZeroSync(self.gm, program, buckets, self.groups, make_optimizer, plan.zero)
        else:
            self.grad_sync = GradSync(self.gm, buckets, self.groups, make_optimizer)
        self.optimizer = self.grad_sync.optimizer
        self.memory = MemoryMeter()
        self.executor.setup(self)

    # --- where things are ---------------------------------------------------------------

    def coords(self) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (this rank's index on it, axis size)."""
        return {a: (g.rank, g.size) for a, g in self.groups.items()}

    def _pp_rank(self) -> int:
        return self.groups["pp"].rank if "pp" in self.groups else 0

    def holds(self, name: str) -> bool:
        """Whether this rank holds graph parameter or buffer ``name`` (pipeline stages hold their own)."""
        owner = self.executor.owner(name)
        return owner is None or owner == self._pp_rank()

    def _held_buckets(self, buckets) -> list:
        """The gradient buckets restricted to the parameters this rank holds (a bucket may span stages)."""
        out = []
        for b in buckets:
            params = tuple(p for p in b.params if self.holds(p))
            if params:
                nbytes = sum(self.gm.get_parameter(p).numel() * self.gm.get_parameter(p).element_size()
                             for p in params)
                out.append(dataclasses.replace(b, params=params, num_bytes=nbytes))
        return out

    def _materialize(self) -> None:
        coords = self.coords()
        for name, p in list(self.gm.named_parameters()):
            if not self.holds(name):
                *path, leaf = name.split(".")
                delattr(self.gm.get_submodule(".".join(path)), leaf)
                continue
            local = shard_local(p.detach(), self.program.param_shards.get(name, {}), coords)
            _set_attr(self.gm, name, nn.Parameter(local.clone().to(self.device), requires_grad=p.requires_grad))
        for name, b in list(self.gm.named_buffers()):
            _set_attr(self.gm, name, b.detach().clone().to(self.device), buffer=True)

    def _full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of graph parameter ``name`` from this rank's piece of it (collective over tp/ep)."""
        shards = self.program.param_shards.get(name, {})
        if not shards or local.dim() == 0:
            return local.clone()
        return gather_full(local.contiguous(), shards, self.groups, self.coords(),
                           self._full_meta[name][0]).clone()

    def _local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of graph parameter ``name`` cut from the full tensor."""
        if full.dim() == 0:
            return full.clone()
        return shard_local(full, self.program.param_shards.get(name, {}), self.coords()).to(self.device)

    # --- state dicts --------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded tensors under the original model's names (identical on every rank)."""
        out = {}
        with self.grad_sync.full_parameters():
            for orig, name in self._aliases.items():
                owner = self.executor.owner(name)
                if self.holds(name):
                    full = self._full(name, _get_attr(self.gm, name).detach())
                else:
                    shape, dtype = self._full_meta[name]
                    full = torch.empty(shape, dtype=dtype, device=self.device)
                if owner is not None and "pp" in self.groups and self.groups["pp"].size > 1:  # owner broadcasts
                    dist.broadcast(full, group=self.groups["pp"].group, group_src=owner)
                out[orig] = full
        return out

    def _check_keys(self, keys, needed) -> None:
        missing = sorted(set(needed) - set(keys))
        unexpected = sorted(set(keys) - set(self._aliases))
        if missing or unexpected:
            raise AutoparError(f"autopar: state dict does not match the model: missing keys {missing[:5]}"
                               f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                               f"{'...' if len(unexpected) > 5 else ''}; expected the original model's keys.")

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (from ``state_dict()`` of any plan, or of the original model)."""
        self._check_keys(state_dict, self._aliases)
        self._load_model_entries(state_dict)

    def _load_model_entries(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad(), self.grad_sync.full_parameters(write_back=True):
            for orig, name in self._aliases.items():
                if not self.holds(name):
                    continue
                target = _get_attr(self.gm, name)
                local = shard_local(state_dict[orig], self.program.param_shards.get(name, {}), self.coords())
                if local.shape != target.shape:
                    raise AutoparError(f"autopar: state dict entry '{orig}' has shape {tuple(state_dict[orig].shape)}; "
                                       f"expected the full shape of the original parameter.")
                target.copy_(local)

    # --- checkpoints (autopar/runtime/checkpoint.py does the I/O) --------------------------

    def _graph_to_original(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for orig, name in self._aliases.items():
            out.setdefault(name, orig)
        return out

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What this rank holds, as full tensors on the CPU under plan-independent keys:
        ``model.<name>`` for parameters and buffers, ``optim.<name>.<key>`` for optimizer state
        (collective: call on every rank)."""
        state = {}
        with self.grad_sync.full_parameters():
            for orig, name in self._aliases.items():
                if self.holds(name):
                    state[MODEL_PREFIX + orig] = self._full(name, _get_attr(self.gm, name).detach()).cpu()
        to_orig = self._graph_to_original()
        for name, entries in sorted(self.grad_sync.optimizer_state().items()):
            for key, value in sorted(entries.items()):
                value = value if torch.is_tensor(value) else torch.tensor(value)
                state[f"{OPTIM_PREFIX}{to_orig[name]}.{key}"] = self._full(name, value.detach()).cpu()
        return state

    def checkpoint_wants(self, key: str) -> bool:
        """Whether this rank loads checkpoint entry ``key`` (its own parameters' entries)."""
        if key.startswith(MODEL_PREFIX):
            name = self._aliases.get(key[len(MODEL_PREFIX):])
            return name is not None and self.holds(name)
        if key.startswith(OPTIM_PREFIX):
            orig = key[len(OPTIM_PREFIX):].rpartition(".")[0]
            name = self._aliases.get(orig)
            return name is not None and self.holds(name)
        return False

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`checkpoint_state` wrote (under any plan) into this rank (collective)."""
        model = {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
        self._check_keys(model, [o for o, n in self._aliases.items() if self.holds(n)])
        self._load_model_entries(model)
        entries: dict[str, dict[str, torch.Tensor]] = {}
        for name, orig in self._graph_to_original().items():
            prefix = f"{OPTIM_PREFIX}{orig}."
            found = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if found and self.holds(name):
                entries[name] = {key: self._local(name, v) for key, v in found.items()}
        self.grad_sync.load_optimizer_state(entries)

    def save(self, path) -> None:
        """Write model and optimizer state to ``path`` with torch.distributed.checkpoint (every rank)."""
        checkpoint.save(self, path)

    def load(self, path) -> None:
        """Read a checkpoint written by :meth:`save` under any plan (every rank)."""
        checkpoint.load(self, path)

    # --- training -----------------------------------------------------------------------

    def train_step(self, inputs: Sequence[Any], target: Any) -> float:
        """One optimizer step on the global batch; returns the global mean loss."""
        inputs = tuple(inputs)
        if len(inputs) != self.num_inputs:
            raise AutoparError(f"autopar: train_step got {len(inputs)} inputs; the model was traced with "
                               f"{self.num_inputs} (pass the same structure as example_inputs).")
        self.step_context.begin()
        coords = {a: g.rank for a, g in self.groups.items()}
        with activate(self.step_context):
            self.memory.begin_step()
            out = self.executor.run(self, inputs, target, coords)
            self.memory.before_sync(self.gm, self.grad_sync)
            self.grad_sync.sync_and_step()
            self.memory.after_step(self.optimizer)
            total = self._global_loss(out.loss)
        return float("nan") if total.is_meta else float(total)

    def _global_loss(self, local: torch.Tensor | None) -> torch.Tensor:
        """The mean over data-parallel ranks of the ranks computing the loss, then shared over pp."""
        plan = self.plan
        total = local if local is not None else torch.zeros((), device=self.device)
        num_data = plan.dp * plan.cp
        if local is not None and num_data > 1:
            axis = "dp_cp" if plan.cp > 1 else "dp"
            total = C.loss_all_reduce(total, axis, f"loss over {axis}") / num_data
        if plan.pp > 1:  # stages without the loss contribute 0
            total = C.loss_all_reduce(total, "pp", "loss over pp")
        return total

    # --- inspection ---------------------------------------------------------------------

    def comm_stats(self) -> list[dict]:
        """What the last step's collectives moved on this rank (the byte convention of docs/architecture.md)."""
        return [dict(r.__dict__) for r in self.step_context.recorder.records]

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank held in the last train_step: params, master_params, grads, optimizer,
        activations (peak saved for backward); definitions in autopar/runtime/memory.py."""
        return self.memory.report()

    def code(self, stage: int = 0) -> str:
        """The generated per-rank program of pipeline chunk ``stage``, readable, with every collective marked."""
        return format_program(self.executor.describe_stage(stage), self.program)


def _original_names(model: nn.Module, gm: nn.Module) -> dict[str, str]:
    """Original state-dict key -> graph attribute name (tied weights share one attribute)."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    graph_names = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(
            gm.named_buffers(remove_duplicate=False)):
        for orig in by_id.get(id(t), []):
            graph_names[orig] = name
    return {k: graph_names[k] for k in model.state_dict() if k in graph_names}


def _set_attr(root: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = functools.reduce(getattr, path, root)
    if buffer:
        set_buffer(mod, leaf, value)
    else:
        setattr(mod, leaf, value)


def _get_attr(root: nn.Module, name: str) -> torch.Tensor:
    return functools.reduce(getattr, name.split("."), root)
