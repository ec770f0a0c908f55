"""Gradients and ZeRO: what happens between backward and the next forward.

- ``sync_protocol`` (``GradientSynchronizer``: what the step needs of a gradient-sync strategy),
  ``grad_sync`` (plain data parallelism and the optimizer step), ``zero`` (``zero_sync``: which
  ZeRO strategy a plan gets);
- ZeRO by composition over one layout, no mixins: ``zero_layout`` (the units, their flat
  segments, the unit collectives), ``flat_layout`` (one segment's padded buffer and each rank's
  shard), ``zero_state`` (whole values and optimizer state over shards), ``zero_optimizer``
  (ZeRO-1/2 as a distributed optimizer, with ``zero_grads``' gradient policies), ``zero_fsdp``
  (ZeRO-3: parameters gathered per unit);
- ``fused_step`` (the optimizer over flat buffers, fused where torch has the kernel),
  ``clipping`` (the global gradient norm).

Neighbours: the step that produces the gradients, :mod:`autopar.runtime.stepping`; the
parameters they belong to, :mod:`autopar.runtime.weights`.
"""
