"""The step and its executors: how one rank runs ``train_step`` and ``eval_step``.

- ``executors`` (the ``Executor`` protocol, the flat executor), ``pipelined`` (the chunks under
  ``torch.distributed.pipelining``), ``simulated`` (a pipelined step on the meta device: the
  scale simulation);
- ``environment`` (``StepEnvironment``: what an executor gets of the program, instead of the
  ``ParallelModule``), ``loss_split`` (``LossSplit``: valid targets, each piece's weight, the
  global loss);
- ``batching`` (what a rank computes: its rows and positions, in micro-batches), ``data``
  (``BatchSlice``, ``DistributedBatchSampler``: loading only this rank's data);
- ``precision`` (bf16 inputs), ``inductor`` (``compile=True``), ``memory`` (the meter).

Neighbours: the rank's parameters and weights I/O in :mod:`autopar.runtime.weights`, gradient
sync and ZeRO in :mod:`autopar.runtime.gradients`; :mod:`autopar.runtime.module` assembles them.
"""
