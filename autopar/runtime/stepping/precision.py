"""Mixed precision (``parallelize(..., mixed_precision="bf16")``): what is held in which dtype.

The layout is Megatron's, priced by the cost model as ``dtype_bytes=2`` (cost/memory.py):

* the program is traced from a bf16 copy of the user's model (:func:`low_precision_copy`;
  the user's model is not touched), so its parameters, buffers and activations are bf16 in
  forward and backward, and the constants the model bakes in (``x.to(input_dtype)`` of an
  RMSNorm) are bf16 too; floating model outputs are upcast to fp32 before the loss
  function (``trace_model(upcast_outputs=True)``), so the loss is computed in fp32;
* fp32 master weights are cut from the user's own fp32 tensors, never from the rounded
  bf16 copy (a model built on the meta device: from the checkpoint or ``init_weights``, which
  write the masters and the bf16 parameters alike): per-parameter tensors without ZeRO (:class:`MainGrads`;
  under dp with ``fused_optimizer`` views of one flat buffer, their main gradients too:
  :mod:`autopar.runtime.gradients.fused_step`), the flat
  ``dp`` shards with ZeRO (:mod:`autopar.runtime.gradients.zero`), which under ZeRO-3 are
  also the parameter shards, cast to bf16 as they are gathered (FSDP2's layout);
* the bf16 gradients autograd leaves on the parameters are folded into fp32 main
  gradients after every micro-batch's backward (:meth:`MainGrads.accumulate`; the
  pipelined executor calls it after every backward action of its stages), so accumulation
  over micro-batches is fp32; gradients are reduced in fp32 (4 B per element, the cost
  model's ``w_gc = w_g``) and the optimizer steps the masters, which are then copied into
  the bf16 parameters.

Why not ``torch.autocast``: autocast keeps fp32 parameters and casts at each op, so every
GEMM re-casts its weight every micro-batch and the collectives would move fp32 parameters
under ZeRO; Megatron and FSDP2's ``MixedPrecisionPolicy`` hold low-precision working
parameters, which is also what the cost model prices.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from autopar.errors import AutoparError

__all__ = ["MIXED_PRECISION_DTYPES", "mixed_precision_dtype", "low_precision_copy", "cast_inputs", "MainGrads"]

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16}


def mixed_precision_dtype(value: str | None) -> torch.dtype | None:
    """The working dtype of ``mixed_precision=value`` (None: train in the model's own dtype)."""
    if value is None:
        return None
    dtype = MIXED_PRECISION_DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if dtype is None:
        raise AutoparError(f"autopar: mixed_precision={value!r} is not a mixed-precision mode; expected "
                           f"{' or '.join(repr(k) for k in MIXED_PRECISION_DTYPES)} (bf16 parameters and "
                           "activations, fp32 masters and gradients) or None (train in the model's own dtype).")
    return dtype


def low_precision_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with its floating parameters and buffers in ``dtype`` (the model is unchanged)."""
    # A meta-built model copies for free; its masters then come from load_pretrained / init_weights.
    return copy.deepcopy(model).to(dtype)


def cast_inputs(inputs: tuple, dtype: torch.dtype | None) -> tuple:
    """Floating input tensors in the working dtype (token ids and masks of integer type are kept)."""
    if dtype is None:
        return inputs
    return tuple(t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs)


class MainGrads:
    """fp32 master weights and main gradients of one rank's low-precision parameters.

    ``params``: graph name -> the program's (bf16) parameter; ``originals``: graph name ->
    this rank's piece of the user's fp32 tensor.  The optimizer steps :attr:`masters`."""

    def __init__(self, params: dict[str, nn.Parameter], originals: dict[str, torch.Tensor]):
        self.params = params
        self.masters = {name: nn.Parameter(originals[name].detach().to(torch.float32, copy=True),
                                           requires_grad=p.requires_grad)
                        for name, p in params.items()}

    def accumulate(self) -> None:
        """Fold the bf16 gradients autograd left on the parameters into the fp32 main gradients."""
        for name, p in self.params.items():
            if p.grad is None:
                continue
            master = self.masters[name]
            if master.grad is None:
                master.grad = p.grad.to(torch.float32)
            else:
                master.grad.add_(p.grad)  # in fp32: the bf16 operand is widened exactly
            p.grad = None

    def copy_to_params(self, names: Any = None) -> None:
        """The working parameters from the masters (rounded to their dtype)."""
        with torch.no_grad():
            for name in (self.params if names is None else names):
                self.params[name].copy_(self.masters[name])
