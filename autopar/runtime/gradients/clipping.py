"""Global gradient-norm clipping over every shard: ``parallelize(..., max_grad_norm=...)``.

The norm is that of the unparallelized model's gradients, each logical parameter counted
once, equal to ``torch.nn.utils.clip_grad_norm_`` on one device.  After gradient sync a
parameter's gradient lives on the ranks of its pipeline stage (``world / pp`` ranks), cut
into ``D`` distinct pieces (``D`` = the product of the sizes of the axes it is sharded on:
tp for TP shards, ep for experts, and dp for ZeRO shards) and otherwise replicated.  So
every rank adds ``w * ||piece||^2`` with ``w = D / (world / pp)`` for each piece it holds
(divided by 2 for a tied embedding whose first and last pp rank both hold a summed copy),
one all-reduce over the world sums them, and

    ||g||^2 = sum over ranks and pieces of w * ||piece||^2

counts each element exactly once.  The clip coefficient is torch's,
``min(1, max_norm / (||g|| + 1e-6))``, applied to every piece before the optimizer step.

Cost: one all-reduce of 8 bytes over the world per step, recorded (axis ``world``, phase
``step``); the cost model does not list it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.ops import collectives

__all__ = ["norm_weights", "clip_gradients"]


def norm_weights(param_shards: dict, holders: int, sizes: dict[str, int], names,
                 copies: dict[str, int] | None = None) -> dict[str, float]:
    """``w`` for each graph parameter: distinct pieces over the ranks of its stage (``holders``),
    over the stages holding a copy (``copies``: 2 for an LM head tied to the embedding under pp)."""
    copies = copies or {}
    return {name: math.prod(sizes.get(a, 1) for a in param_shards.get(name, {})) / holders / copies.get(name, 1)
            for name in names}


def clip_gradients(grad_sync, weights: dict[str, float], max_norm: float | None, groups: dict,
                   device: torch.device) -> float:
    """The global gradient norm before clipping; scales the gradients when ``max_norm`` is exceeded."""
    local = grad_sync.grad_square_sum(weights, device)
    world = groups.get("world")
    if world is not None and world.size > 1:
        collectives.record("all_reduce", "world", local, "step", "gradient norm")
        dist.all_reduce(local, group=world.group)
    total = float(local.sqrt())
    if max_norm is not None:
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            grad_sync.scale_grads(coef)
    return total
