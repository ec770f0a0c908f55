"""The PyTorch sides of benchmarks/runtime_vs_torch.py: each builder takes the model, the optimizer
factory, the benchmark's config and the device, and returns ``step(ids, target) -> global mean loss``
with PyTorch's own implementation of a parallelism (``parallelize_module``, DDP, FSDP2,
``torch.distributed.pipelining``, ``context_parallel``, ``torch.compile``).  The pairs, the timing and
the report live in runtime_vs_torch.py.
"""
from __future__ import annotations

import functools
from typing import Callable

import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["MODEL_SIZE", "TORCH_BUILDERS", "torch_tp_plan"]

# hidden 256, 4 layers: each rank's matmuls are non-trivial on one CPU core, a step stays near a second.
MODEL_SIZE = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4)


def _first_error(exc: BaseException) -> str:
    lines = [l for l in traceback.format_exception_only(type(exc), exc) if l.strip()]
    text = " ".join(l.strip() for l in lines)
    return text[:300] + ("..." if len(text) > 300 else "")


def _model(cfg) -> nn.Module:
    from benchmarks.models import hf_llama

    return hf_llama(cfg.seed, max_position_embeddings=cfg.seq, **{**MODEL_SIZE, "num_hidden_layers": cfg.layers})


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    from benchmarks.models import hf_loss

    return hf_loss(output, target)


def _positions(ids: torch.Tensor) -> torch.Tensor:
    """Explicit position ids: under SP and CP a rank's local sequence is not the global one."""
    return torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids).contiguous()


def _global_mean(loss: torch.Tensor, group=None) -> float:
    """The mean over the ranks of ``group`` of their local losses (what autopar's train_step returns)."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total) / dist.get_world_size(group)


# --- the PyTorch sides: each builder returns step(ids, target) -> global mean loss ----------------


def torch_tp_plan(model) -> dict:
    """``parallelize_module``'s plan for ``LlamaForCausalLM``: Megatron TP + SP, vocab-parallel head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    plan = {
        # Vocabulary-parallel lookup; the partial sum is reduce-scattered to sequence shards.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        # Logits stay sharded over the vocabulary for loss_parallel().
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            # The decoder layer calls self_attn(hidden_states=..., position_embeddings=...): gather x's shards.
            p + "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": ColwiseParallel(),
            p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": ColwiseParallel(),
            p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _torch_tp(model, make_opt, cfg, device: torch.device) -> Callable:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    # HF attention views q/k/v as (..., -1, head_dim): the local head count needs no model edit.
    parallelize_module(model, mesh, torch_tp_plan(model))
    opt = make_opt(model.parameters())

    def step(ids, target):
        with loss_parallel():
            loss = _loss(model(ids, position_ids=_positions(ids), use_cache=False), target)
            loss.backward()
        if cfg.replicate_partial_grads:
            # Under SP the norm weights' gradients are Partial; left alone, AdamW all-reduces
            # each of them once per op that reads it.
            for p in model.parameters():
                if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    return step


def _rows(ids: torch.Tensor) -> slice:
    """This rank's rows of the global batch (autopar's dp split: contiguous, in rank order)."""
    n = ids.shape[0] // dist.get_world_size()
    return slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)


def _data_parallel_step(model, opt) -> Callable:
    def step(ids, target):
        rows = _rows(ids)
        loss = _loss(model(ids[rows], use_cache=False), target[rows])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _global_mean(loss)

    return step


def _torch_dp(model, make_opt, cfg, device: torch.device) -> Callable:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _data_parallel_step(ddp, make_opt(ddp.parameters()))


def _torch_compiled_dp(model, make_opt, cfg, device: torch.device) -> Callable:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _data_parallel_step(torch.compile(ddp), make_opt(ddp.parameters()))


def _torch_zero3(model, make_opt, cfg, device: torch.device) -> Callable:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _data_parallel_step(model, make_opt(model.parameters()))


class _LlamaHalf(nn.Module):
    """One pipeline stage of ``LlamaForCausalLM``: the embedding and the first layers, or the
    last layers, the final norm and the LM head.  Each stage recomputes the rotary tables
    (no parameters), so only the hidden state crosses the cut, as in autopar's pipeline pass."""

    def __init__(self, model, layers: range, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rotary = self.rotary_emb(h, position_ids=positions)
        for layer in self.layers:  # no mask: SDPA's is_causal, as HF's sdpa path does without padding
            h = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def _logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _torch_pp(model, make_opt, cfg, device: torch.device, compiled: bool = False) -> Callable:
    """``compiled``: each decoder layer of the stage through ``torch.compile`` (Inductor), as
    torchtitan compiles the blocks of its pipeline stages; the P2P stays eager."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, stages = dist.get_rank(), dist.get_world_size()
    per_stage = len(model.model.layers) // stages
    half = _LlamaHalf(model, range(rank * per_stage, (rank + 1) * per_stage), rank == 0, rank == stages - 1)
    if compiled:
        for layer in half.layers:
            layer.compile()  # in place: the parameters stay the module's, the optimizer steps them
    stage = PipelineStage(half, rank, stages, device)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=_logits_loss, scale_grads=True)
    opt = make_opt(half.parameters())
    last = rank == stages - 1

    def step(ids, target):
        losses: list = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=target if last else None, losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # The last chunk's mean over micro-batches, shared with every stage (others add 0).
        loss = torch.stack([l.detach() for l in losses]).mean() if last else torch.zeros((), device=device)
        dist.all_reduce(loss)
        return float(loss)

    return step


def _torch_zero1(model, make_opt, cfg, device: torch.device) -> Callable:
    """DDP with ``ZeroRedundancyOptimizer`` (torch's ZeRO-1: optimizer state sharded by whole
    parameters, updated parameters broadcast by their owners) over the factory's optimizer class
    and hyper-parameters (``make_opt`` is a ``functools.partial`` of the class)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=make_opt.func, **make_opt.keywords)
    return _data_parallel_step(ddp, opt)


def _torch_fused_dp(model, make_opt, cfg, device: torch.device) -> Callable:
    """DDP with the factory's optimizer in its fused implementation (``fused=True``: one kernel
    over all parameters), against autopar's flat masters stepped fused."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return _data_parallel_step(ddp, make_opt(ddp.parameters(), fused=True))


def _probe_context_parallel(device: torch.device) -> None:
    """Run one causal SDPA forward and backward under ``context_parallel`` on a one-rank mesh
    of this rank alone.  It fails the same way on every rank where the kernel has no CP
    implementation (torch 2.13 has one for the flash, efficient and cuDNN kernels, none for
    the CPU's ``_scaled_dot_product_flash_attention_for_cpu``), instead of failing on one rank
    inside the real step while another waits in a collective."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    own, _ = dist.new_subgroups(1)
    mesh = DeviceMesh.from_group(own, device.type, mesh_dim_names=("cp",))
    q = torch.randn(1, 2, 8, 4, device=device, requires_grad=True)
    try:
        with context_parallel(mesh, buffers=[torch.zeros(1, 8, device=device)], buffer_seq_dims=[1]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except Exception as exc:
        raise RuntimeError(f"context_parallel cannot run SDPA on {device.type}: {_first_error(exc)}") from exc
    finally:
        dist.destroy_process_group(own)


def _torch_cp(model, make_opt, cfg, device: torch.device) -> Callable:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    _probe_context_parallel(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("cp",))
    # The weights are replicated over cp; DDP averages their gradients over the cp ranks.
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = make_opt(ddp.parameters())

    def step(ids, target):
        ids, target, positions = ids.clone(), target.clone(), _positions(ids)
        buffers = [ids, target, positions]
        # Shards the buffers in place over the sequence (2·cp chunks, head-tail balanced) and
        # replaces SDPA by ring attention for the forward and the backward.
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            loss = _loss(ddp(ids, position_ids=positions, use_cache=False), target)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return _global_mean(loss)

    return step


TORCH_BUILDERS = {"tp": _torch_tp, "dp": _torch_dp, "zero3": _torch_zero3, "pp": _torch_pp, "cp": _torch_cp,
                  "compile": _torch_compiled_dp, "zero1": _torch_zero1, "fused": _torch_fused_dp,
                  "pp_compile": functools.partial(_torch_pp, compiled=True)}
