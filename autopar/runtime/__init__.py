"""autopar.runtime: emit and run one rank's program (the last stage of the pipeline).

Public: :func:`init_distributed`, :func:`parallelize`, :class:`ParallelModule`, and
:data:`MESH_AXES`.  ``compile_program`` (the front half of ``parallelize``, no process
group) lives in :mod:`autopar.passes.compile` and is re-exported here.  The modules:
``api`` (entry points), ``module`` (ParallelModule), ``executors`` / ``pipelined`` (flat
and pipelined execution), ``mesh`` (process groups), ``batching`` (what a rank computes),
``data`` (``BatchSlice`` and ``DistributedBatchSampler``: loading only this rank's data),
``layout`` (cutting and gathering parameters), ``grad_sync`` / ``zero`` (gradient-sync
strategies), ``memory`` (the meter), ``checkpoint`` (DCP save and load).
"""
from autopar.passes.compile import compile_program
from autopar.runtime.api import init_distributed, parallelize
from autopar.runtime.mesh import MESH_AXES
from autopar.runtime.module import ParallelModule

__all__ = ["init_distributed", "parallelize", "ParallelModule", "compile_program", "MESH_AXES"]
