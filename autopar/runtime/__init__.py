"""autopar.runtime: emit and run one rank's program (the compiler's last step).

Public: :func:`init_distributed`, :func:`parallelize`, :class:`ParallelModule`, and
:data:`MESH_AXES`.  ``compile_program`` (the front half of ``parallelize``, no process
group) lives in :mod:`autopar.passes.compile` and is re-exported here.  The rooms:

- the rank itself, here: ``api`` (``init_distributed``, ``parallelize``), ``module``
  (``ParallelModule``, assembled from the parts below), ``mesh`` (the device mesh and one
  process group per axis), ``devices`` (the rank's device, the program moved there),
  ``rendezvous`` (the process group, fresh at every torchrun restart, with a timeout), ``faults``
  (a dead or hung peer named in the step's error);
- :mod:`autopar.runtime.stepping`: the step and its executors (flat, pipelined, simulated), the
  environment they run in, the loss split over pieces, micro-batches and local data, precision,
  Inductor, the memory meter;
- :mod:`autopar.runtime.gradients`: gradient sync and ZeRO-1/2/3, the fused optimizer, clipping;
- :mod:`autopar.runtime.weights`: the rank's parameters (``RankParameters``) and every way values
  enter or leave them: state dicts, checkpoints, pretrained weights, export, ``init_weights``.
"""
from autopar.passes.compile import compile_program
from autopar.runtime.api import init_distributed, parallelize
from autopar.runtime.mesh import MESH_AXES
from autopar.runtime.module import ParallelModule

__all__ = ["init_distributed", "parallelize", "ParallelModule", "compile_program", "MESH_AXES"]
