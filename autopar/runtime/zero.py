"""ZeRO over the ``dp`` axis (``dp*cp`` under cp): which strategy a plan's ZeRO stage gets.

Two gradient-sync strategies (:class:`autopar.runtime.sync_protocol.GradientSynchronizer`) share
one layout object, :class:`autopar.runtime.zero_layout.ZeroLayout` (units, segments, shards, the
unit collectives), and the reads and writes of whole values and optimizer state over shards
(:mod:`autopar.runtime.zero_state`); neither inherits from the other:

* ZeRO-1/2: :class:`autopar.runtime.zero_optimizer.DistributedOptimizer` (Megatron's distributed
  optimizer: whole parameters in flat buffers, gradients reduce-scattered in place, the optimizer on
  this rank's shard, the updated shards all-gathered back in place), with its gradient policy from
  :mod:`autopar.runtime.zero_grads` (ZeRO-1 keeps whole gradients over the step, ZeRO-2 only each
  unit's buffer while its reduce-scatter runs);
* ZeRO-3: :class:`autopar.runtime.zero_fsdp.FullyShardedSync` (FSDP: parameters as shards only,
  gathered per unit by the program's ``zero_gather``).

:class:`autopar.runtime.module.ParallelModule` calls :func:`zero_sync` when ``plan.zero > 0`` and
then only the protocol.
"""
from __future__ import annotations

import torch

from autopar.runtime.sync_protocol import GradientSynchronizer
from autopar.runtime.zero_fsdp import FullyShardedSync
from autopar.runtime.zero_optimizer import DistributedOptimizer

__all__ = ["zero_sync"]


def zero_sync(gm: torch.fx.GraphModule, program, buckets, groups: dict, make_optimizer, zero_stage: int,
              originals: dict[str, torch.Tensor] | None = None) -> GradientSynchronizer:
    """The ZeRO strategy of ``zero_stage`` (1, 2 or 3) over this rank's program (see the module docstring);
    ``originals``: under mixed precision, graph name -> this rank's piece of the user's fp32 tensor."""
    if zero_stage == 3:
        return FullyShardedSync(gm, program, buckets, groups, make_optimizer, originals)
    return DistributedOptimizer(gm, program, buckets, groups, make_optimizer, zero_stage, originals)
