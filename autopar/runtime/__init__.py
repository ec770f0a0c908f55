"""autopar.runtime: emit and run one rank's program (the compiler's last step).

Public: :func:`init_distributed`, :func:`parallelize`, :class:`ParallelModule`, and
:data:`MESH_AXES`.  ``compile_program`` (the front half of ``parallelize``, no process
group) lives in :mod:`autopar.passes.compile` and is re-exported here.  The modules:

- failures: ``rendezvous`` (``init_distributed``'s process group, fresh at every torchrun restart,
  with a timeout), ``faults`` (a dead or hung peer named in the step's error);
- entry points and the program: ``api`` (``init_distributed``, ``parallelize``), ``module``
  (``ParallelModule``), ``executors`` / ``pipelined`` (how a step runs: flat, or the chunks
  under ``torch.distributed.pipelining``), ``simulated`` (a pipelined step on the meta
  device: the scale simulation), ``devices`` (the rank's device, the program moved there),
  ``inductor`` (``compile=True``: ``torch.compile`` of the program);
- ranks and data: ``mesh`` (the device mesh and one process group per axis), ``batching``
  (what a rank computes: its rows and positions, in micro-batches), ``data``
  (``BatchSlice``, ``DistributedBatchSampler``: loading only this rank's data);
- parameters and gradients: ``layout`` (cutting full tensors into shards and back),
  ``sync_protocol`` (``GradientSynchronizer``, what a gradient-sync strategy provides),
  ``grad_sync`` (plain data-parallel sync and the optimizer step) and ``zero`` (which ZeRO
  strategy a plan gets), composed of ``zero_layout`` (the units, their flat segments and
  collectives), ``flat_layout`` (one segment's padded buffer and shards), ``zero_state`` (whole
  values and optimizer state over shards), ``zero_optimizer`` (ZeRO-1/2, with ``zero_grads``'
  gradient policies) and ``zero_fsdp`` (ZeRO-3), ``precision`` (bf16 mixed precision), ``clipping``
  (the global gradient norm), ``memory`` (the meter);
- state and weights: ``state`` (state dicts and checkpoint state), ``train_state`` (the step,
  dropout's RNG and the data position in a checkpoint), ``checkpoint`` (DCP save and load),
  ``checkpoint_files`` (the layout on disk, retention, ``latest_checkpoint``, the checks of a
  damaged checkpoint), ``checkpoint_writer`` (background writes), ``export`` (``pm.export_weights``), ``pretrained`` (``pm.load_pretrained``),
  ``safetensors_io`` (slice reads and piecewise writes of safetensors files), ``initialize``
  (``init_weights`` on a model built on the meta device).
"""
from autopar.passes.compile import compile_program
from autopar.runtime.api import init_distributed, parallelize
from autopar.runtime.mesh import MESH_AXES
from autopar.runtime.module import ParallelModule

__all__ = ["init_distributed", "parallelize", "ParallelModule", "compile_program", "MESH_AXES"]
