"""autopar.verification: ``autopar verify`` — a plan proved on the user's architecture, on the CPU.

Before a cluster is spent on a plan, :func:`verify` trains a shrunk copy of the model under
the plan on N local gloo processes (through ``parallelize``, as a user's script would) and
the unparallelized model in one process, and compares losses, gradients and parameters
within the bounds the test suite uses.  The modules: ``api`` (:func:`verify`), ``sources``
(presets, config.json, MODULE:FUNCTION; batches, loss, optimizers), ``shrink`` (small configs
the plan still splits), ``launch`` (the ranks as processes), ``worker`` (one rank),
``compare`` (the bounds, :class:`VerifyResult`).  It sits above ``autopar.runtime`` and below
``autopar.cli`` (docs/architecture.md).
"""
from autopar.verification.api import verify
from autopar.verification.compare import LOSS_ATOL, PARAM_ATOL, VerifyResult
from autopar.verification.launch import RankFailure

__all__ = ["verify", "VerifyResult", "RankFailure", "LOSS_ATOL", "PARAM_ATOL"]
