"""Which gradient-sync strategy a plan gets (:func:`gradient_sync`): plain, or ZeRO over ``dp`` (``dp*cp`` under cp).

Two gradient-sync strategies (:class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`) share
one layout object, :class:`autopar.runtime.gradients.zero_layout.ZeroLayout` (units, segments, shards, the
unit collectives), and the reads and writes of whole values and optimizer state over shards
(:mod:`autopar.runtime.gradients.zero_state`); neither inherits from the other:

* ZeRO-1/2: :class:`autopar.runtime.gradients.zero_optimizer.DistributedOptimizer` (Megatron's distributed
  optimizer: whole parameters in flat buffers, gradients reduce-scattered in place, the optimizer on
  this rank's shard, the updated shards all-gathered back in place), with its gradient policy from
  :mod:`autopar.runtime.gradients.zero_grads` (ZeRO-1 keeps whole gradients over the step, ZeRO-2 only each
  unit's buffer while its reduce-scatter runs);
* ZeRO-3: :class:`autopar.runtime.gradients.zero_fsdp.FullyShardedSync` (FSDP: parameters as shards only,
  gathered per unit by the program's ``zero_gather``).

:class:`autopar.runtime.module.ParallelModule` calls :func:`gradient_sync` (which calls :func:`zero_sync`
when ``plan.zero > 0``) and then only the protocol.
"""
from __future__ import annotations

import torch

from autopar.passes.context import GradBucket
from autopar.runtime.gradients import fused_step
from autopar.runtime.gradients.grad_sync import GradSync
from autopar.runtime.gradients.sync_protocol import GradientSynchronizer
from autopar.runtime.gradients.zero_fsdp import FullyShardedSync
from autopar.runtime.gradients.zero_optimizer import DistributedOptimizer

__all__ = ["zero_sync", "gradient_sync"]


def zero_sync(gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer, zero_stage: int,
              originals: dict[str, torch.Tensor] | None = None) -> GradientSynchronizer:
    """The ZeRO strategy of ``zero_stage`` (1, 2 or 3) over this rank's program (see the module docstring);
    ``originals``: under mixed precision, graph name -> this rank's piece of the user's fp32 tensor."""
    if zero_stage == 3:
        return FullyShardedSync(gm, program, buckets, groups, make_optimizer, originals)
    return DistributedOptimizer(gm, program, buckets, groups, make_optimizer, zero_stage, originals)


def gradient_sync(plan, params, program, make_optimizer, *, fused_optimizer: bool = True,
                  originals: dict[str, torch.Tensor] | None = None) -> GradientSynchronizer:
    """The gradient-sync strategy of ``plan`` over this rank's parameters (``params``: a
    :class:`autopar.runtime.weights.parameters.RankParameters`): plain data parallelism
    (:class:`autopar.runtime.gradients.grad_sync.GradSync`) or ZeRO (:func:`zero_sync`), over the
    program's gradient buckets restricted to what this rank holds; on a pp rank holding a copy of
    a tied weight, the copies are summed over the embedding group first (bucket ``pp_embed``)."""
    buckets = params.held_buckets(program.grad_buckets)
    pipeline = program.pipeline
    if pipeline is not None and params.pp_rank() in pipeline.tied_pp_ranks():
        tied = params.gm.get_parameter(pipeline.tied)
        buckets.insert(0, GradBucket("pp_embed", (pipeline.tied,), False, tied.numel() * tied.element_size()))
    if plan.zero > 0:
        return zero_sync(params.gm, program, buckets, params.groups,
                         fused_step.flat_factory(make_optimizer, fused_optimizer),
                         zero_stage=plan.zero, originals=originals)
    return GradSync(params.gm, buckets, params.groups, make_optimizer, originals, fused_optimizer=fused_optimizer)
