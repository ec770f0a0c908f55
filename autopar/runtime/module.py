""":class:`ParallelModule`: one rank's compiled training program, assembled from its parts.

It holds the rewritten graph and assembles: the process groups (:mod:`autopar.runtime.mesh`), the
step context the program's operators read (:mod:`autopar.ops.step`), this rank's parameters
(:class:`autopar.runtime.weights.parameters.RankParameters`, cut from the user's full tensors), a
gradient-sync strategy (plain or ZeRO, :func:`autopar.runtime.gradients.zero.gradient_sync`), an
executor (flat or pipelined, :mod:`autopar.runtime.stepping.executors`,
:mod:`autopar.runtime.stepping.pipelined`) and the step environment it runs in
(:class:`autopar.runtime.stepping.environment.StepEnvironment`, with the loss split over pieces:
:class:`autopar.runtime.stepping.loss_split.LossSplit`).  One class serves every plan: the
executor says which parameters this rank holds and runs the micro-batches; everything else is
shared.  Nothing outside this file reads a private field of a ``ParallelModule``
(tests/unit/test_layers.py).

``train_step`` takes the *global* batch (the same on every rank; or with ``local=True``
this rank's part of it, see ``batch_slice`` and :mod:`autopar.runtime.stepping.data`), lets the
executor slice and run what this rank computes, synchronises gradients, steps the
optimizer and returns the global mean loss.  ``state_dict`` / ``load_state_dict`` speak full tensors under the
original model's names on every rank; ``checkpoint_state`` / ``load_checkpoint_state`` are
the same for the tensors this rank holds, with optimizer state and what a run needs to resume,
for :mod:`autopar.runtime.weights.checkpoint` (``save``, ``load``, ``wait_checkpoint``); both live in
:mod:`autopar.runtime.weights.state`.  The gradient-sync
strategy and the executor are typed by their protocols,
:class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer` and
:class:`autopar.runtime.stepping.executors.Executor`.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.ops import rng
from autopar.ops.step import StepContext, activate
from autopar.planning.autoplan import estimate_step, step_prediction
from autopar.runtime.devices import is_simulation, run_device
from autopar.runtime.faults import named_failures
from autopar.runtime.gradients.clipping import clip_gradients, norm_weights
from autopar.runtime.gradients.sync_protocol import GradientSynchronizer
from autopar.runtime.gradients.zero import gradient_sync
from autopar.runtime.mesh import build_groups
from autopar.runtime.stepping.data import BatchSlice
from autopar.runtime.stepping.environment import StepEnvironment, StepRecord
from autopar.runtime.stepping.executors import Executor, FlatExecutor
from autopar.runtime.stepping.loss_split import LossSplit
from autopar.runtime.stepping.shape_guards import ShapeGuards
from autopar.runtime.stepping.memory import MemoryMeter
from autopar.runtime.stepping.pipelined import PipelineExecutor
from autopar.runtime.stepping.precision import cast_inputs
from autopar.runtime.weights import checkpoint
from autopar.runtime.weights import state as module_state
from autopar.runtime.weights.checkpoint_writer import CheckpointWriter
from autopar.runtime.weights.initialize import check_initialized, initialize, initialize_buffers
from autopar.runtime.weights.parameters import RankParameters
from autopar.runtime.weights.pretrained import load_pretrained
from autopar.views.program import format_program

__all__ = ["ParallelModule"]


class ParallelModule:
    """One rank's compiled training program (see :func:`autopar.parallelize`).

    Assembled from parts with narrow interfaces: ``params`` (:class:`RankParameters`: the rank's
    tensors, their names, shards and values), ``grad_sync`` (the gradient-sync strategy), the
    ``executor`` (flat or pipelined) and the ``step_env`` it runs in (:class:`StepEnvironment`,
    with the loss split over pieces, :class:`LossSplit`), the ``memory`` meter, the
    ``checkpoint_writer``.  The modules of :mod:`autopar.runtime.weights` take ``params``."""

    def __init__(self, model: nn.Module, traced, program, plan, make_optimizer: Callable, *,
                 max_grad_norm: float | None = None, lr_scheduler: Callable | None = None,
                 masters_from: nn.Module | None = None, torch_compile_options: dict | None = None,
                 init_weights: Callable[[nn.Module], None] | None = None, fused_optimizer: bool = True):
        """``model``: the module that was traced; ``masters_from``: under mixed precision, the
        user's fp32 model whose tensors become the master weights (``model`` is its bf16 copy);
        ``fused_optimizer``: step flat tensors, fused where possible (:mod:`autopar.runtime.gradients.fused_step`)."""
        self.plan, self.gm, self.program = plan, traced.gm, program
        self.num_inputs = traced.num_inputs
        self._has_target = traced.has_target
        # torch.export's module checks its inputs against the traced ranges in a pre-hook; a rank's
        # inputs are its part of the batch (a cp rank's half of the sequence fails a scan's ``s >= 32``
        # that holds for the global batch), so the global shapes are checked instead (shape_guards.py)
        self.gm.validate_inputs = False
        self.shape_guards = ShapeGuards(getattr(traced, "input_guards", None),
                                        traced.example_inputs + ((traced.example_target,) if traced.has_target else ()),
                                        plan)
        tied_pp_ranks = program.pipeline.tied_pp_ranks() if program.pipeline is not None else ()
        self.groups = build_groups(plan, experts=bool(program.expert_params), tied_pp_ranks=tied_pp_ranks)
        self.step_context = StepContext(groups=self.groups)
        self.step_context.seed = rng.common_seed()  # rank 0's torch.initial_seed(), on every rank
        # Scale simulation: a full-size model on the meta device under a fake process group compiles
        # and steps without memory; comm_stats() still counts bytes (MoE blocks route evenly there:
        # autopar.ops.moe.balanced_counts).  Otherwise where this rank's program runs (devices.py).
        self.simulation = is_simulation(model)
        self.device = torch.device("meta") if self.simulation else run_device(traced.device)
        executor_type = PipelineExecutor if plan.pp > 1 else FlatExecutor
        self.executor: Executor = executor_type(self.gm, program, plan, torch_compile_options)
        self.params = RankParameters(model, self.gm, program, self.groups, device=self.device,
                                     traced_device=traced.device, simulation=self.simulation,
                                     holders=self.executor.holders, owner=self.executor.owner,
                                     masters_from=masters_from)
        self.mixed_precision = masters_from is not None
        originals = self.params.master_values(masters_from) if masters_from is not None else None
        self.grad_sync: GradientSynchronizer = gradient_sync(plan, self.params, program, make_optimizer,
                                                             fused_optimizer=fused_optimizer, originals=originals)
        self.params.bind(self.grad_sync)
        self.optimizer = self.grad_sync.optimizer
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self.num_steps_taken = 0  # optimizer steps taken, saved in checkpoints and restored by load
        self.checkpoint_writer = CheckpointWriter()  # its saves, one in flight (blocking=False)
        self.memory = MemoryMeter(masters_in_optimizer=self.mixed_precision)
        self.step_env = StepEnvironment(plan, self.device, self.params, self.grad_sync, self.memory,
                                        LossSplit(plan, program.structure.loss_reduction, self.device),
                                        self.mixed_precision, (traced.batch_symbol, traced.seq_symbol))
        self.step_record = StepRecord(plan, self._predict)
        self._norm_weights = self._clipping_weights()
        self.executor.setup(self.step_env)
        if init_weights is not None:
            initialize(self.params, model, init_weights)
        elif self.params.unset:
            initialize_buffers(self.params, model)  # a transformers model's rotary frequencies (no checkpoint has them)

    def _clipping_weights(self) -> dict[str, float]:
        """Each parameter's weight in the global gradient norm (:func:`norm_weights`)."""
        holders = max(1, self.plan.world_size // self.plan.pp) if self.groups else 1
        names = [n for n, _ in self.gm.named_parameters()]
        copies = {n: len(self.executor.holders(n) or (0,)) for n in names}  # the tied weight: on two pp ranks
        return norm_weights(self.program.param_shards, holders, {a: g.size for a, g in self.groups.items()},
                            names, copies)

    # --- where things are ---------------------------------------------------------------

    @property
    def size_symbols(self) -> tuple:
        """The graph's symbolic batch and sequence."""
        return self.step_env.size_symbols

    @property
    def checkpoint_names(self):
        """What loading needs of the user's model (:class:`autopar.runtime.weights.pretrained.CheckpointNames`)."""
        return self.params.checkpoint_names

    @property
    def last_step_stats(self) -> dict[str, Any]:
        """The last train_step's tokens, seconds, tokens/s, and the cost model's prediction for it."""
        return self.step_record.last

    @property
    def predicted_cost(self):
        """The cost model's estimate of this plan on this machine (:class:`autopar.cost.Cost`), made at
        the first step from its batch; None without hardware figures (a CPU without a hardware profile)."""
        return self.step_record.predicted_cost

    def coords(self) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (this rank's index on it, axis size)."""
        return self.params.coords()

    def holds(self, name: str) -> bool:
        """Whether this rank holds graph parameter or buffer ``name`` (pipeline ranks hold their chunks')."""
        return self.params.holds(name)

    def unset_names(self) -> list[str]:
        """Original names of the tensors still without values (a meta-built model not loaded yet)."""
        return self.params.unset_names()

    def load_pretrained(self, path) -> None:
        """Load a Hugging Face safetensors checkpoint (a model directory with ``model.safetensors`` or
        ``model.safetensors.index.json`` and its shards, or one ``.safetensors`` file) under the
        model's own names; each rank reads only the slices it holds (:mod:`autopar.runtime.weights.pretrained`)."""
        load_pretrained(self.params, path)
        check_initialized(self.params)

    # --- state dicts --------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded tensors under the original model's names (identical on every rank)."""
        return module_state.state_dict(self.params)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (from ``state_dict()`` of any plan, or of the original model)."""
        module_state.load_state_dict(self.params, state_dict)

    # --- checkpoints (autopar/runtime/weights/checkpoint.py does the I/O) --------------------------

    def checkpoint_state(self, data: Any = None, into: dict | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint entries this rank writes, copied to host memory, under plan-independent
        keys (collective; :func:`autopar.runtime.weights.state.checkpoint_state`)."""
        return module_state.checkpoint_state(self, data, into)

    def checkpoint_wants(self, key: str, data: Any = None) -> bool:
        """Whether this rank loads checkpoint entry ``key`` (its own parameters' entries, the training state)."""
        return module_state.checkpoint_wants(self, key, data)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor], data: Any = None) -> None:
        """Load what :meth:`checkpoint_state` wrote (under any plan) into this rank (collective)."""
        module_state.load_checkpoint_state(self, state, data)

    def save(self, path, blocking: bool = True, *, keep: int | None = None, data: Any = None,
             overlap_steps: int | None = None) -> None:
        """Checkpoint everything needed to resume at ``path`` (every rank; :mod:`autopar.runtime.weights.checkpoint`):
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
        (:mod:`autopar.runtime.weights.export`; call on every rank).  Returns the directory or file."""
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
        inputs = self._begin(inputs, target, local)
        start = time.perf_counter()
        coords = {a: g.rank for a, g in self.groups.items()}
        with activate(self.step_context):
            self.step_env.loss.count_valid_targets(target, local)
            self.memory.begin_step()
            out = self.executor.run(self.step_env, inputs, target, coords)
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
            total = self.step_env.loss.global_loss(out.loss)
        loss = float("nan") if total.is_meta else float(total)
        self.step_record.record(inputs, time.perf_counter() - start, local)
        return loss

    def eval_step(self, inputs: Sequence[Any], target: Any, *, local: bool = False) -> float:
        """The global mean loss of ``inputs`` in eval mode: no gradients kept, no update
        (``local``: this rank's part of the batch, as in :meth:`train_step`)."""
        with named_failures(self, "eval_step"):
            return self._eval_step(inputs, target, local)

    def _eval_step(self, inputs: Sequence[Any], target: Any, local: bool) -> float:
        inputs = self._begin(inputs, target, local)
        coords = {a: g.rank for a, g in self.groups.items()}
        with torch.no_grad(), activate(self.step_context, training=False), self.grad_sync.forward_only():
            self.step_env.loss.count_valid_targets(target, local)
            out = self.executor.evaluate(self.step_env, inputs, target, coords)
            total = self.step_env.loss.global_loss(out.loss)
        return float("nan") if total.is_meta else float(total)

    def _begin(self, inputs: Sequence[Any], target: Any, local: bool) -> tuple:
        """Checks before a step (every tensor has a value, the inputs' structure), and the step's mode."""
        check_initialized(self.params)
        inputs = tuple(inputs)
        if len(inputs) != self.num_inputs:
            raise AutoparError(f"autopar: got {len(inputs)} inputs; the model was traced with "
                               f"{self.num_inputs} (pass the same structure as example_inputs).")
        self.shape_guards.check(inputs, target if self._has_target else None, local)
        self.step_env.local_batch = local
        self.step_context.begin()
        return cast_inputs(inputs, torch.bfloat16 if self.mixed_precision else None)

    def batch_slice(self, global_batch_size: int, seq_len: int | None = None) -> BatchSlice:
        """Which part of a global batch this rank computes (rows; under cp, sequence positions),
        for ``train_step(..., local=True)``; see :mod:`autopar.runtime.stepping.data`."""
        return BatchSlice.for_rank(self.plan, {a: g.rank for a, g in self.groups.items()},
                                   global_batch_size, seq_len)

    def _predict(self, batch: int, seq: int):
        """The cost model's estimate of this plan at the step's sizes, and its step time, MFU and
        tokens/s, when the hardware is known: a GPU, or a CPU measured into ``$AUTOPAR_HARDWARE_PROFILE``."""
        width = next((dtype.itemsize for _, dtype in self.params.full_meta.values() if dtype.is_floating_point), 4)
        cost = estimate_step(self.program.structure, self.plan, seq, batch,
                             dtype_bytes=width)  # the precision the model trains in
        return cost, step_prediction(cost)

    # --- inspection ---------------------------------------------------------------------

    def comm_stats(self) -> list[dict]:
        """What the last step's collectives moved on this rank (the byte convention of docs/architecture.md)."""
        return [dict(r.__dict__) for r in self.step_context.recorder.records]

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank held in the last train_step: params, master_params, grads, optimizer,
        activations (peak saved for backward); definitions in autopar/runtime/stepping/memory.py."""
        return self.memory.report()

    def code(self, stage: int = 0) -> str:
        """The generated per-rank program of pipeline chunk ``stage``, readable, with every collective marked."""
        return format_program(self.executor.describe_stage(stage), self.program)

    def report(self, path, *, inputs=None) -> str:
        """Write this plan's page, the last step's measurements beside the prediction, as one HTML file
        (autopar/runtime/report.py; ``inputs``: a batch, where the program made no prediction)."""
        from autopar.runtime.report import write_report

        return write_report(self, path, inputs=inputs)

