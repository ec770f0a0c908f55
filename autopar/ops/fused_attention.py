"""Attention as a CUDA GPU computes it, on any device: the fused kernel its dispatcher would pick.

``F.scaled_dot_product_attention`` chooses its kernel by device.  On a GPU (torch's priority
order: flash, memory-efficient, math) causal attention over fp16/bf16 runs the flash kernel and
over fp32 the memory-efficient one; neither materialises the ``s x s`` scores, and both save
only their output and fp32 log-sum-exp for backward.  On the meta device the dispatcher has no
GPU to ask and runs the math path, which materialises the scores (2 GiB per layer for 8 heads at
sequence 8192, fp32) and counts their softmax as an allocation no GPU makes.

:func:`fused_sdpa` is ``F.scaled_dot_product_attention`` everywhere but on the meta device,
where it calls the fused kernel a CUDA device would choose for these tensors
(:func:`cuda_kernel`: torch's ``sdp_utils`` rules for flash and memory-efficient attention, the
ones a Llama-style layer meets), through its aten op.  Those ops have meta kernels, which
allocate the output and log-sum-exp a GPU does, autograd derivatives whose backward ops have
meta kernels too, and formulas in ``torch.utils.flop_counter`` (which counts them over the full
``s x s``, causal or not).  So a program on the meta device (the scale simulation) allocates and
computes at attention what the GPU would, under torch's own meters.

The scale simulation runs it in place of every SDPA node (:func:`autopar.runtime.devices.use_fused_attention`);
:func:`autopar.ops.rng.attention` (SDPA with a dropout stream) calls it too.  Context-parallel
attention (:mod:`autopar.ops.cp_attention`) computes its blocks itself, on every device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_sdpa", "cuda_kernel", "FLASH_DTYPES", "EFFICIENT_DTYPES"]

aten = torch.ops.aten

# torch's sdp_utils.cpp (sm80 and later): the dtypes each fused kernel accepts.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256  # both kernels' limit on the head dim


def cuda_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                enable_gqa: bool = False) -> str:
    """``"flash"``, ``"efficient"`` or ``"math"``: the kernel CUDA's SDPA dispatcher picks for these
    tensors, trying flash first (fp16/bf16, no explicit mask, one head dim for q, k and v up to 256),
    then memory-efficient (fp16/bf16/fp32, a mask allowed, head dims up to 256, multiples of 8 at 16
    bits and of 4 at fp32), then math.  Grouped-query heads passed unexpanded (``enable_gqa``) go to
    math here: the models autopar traces expand K and V before the op."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "math"
    if enable_gqa and query.shape[1] != key.shape[1]:
        return "math"
    d_qk, d_v = query.shape[-1], value.shape[-1]
    same_dtype = query.dtype == key.dtype == value.dtype
    if (same_dtype and query.dtype in FLASH_DTYPES and attn_mask is None and d_qk == key.shape[-1] == d_v
            and d_qk <= _MAX_HEAD_DIM):
        return "flash"
    align = 4 if query.dtype == torch.float32 else 8
    if (same_dtype and query.dtype in EFFICIENT_DTYPES and d_qk == key.shape[-1] and max(d_qk, d_v) <= _MAX_HEAD_DIM
            and d_qk % align == 0 and d_v % align == 0):
        return "efficient"
    return "math"


def fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; on the meta device, the fused kernel of :func:`cuda_kernel`."""
    kernel = cuda_kernel(query, key, value, attn_mask, enable_gqa) if query.device.type == "meta" else "math"
    if kernel == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if kernel == "efficient":
        # As the CUDA composite: the log-sum-exp is computed (and saved) only when backward needs it.
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    extra = {"enable_gqa": True} if enable_gqa else {}
    return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)
