""":class:`ParallelModule`: one rank's compiled training program.

It owns the rewritten graph, this rank's parameters (cut from the user's full tensors),
the process groups (:mod:`autopar.runtime.mesh`), the step context the program's
operators read (:mod:`autopar.ops.step`), a gradient-sync strategy (plain or ZeRO,
:mod:`autopar.runtime.grad_sync`, :mod:`autopar.runtime.zero`) and an executor (flat or
pipelined, :mod:`autopar.runtime.executors`, :mod:`autopar.runtime.pipelined`).  One class
serves every plan: the executor says which parameters this rank holds and runs the
micro-batches; everything else is shared.

``train_step`` takes the *global* batch (the same on every rank; or with ``local=True``
this rank's part of it, see ``batch_slice`` and :mod:`autopar.runtime.data`), lets the
executor slice and run what this rank computes, synchronises gradients, steps the
optimizer and returns the global mean loss.  ``state_dict`` / ``load_state_dict`` speak full tensors under the
original model's names on every rank; ``checkpoint_state`` / ``load_checkpoint_state`` are
the same for the tensors this rank holds, with optimizer state and what a run needs to resume,
for :mod:`autopar.runtime.checkpoint` (``save``, ``load``, ``wait_checkpoint``); both live in
:mod:`autopar.runtime.state`.  The gradient-sync
strategy and the executor are typed by their protocols,
:class:`autopar.runtime.sync_protocol.GradientSynchronizer` and
:class:`autopar.runtime.executors.Executor`.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from autopar.compat import set_buffer
from autopar.errors import AutoparError
from autopar.ops import collectives, rng
from autopar.ops.step import StepContext, activate
from autopar.plan_space import data_axis
from autopar.passes.context import GradBucket
from autopar.runtime import checkpoint
from autopar.runtime import fused_step
from autopar.runtime import state as module_state
from autopar.planning.autoplan import estimate_step, step_prediction
from autopar.runtime.batching import global_sizes, local_microbatches, split_microbatches
from autopar.runtime.clipping import clip_gradients, norm_weights
from autopar.runtime.data import BatchSlice
from autopar.runtime.devices import (is_simulation, move_constants, retarget_devices, run_device,
                                     use_fused_attention)
from autopar.runtime.checkpoint_writer import CheckpointWriter
from autopar.runtime.executors import Executor, FlatExecutor
from autopar.runtime.faults import named_failures
from autopar.runtime.grad_sync import GradSync
from autopar.runtime.initialize import check_initialized, initialize, initialize_buffers
from autopar.runtime.layout import shard_local
from autopar.runtime.memory import MemoryMeter
from autopar.runtime.mesh import build_groups
from autopar.runtime.pipelined import PipelineExecutor
from autopar.runtime.precision import cast_inputs
from autopar.runtime.sync_protocol import GradientSynchronizer
from autopar.runtime.pretrained import CheckpointNames, load_pretrained
from autopar.runtime.zero import zero_sync
from autopar.views.program import format_program

__all__ = ["ParallelModule"]


class ParallelModule:
    """One rank's compiled training program (see :func:`autopar.parallelize`)."""

    _local_batch = False  # whether the current step was given this rank's part of the batch (local=True)
    _num_valid: int | None = None  # the step's global count of valid targets (a token-mean loss)

    def __init__(self, model: nn.Module, traced, program, plan, make_optimizer: Callable, *,
                 max_grad_norm: float | None = None, lr_scheduler: Callable | None = None,
                 masters_from: nn.Module | None = None, torch_compile_options: dict | None = None,
                 init_weights: Callable[[nn.Module], None] | None = None, fused_optimizer: bool = True):
        """``model``: the module that was traced; ``masters_from``: under mixed precision, the
        user's fp32 model whose tensors become the master weights (``model`` is its bf16 copy);
        ``fused_optimizer``: step flat tensors, fused where possible (:mod:`autopar.runtime.fused_step`)."""
        self.plan = plan
        self.gm = traced.gm
        self.program = program
        self.num_inputs = traced.num_inputs
        self.size_symbols = (traced.batch_symbol, traced.seq_symbol)  # the graph's symbolic batch and sequence
        tied_pp_ranks = program.pipeline.tied_pp_ranks() if program.pipeline is not None else ()
        self.groups = build_groups(plan, experts=bool(program.expert_params), tied_pp_ranks=tied_pp_ranks)
        self.step_context = StepContext(groups=self.groups)
        self.step_context.seed = rng.common_seed()  # rank 0's torch.initial_seed(), on every rank
        self.device = run_device(traced.device)  # where this rank's program runs (autopar/runtime/devices.py)
        self.simulation = is_simulation(model)
        if self.simulation:
            # Scale simulation: a full-size model on the meta device under a fake process group
            # compiles and steps without memory; comm_stats() still counts bytes.
            # MoE blocks route evenly there (no values to route by: autopar.ops.moe.balanced_counts).
            self.device = torch.device("meta")
        self._traced_device = traced.device
        # Graph names of parameters and buffers without values yet: a model built on the meta
        # device gets them from load_pretrained, init_weights, load or load_state_dict.
        self._unset: set[str] = set()
        self.executor: Executor
        if plan.pp > 1:
            self.executor = PipelineExecutor(self.gm, program, plan, torch_compile_options)
        else:  # torch_compile_options: torch.compile's arguments (autopar.runtime.inductor)
            self.executor = FlatExecutor(self.gm, program, plan, torch_compile_options)
        self._tensor_names = _original_names(model, self.gm, every_buffer=True)  # non-persistent buffers too
        state_keys = model.state_dict().keys()
        self._aliases = {k: v for k, v in self._tensor_names.items() if k in state_keys}
        self.checkpoint_names = CheckpointNames.of(model)  # what load_pretrained needs of the model
        self._full_meta = {name: (tuple(p.shape), p.dtype) for name, p in self.gm.named_parameters()}
        self._materialize()
        self._param_names = {n for n, _ in self.gm.named_parameters()}
        self.mixed_precision = masters_from is not None
        self._orig_dtypes = {k: v.dtype for k, v in (masters_from or model).state_dict().items()}
        originals = self._master_values(masters_from) if masters_from is not None else None
        buckets = self._held_buckets(program.grad_buckets)
        if tied_pp_ranks and self._pp_rank() in tied_pp_ranks:  # the embedding group sums the tied copies first
            tied = self.gm.get_parameter(program.pipeline.tied)
            buckets.insert(0, GradBucket("pp_embed", (program.pipeline.tied,), False,
                                         tied.numel() * tied.element_size()))
        self.grad_sync: GradientSynchronizer
        if plan.zero > 0:
            self.grad_sync = zero_sync(self.gm, program, buckets, self.groups,
                                       fused_step.flat_factory(make_optimizer, fused_optimizer),
                                       zero_stage=plan.zero, originals=originals)
        else:
            self.grad_sync = GradSync(self.gm, buckets, self.groups, make_optimizer, originals,
                                      fused_optimizer=fused_optimizer)
        self.optimizer = self.grad_sync.optimizer
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self.last_step_stats: dict[str, Any] = {}
        # Optimizer steps taken (train_step calls), saved in checkpoints and restored by load.
        self.num_steps_taken = 0
        self.checkpoint_writer = CheckpointWriter()  # its saves, one in flight (blocking=False)
        self._prediction: dict[str, float] | None = None
        # The cost model's estimate of this plan on this machine (autopar.cost.Cost), made at the first
        # step from its batch; None without hardware figures (a CPU without a hardware profile).
        self.predicted_cost = None
        holders = max(1, plan.world_size // plan.pp) if self.groups else 1
        names = [n for n, _ in self.gm.named_parameters()]
        copies = {n: len(self.executor.holders(n) or (0,)) for n in names}  # the tied weight: on two stages
        self._norm_weights = norm_weights(program.param_shards, holders, {a: g.size for a, g in self.groups.items()},
                                          names, copies)
        self.memory = MemoryMeter(masters_in_optimizer=self.mixed_precision)
        self.executor.setup(self)
        if init_weights is not None:
            initialize(self, model, init_weights)
        elif self._unset:
            initialize_buffers(self, model)  # a transformers model's rotary frequencies (no checkpoint has them)

    # --- where things are ---------------------------------------------------------------

    def coords(self) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (this rank's index on it, axis size)."""
        return {a: (g.rank, g.size) for a, g in self.groups.items()}

    def _pp_rank(self) -> int:
        return self.groups["pp"].rank if "pp" in self.groups else 0

    def holds(self, name: str) -> bool:
        """Whether this rank holds graph parameter or buffer ``name`` (pipeline stages hold their own)."""
        holders = self.executor.holders(name)
        return holders is None or self._pp_rank() in holders

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
        """This rank's parameters and buffers on its device, and the graph moved there
        (devices.py); a meta tensor outside the scale simulation becomes uninitialised memory of
        its local shape, listed in ``_unset`` until weights are loaded or initialised.  On the meta
        device (the scale simulation) attention runs the fused kernel a GPU would (devices.py)."""
        graphs = [self.gm] + [c.gm for c in (self.program.pipeline.chunks if self.program.pipeline is not None else ())]
        for graph in graphs:  # the program and the pipeline's own graphs
            retarget_devices(graph, self._traced_device, self.device)
            if self.device.type == "meta":
                use_fused_attention(graph)
        for chunk in graphs[1:]:
            _release_tensors(chunk, self.gm)
        move_constants(self.gm, self.device)
        coords = self.coords()
        for name, p in list(self.gm.named_parameters()):
            if not self.holds(name):
                *path, leaf = name.split(".")
                delattr(self.gm.get_submodule(".".join(path)), leaf)
                continue
            local = self._placed(name, shard_local(p.detach(), self.program.param_shards.get(name, {}), coords))
            _set_attr(self.gm, name, nn.Parameter(local, requires_grad=p.requires_grad))
        for name, b in list(self.gm.named_buffers()):
            _set_attr(self.gm, name, self._placed(name, b.detach()), buffer=True)

    def _placed(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if local.is_meta and not self.simulation:
            self._unset.add(name)
            return torch.empty(local.shape, dtype=local.dtype, device=self.device)
        return local.clone().to(self.device)

    # --- writing one tensor at a time (load_pretrained, init_weights) ----------------------

    def graph_name(self, orig: str) -> str | None:
        """The graph's name for the original model's parameter or buffer ``orig`` (None: not in the graph)."""
        return self._tensor_names.get(orig)

    def shards_of(self, name: str) -> dict:
        """How graph tensor ``name`` is cut over the mesh axes (``{}``: held whole)."""
        return self.program.param_shards.get(name, {})

    def write_local(self, name: str, local: torch.Tensor) -> None:
        """Set this rank's piece of graph parameter or buffer ``name`` (wherever the program keeps it:
        the parameter, its fp32 master, its piece of a ZeRO shard)."""
        local = local.to(self.device)
        if name in self._param_names:
            self.grad_sync.write_parameter(name, local)
        else:
            with torch.no_grad():
                module_state.get_attr(self.gm, name).copy_(local)
        self._unset.discard(name)

    def unset_names(self) -> list[str]:
        """Original names of the tensors still without values (a meta-built model not loaded yet)."""
        by_graph = {}
        for orig, name in self._tensor_names.items():
            by_graph.setdefault(name, orig)
        return sorted(by_graph.get(n, n) for n in self._unset)

    def load_pretrained(self, path) -> None:
        """Load a Hugging Face safetensors checkpoint (a model directory with ``model.safetensors`` or
        ``model.safetensors.index.json`` and its shards, or one ``.safetensors`` file) under the
        model's own names; each rank reads only the slices it holds (:mod:`autopar.runtime.pretrained`)."""
        load_pretrained(self, path)
        check_initialized(self)

    def _master_values(self, masters_from: nn.Module) -> dict[str, torch.Tensor]:
        """Graph name -> this rank's piece of the user's fp32 parameter (the master's first value)."""
        originals = dict(masters_from.named_parameters(remove_duplicate=False))
        coords = self.coords()
        out = {}
        for name, orig in module_state.graph_to_original(self).items():
            if orig in originals and self.holds(name):
                local = shard_local(originals[orig].detach(), self.program.param_shards.get(name, {}), coords)
                out[name] = (torch.empty(local.shape, dtype=torch.float32, device=self.device)
                             if local.is_meta and not self.simulation  # loaded later (_unset)
                             else local.to(device=self.device, dtype=torch.float32))
        return out

    # --- state dicts --------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded tensors under the original model's names (identical on every rank)."""
        return module_state.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (from ``state_dict()`` of any plan, or of the original model)."""
        module_state.load_state_dict(self, state_dict)

    # --- checkpoints (autopar/runtime/checkpoint.py does the I/O) --------------------------

    def checkpoint_state(self, data: Any = None, into: dict | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint entries this rank writes, copied to host memory, under plan-independent
        keys (collective; :func:`autopar.runtime.state.checkpoint_state`)."""
        return module_state.checkpoint_state(self, data, into)

    def checkpoint_wants(self, key: str, data: Any = None) -> bool:
        """Whether this rank loads checkpoint entry ``key`` (its own parameters' entries, the training state)."""
        return module_state.checkpoint_wants(self, key, data)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], data: Any = None) -> None:
        """Load what :meth:`checkpoint_state` wrote (under any plan) into this rank (collective)."""
        module_state.load_checkpoint_state(self, state, data)

    def save(self, path, blocking: bool = True, *, keep: int | None = None, data: Any = None,
             overlap_steps: int | None = None) -> None:
        """Checkpoint everything needed to resume at ``path`` (every rank; :mod:`autopar.runtime.checkpoint`):
        ``blocking=False`` returns once staged in host memory and writes in the background (for at
        most ``overlap_steps`` steps' forward and backward); ``keep``: then keep the ``keep`` newest
        of ``path``'s directory; ``data``: its position too."""
        with named_failures(self, "save"):
            checkpoint.save(self, path, blocking=blocking, keep=keep, data=data, overlap_steps=overlap_steps)

    def wait_checkpoint(self) -> None:
        """Wait for the save in flight to be written and switched in; raise what made it fail."""
        with named_failures(self, "save"):
            checkpoint.wait(self)

    def load(self, path, *, data: Any = None) -> None:
        """Read a checkpoint saved under any plan on any world size (every rank), and ``data``'s
        position; a damaged one, or one of another model, is refused by name before anything loads."""
        with named_failures(self, "load"):
            checkpoint.load(self, path, data=data)

    def export_weights(self, path, *, max_shard_size: int | str = "5GB") -> str:
        """Write the full weights under the original names as a Hugging Face directory (``config.json``,
        safetensors shards of at most ``max_shard_size`` and their index), or one file for a path
        ending in ``.safetensors``; each rank writes its own pieces, no rank gathers the model
        (:mod:`autopar.runtime.export`; call on every rank).  Returns the directory or file."""
        return checkpoint.export_safetensors(self, path, max_shard_size=max_shard_size)

    # --- training -----------------------------------------------------------------------

    def train_step(self, inputs: Sequence[Any], target: Any, *, local: bool = False) -> float:
        """One optimizer step on the global batch; returns the global mean loss.

        ``local=True``: ``inputs`` and ``target`` are this rank's part of the global batch
        (``self.batch_slice(...).take``), not the whole of it; the step is the same.  A peer that
        died or hangs raises an ``autopar:`` error naming this rank and the collective
        (:mod:`autopar.runtime.faults`)."""
        with named_failures(self, "train_step"):
            return self._train_step(inputs, target, local)

    def _train_step(self, inputs: Sequence[Any], target: Any, local: bool) -> float:
        check_initialized(self)
        inputs = self._check_inputs(inputs)
        self._local_batch = local
        start = time.perf_counter()
        self.step_context.begin()
        coords = {a: g.rank for a, g in self.groups.items()}
        with activate(self.step_context):
            self._count_valid_targets(target)
            self.memory.begin_step()
            out = self.executor.run(self, inputs, target, coords)
            self.memory.before_sync(self.gm, self.grad_sync)
            self.grad_sync.sync()
            # Only when clipping: the norm costs an all-reduce the cost model does not list.
            if self.max_grad_norm is not None and self.device.type != "meta":  # meta: no values
                self.last_grad_norm = clip_gradients(self.grad_sync, self._norm_weights, self.max_grad_norm,
                                                     self.groups, self.device)
            self.checkpoint_writer.before_update()  # a background save's overlap_steps end here
            self.grad_sync.step()
            self.num_steps_taken += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.memory.after_step(self.optimizer)
            # After the step: the loss all-reduce then runs behind ZeRO-1/2's after-step all-gathers
            # on the dp group (in practice train_step returns with them done).  Issued before the
            # gradient sync, it let them run past the step, and a gloo rank of the test pool then
            # crashed (SIGSEGV in test_memory_peak's many-unit ZeRO-2 job, once in CI; cause not found).
            total = self._global_loss(out.loss)
        loss = float("nan") if total.is_meta else float(total)
        self._record_stats(inputs, time.perf_counter() - start)
        return loss

    def eval_step(self, inputs: Sequence[Any], target: Any, *, local: bool = False) -> float:
        """The global mean loss of ``inputs`` in eval mode: no gradients kept, no update
        (``local``: this rank's part of the batch, as in :meth:`train_step`)."""
        with named_failures(self, "eval_step"):
            return self._eval_step(inputs, target, local)

    def _eval_step(self, inputs: Sequence[Any], target: Any, local: bool) -> float:
        check_initialized(self)
        inputs = self._check_inputs(inputs)
        self._local_batch = local
        self.step_context.begin()
        coords = {a: g.rank for a, g in self.groups.items()}
        with torch.no_grad(), activate(self.step_context, training=False), self.grad_sync.forward_only():
            self._count_valid_targets(target)
            out = self.executor.evaluate(self, inputs, target, coords)
            total = self._global_loss(out.loss)
        return float("nan") if total.is_meta else float(total)

    # --- the loss over uneven tokens (autopar/frontend/loss.py) --------------------------

    def _count_valid_targets(self, target: Any) -> None:
        """This step's global count of targets the loss averages over, for :meth:`loss_weight`;
        refuses a batch whose ignored targets a loss of unknown reduction would average wrongly."""
        self._num_valid = None
        reduction = self.program.structure.loss_reduction
        ignore = reduction.cross_entropy_ignore if reduction is not None else None
        pieces = self.plan.dp * self.plan.cp * self.plan.mb
        if ignore is None or not torch.is_tensor(target) or target.is_meta or pieces == 1:
            return  # (a meta-device scale simulation has no values to count)
        counts = torch.stack([(target != ignore).sum(), (target == ignore).any().long()]).to(torch.int64)
        data = self.plan.dp * self.plan.cp
        if self._local_batch and data > 1:  # each rank holds only its part: sum the counts (16 bytes)
            counts = collectives.loss_all_reduce(counts.to(self.device), data_axis(self.plan.cp),
                                       "valid-target count of the global batch")
        num_valid, any_ignored = (int(v) for v in counts.cpu())
        if reduction.kind == "token_sum":
            self._num_valid = -1  # a sum: every piece weighs the number of pieces (loss_weight)
            return
        if not reduction.token_mean:
            if any_ignored:
                raise AutoparError(
                    f"autopar: the targets of this batch contain ignore_index={ignore}, and the loss cannot be "
                    f"split over ranks exactly ({reduction.reason}): each of the {pieces} pieces of the batch "
                    "(dp x cp x mb) would divide by its own count of valid targets. Return "
                    "F.cross_entropy(logits.flatten(0, 1), target.flatten()) (mean over valid targets) from "
                    "loss_fn alone, or use a plan with dp = cp = mb = 1; see docs/troubleshooting.md.")
            return
        self._num_valid = num_valid

    def loss_weight(self, target: Any) -> float:
        """The factor on one piece's mean loss (a micro-batch of this rank) that makes the mean
        over pieces the global mean over valid targets: ``n_piece * pieces / n_global``; 1.0
        when every piece holds the same number of valid targets (an unpadded batch)."""
        pieces = self.plan.dp * self.plan.cp * self.plan.mb
        if self._num_valid == -1:  # a summed loss: the mean over pieces of pieces * sum is the sum
            return float(pieces)
        if self._num_valid is None or not self._num_valid or not torch.is_tensor(target):
            return 1.0
        ignore = self.program.structure.loss_reduction.ignore_index
        return int((target != ignore).sum()) * pieces / self._num_valid

    def _record_stats(self, inputs: tuple, seconds: float) -> None:
        tokens = int(inputs[0].numel()) if torch.is_tensor(inputs[0]) else 0
        if self._local_batch and tokens:  # the global batch's tokens, as in the global mode
            tokens *= self.plan.dp * (self.plan.cp if inputs[0].dim() > 1 else 1)
        self.last_step_stats = {"tokens": tokens, "seconds": seconds,
                                "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
                                **self._predicted(inputs)}

    def microbatches(self, inputs: tuple, target: Any, coords: dict[str, int]) -> list[tuple[tuple, Any]]:
        """This rank's micro-batches ``[(inputs, target), ...]`` of the batch given to the step
        (the global batch, or with ``local=True`` this rank's part of it)."""
        if self._local_batch:
            return split_microbatches(inputs, target, self.plan, self.device)
        return local_microbatches(inputs, target, self.plan, coords, self.device)

    def batch_slice(self, global_batch_size: int, seq_len: int | None = None) -> BatchSlice:
        """Which part of a global batch this rank computes (rows; under cp, sequence positions),
        for ``train_step(..., local=True)``; see :mod:`autopar.runtime.data`."""
        return BatchSlice.for_rank(self.plan, {a: g.rank for a, g in self.groups.items()},
                                   global_batch_size, seq_len)

    def _predicted(self, inputs: tuple) -> dict[str, float]:
        """The cost model's step time, MFU and tokens/s for this plan (:attr:`predicted_cost`), when the
        hardware is known: a GPU, or a CPU measured into ``$AUTOPAR_HARDWARE_PROFILE``."""
        if self._prediction is None:
            batch, seq = global_sizes(inputs, self.plan, local=self._local_batch)
            width = next((dtype.itemsize for _, dtype in self._full_meta.values() if dtype.is_floating_point), 4)
            self.predicted_cost = estimate_step(self.program.structure, self.plan, seq or 1, int(batch),
                                                dtype_bytes=width)  # the precision the model trains in
            self._prediction = step_prediction(self.predicted_cost)
        return self._prediction

    def _check_inputs(self, inputs: Sequence[Any]) -> tuple:
        inputs = tuple(inputs)
        if len(inputs) != self.num_inputs:
            raise AutoparError(f"autopar: got {len(inputs)} inputs; the model was traced with "
                               f"{self.num_inputs} (pass the same structure as example_inputs).")
        return cast_inputs(inputs, torch.bfloat16 if self.mixed_precision else None)

    def _global_loss(self, local: torch.Tensor | None) -> torch.Tensor:
        """The mean over data-parallel ranks of the ranks computing the loss, then shared over pp."""
        plan = self.plan
        total = local if local is not None else torch.zeros((), device=self.device)
        num_data = plan.dp * plan.cp
        if local is not None and num_data > 1:
            axis = data_axis(plan.cp)
            total = collectives.loss_all_reduce(total, axis, f"loss over {axis}") / num_data
        if plan.pp > 1:  # stages without the loss contribute 0
            total = collectives.loss_all_reduce(total, "pp", "loss over pp")
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

    def report(self, path, *, inputs=None) -> str:
        """Write this plan's page, the last step's measurements beside the prediction, as one HTML file
        (autopar/runtime/report.py; ``inputs``: a batch, where the program made no prediction)."""
        from autopar.runtime.report import write_report

        return write_report(self, path, inputs=inputs)


def _original_names(model: nn.Module, gm: nn.Module, every_buffer: bool = False) -> dict[str, str]:
    """Original state-dict key -> graph attribute name (tied weights share one attribute);
    ``every_buffer``: every parameter and buffer name, non-persistent buffers included."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    graph_names = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(
            gm.named_buffers(remove_duplicate=False)):
        for orig in by_id.get(id(t), []):
            graph_names[orig] = name
    if every_buffer:
        return graph_names
    return {k: graph_names[k] for k in model.state_dict() if k in graph_names}


def _set_attr(root: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = functools.reduce(getattr, path, root)
    if buffer:
        set_buffer(mod, leaf, value)
    else:
        setattr(mod, leaf, value)


def _release_tensors(gm: torch.fx.GraphModule, program_gm: nn.Module) -> None:
    """The pipeline pass's chunk module keeps its graph and tensor shapes but no memory: its
    parameters and buffers become meta tensors.  The runtime builds this rank's chunks on the
    placed local parameters (runtime/pipelined.py); the pass's modules only describe a stage
    (``describe_stage``, ``autopar inspect``) -- holding the original tensors there kept every
    chunk's weights, the whole model, alive on each pipeline rank.  A submodule the chunk shares
    with the program's module is left alone."""
    shared = {id(mod) for mod in program_gm.modules()}
    owner = lambda name: gm.get_submodule(name.rpartition(".")[0])  # noqa: E731
    for name, p in list(gm.named_parameters()):
        if id(owner(name)) not in shared:
            _set_attr(gm, name, nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
    for name, b in list(gm.named_buffers()):
        if id(owner(name)) not in shared:
            _set_attr(gm, name, b.detach().to("meta"), buffer=True)
