"""Gradient synchronisation after backward, and the optimizer step around it.

The data-parallel pass (``passes/data_parallel.py``) decides the buckets; this module
executes them: for each bucket, flatten the gradients, all-reduce them over the bucket's
mesh axis (sum for partial gradients, average over ``dp``), and write them back.  Every
collective is recorded with phase ``grad``.

:class:`GradSync` is the strategy the runtime calls once per step
(``sync_and_step``); ZeRO stages replace it with a strategy that shards gradients and
optimizer state, so the runtime does not change.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopar import collectives as C

__all__ = ["GradSync"]


class GradSync:
    """Bucketed all-reduce of gradients, then a plain optimizer step on local parameters."""

    def __init__(self, gm: torch.fx.GraphModule, ctx, groups: dict, make_optimizer):
        self.gm = gm
        self.ctx = ctx
        self.groups = groups
        self.optimizer = make_optimizer([p for p in gm.parameters() if p.requires_grad])

    def micro_batch(self):
        """Context around one micro-batch's forward and backward (ZeRO strategies act here)."""
        return contextlib.nullcontext()

    def full_parameters(self, write_back: bool = False):
        """Context in which the module holds whole parameters (always true without ZeRO)."""
        return contextlib.nullcontext()

    def sync_and_step(self) -> None:
        self.sync()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def sync(self) -> None:
        for bucket in self.ctx.grad_buckets:
            params = [self.gm.get_parameter(n) for n in bucket.params]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            group = self.groups[bucket.axis]
            if group.size > 1:
                C.record("all_reduce", bucket.axis, flat, "grad", f"gradient bucket ({len(params)} tensors)")
                dist.all_reduce(flat, group=group.group)
            if bucket.average and (bucket.divisor or group.size) > 1:
                flat /= bucket.divisor or group.size
            offset = 0
            for p, grad in zip(params, grads):
                n = grad.numel()
                p.grad = flat[offset:offset + n].view_as(grad)
                offset += n
