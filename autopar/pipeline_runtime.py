"""Run a pipelined program: the chunks of ``passes/pipeline.py`` under ``torch.distributed.pipelining``.

:class:`PipelineParallelModule` is the :class:`autopar.runtime.ParallelModule` of a plan with
``pp > 1``.  Each rank keeps the parameters of its own chunks only (chunk ``c`` lives on
pipeline rank ``ctx.pipeline.chunk_rank(c)``: looped for gpipe / 1f1b / interleaved,
V-shaped for zbv / dualpipev), wraps each chunk in a :class:`_RecordingStage` (a
``PipelineStage`` that records the bytes of every P2P send and receive it posts) and drives
them with the plan's schedule (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``).

The loss: the last chunk computes it in-graph from the ``target`` keyword micro-batch
(every stage receives the model inputs and the target as keyword micro-batches, see the
pass), so the schedule's ``loss_fn`` is the identity and ``scale_grads`` divides the
gradients by the micro-batch count (the mean over micro-batches).

``train_step``: this rank's data-parallel slice -> ``schedule.step`` (forward and backward
of ``mb`` micro-batches) -> gradient sync of this rank's parameters (:mod:`autopar.grad_sync`,
buckets restricted to them) and one optimizer step -> the loss: mean over micro-batches on
the last stage, all-reduced over ``dp`` there, then all-reduced over ``pp`` (the other
stages contribute 0) so every rank returns it; both are recorded with phase ``loss``.

``state_dict`` gathers each parameter on its owning stage (over tp) and broadcasts it over
``pp``, so every rank returns the full state dict under the original names.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

from autopar import collectives as C
from autopar.batching import local_micro_batches
from autopar.errors import AutoparError
from autopar.grad_sync import GradSync
from autopar.layout import gather_full, shard_local
from autopar.runtime import ParallelModule, _get_attr, _set_attr

__all__ = ["PipelineParallelModule", "SCHEDULE_CLASSES"]

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                    "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}


def _identity_loss(output, target):
    return output


def _record_p2p(ops, phase: str, stage_index: int) -> None:
    rec = C.recorder()
    size = C.axis_size("pp")
    for op in ops:
        t = op.tensor
        nbytes = float(t.numel() * t.element_size())
        send = op.op in (dist.isend, dist.send)
        kind = "send" if send else "recv"
        what = "activation" if phase == "fwd" else "input grad"
        rec.records.append(C.CommRecord(kind, "pp", size, nbytes if send else 0.0, 0.0 if send else nbytes,
                                        phase, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                        f"stage {stage_index} {what} {kind}"))


class _RecordingStage(PipelineStage):
    """A PipelineStage that records every P2P buffer it posts (DESIGN.md: P2P moves the buffer)."""

    def get_fwd_recv_ops(self, fwd_chunk_id):
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        _record_p2p(ops, "fwd", self.stage_index)
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        _record_p2p(ops, "fwd", self.stage_index)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id):
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        _record_p2p(ops, "bwd", self.stage_index)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        _record_p2p(ops, "bwd", self.stage_index)
        return ops


class PipelineParallelModule(ParallelModule):
    """One rank's share of a pipelined program (see the module docstring)."""

    def __init__(self, model: nn.Module, traced, ctx, plan, make_optimizer):
        self._program = ctx.pipeline
        self._full_meta = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        super().__init__(model, traced, ctx, plan, make_optimizer)
        owned = set(self._owned_params)
        buckets = []
        for b in ctx.grad_buckets:
            params = tuple(p for p in b.params if p in owned)
            if params:
                nbytes = sum(self.gm.get_parameter(p).numel() * self.gm.get_parameter(p).element_size()
                             for p in params)
                buckets.append(dataclasses.replace(b, params=params, num_bytes=nbytes))
        self._sync = GradSync(self.gm, dataclasses.replace(ctx, grad_buckets=buckets), self._groups,
                              make_optimizer)
        self.optimizer = self._sync.optimizer
        self._schedule = self._build_schedule() if dist.is_initialized() else None

    # --- parameters -------------------------------------------------------------------

    def _pp_rank(self) -> int:
        return self._groups["pp"].rank if "pp" in self._groups else 0

    def _materialize(self, model: nn.Module) -> None:
        program = self._program
        self._chunk_ids = program.rank_chunks(self._pp_rank())
        owner = program.param_chunk()
        self._owner_rank = {p: program.chunk_rank(c) for p, c in owner.items()}
        self._owned_params = [p for p, r in self._owner_rank.items() if r == self._pp_rank()]
        coords = self._coords()
        for name, p in list(self.gm.named_parameters()):
            if name not in self._owned_params:
                *path, leaf = name.split(".")
                delattr(self.gm.get_submodule(".".join(path)), leaf)
                continue
            local = shard_local(p.detach(), self.ctx.param_shards.get(name, {}), coords)
            _set_attr(self.gm, name, nn.Parameter(local.clone().to(self.device), requires_grad=p.requires_grad))
        for name, b in list(self.gm.named_buffers()):
            _set_attr(self.gm, name, b.detach().clone().to(self.device), buffer=True)
        # Rebuild this rank's chunks on the local parameters (the pass's chunks hold the user's).
        self._chunks = {c: torch.fx.GraphModule(self.gm, program.chunks[c].gm.graph) for c in self._chunk_ids}

    def _build_schedule(self):
        program, plan = self._program, self.plan
        pp_group = self._groups["pp"].group
        stages = [_RecordingStage(self._chunks[c], c, len(program.chunks), self.device, group=pp_group)
                  for c in self._chunk_ids]
        cls = SCHEDULE_CLASSES[plan.schedule]
        if plan.schedule in ("gpipe", "1f1b"):
            return cls(stages[0], n_microbatches=plan.mb, loss_fn=_identity_loss, scale_grads=True)
        return cls(stages, n_microbatches=plan.mb, loss_fn=_identity_loss, scale_grads=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original names on every rank (owners broadcast over pp)."""
        coords = self._coords()
        pp = self._groups["pp"]
        out = {}
        for orig, name in self._aliases.items():
            owner = self._owner_rank.get(name)
            if owner is None:  # buffer: every rank holds it
                out[orig] = _get_attr(self.gm, name).detach().clone()
                continue
            if owner == pp.rank:
                t = _get_attr(self.gm, name).detach()
                shards = self.ctx.param_shards.get(name, {})
                full = gather_full(t, shards, self._groups, coords).clone() if shards else t.clone()
            else:
                shape, dtype = self._full_meta[orig]
                full = torch.empty(shape, dtype=dtype, device=self.device)
            if pp.size > 1:
                dist.broadcast(full, group=pp.group, group_src=owner)
            out[orig] = full
        return out

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._check_keys(state_dict)
        coords = self._coords()
        with torch.no_grad():
            for orig, name in self._aliases.items():
                owner = self._owner_rank.get(name)
                if owner is not None and owner != self._pp_rank():
                    continue
                target = _get_attr(self.gm, name)
                local = shard_local(state_dict[orig], self.ctx.param_shards.get(name, {}), coords)
                if local.shape != target.shape:
                    raise AutoparError(f"autopar: state dict entry '{orig}' has shape "
                                       f"{tuple(state_dict[orig].shape)}; expected the full shape of the "
                                       "original parameter.")
                target.copy_(local)

    # --- training ---------------------------------------------------------------------

    def train_step(self, inputs, target) -> float:
        inputs, coords = self._begin_step(inputs)
        pieces = local_micro_batches(inputs, target, self.plan, coords, self.device)
        local_inputs = [torch.cat([p[0][i] for p in pieces]) for i in range(self.num_inputs)]
        local_target = torch.cat([p[1] for p in pieces])
        kwargs = dict(zip(self._program.kwarg_names, local_inputs + [local_target]))
        last = self._program.chunk_rank(len(self._program.chunks) - 1) == self._pp_rank()
        losses: list = []
        with C.use_groups(self._groups, self._recorder):
            self._schedule.step(target=local_target if last else None, losses=losses, return_outputs=False,
                                **kwargs)
            self._sync.sync_and_step()
            total = torch.zeros((), device=self.device)
            if last:
                total = torch.stack([l.detach().float() for l in losses]).mean()
                if self.plan.dp > 1:
                    total = self._loss_all_reduce(total, "dp") / self.plan.dp
            total = self._loss_all_reduce(total, "pp")
        return float(total)

    def _loss_all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor:
        t = t.clone()
        C.record("all_reduce", axis, t, "loss", f"loss over {axis}")
        dist.all_reduce(t, group=self._groups[axis].group)
        return t

    # --- inspection -------------------------------------------------------------------

    def code(self, stage: int = 0) -> str:
        """The program of pipeline chunk ``stage`` (any chunk; every rank compiled them all)."""
        from autopar.program import format_program

        n = len(self._program.chunks)
        if not 0 <= stage < n:
            raise AutoparError(f"autopar: stage {stage} does not exist; plan '{self.plan}' has {n} pipeline "
                               f"chunks (0..{n - 1}).")
        return format_program(self._program.chunks[stage].gm, self.ctx)
