"""A decoder layer's element-wise work, counted on graphs: the traced model's layer against a Llama layer's.

The time model prices a layer's element-wise kernels (norms, residuals, RoPE, the MLP's activation)
by a byte formula (cost/time.py ``_elementwise_bytes_fwd``) at the bandwidth ``autopar calibrate``
measures on the eager kernels of a Llama layer (:func:`llama_layer_elementwise`, timed by
autopar/cli/calibrate_kernels.py).  A model whose layers do more (Granite's residual and attention
multipliers, a LayerNorm's bias, a gated GELU) or less runs slower or faster than that formula says.
``ModelSpec.elementwise_factor`` (:func:`elementwise_factor`) corrects it: the traced layer's bytes
over a Llama layer's of the same sizes (gated or not, as the model's MLP), both counted by
:func:`graph_bytes` on graphs traced the same way (torch.export, non-strict, on the meta device),
so that the calibrated bandwidth prices the model's own kernels.

Neighbours: autopar/frontend/spec_dims.py (the spec's other graph fields), cost/time.py (the
formula the factor scales).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from autopar.compat import sym_hint
from autopar.frontend.op_sets import ATTENTION_OPS, PROJECTION_OPS

__all__ = ["graph_bytes", "llama_layer_elementwise", "reference_bytes", "elementwise_factor"]

aten = torch.ops.aten

# Matrix products and attention: priced by their FLOPs, not here.
_PRICED_APART = PROJECTION_OPS | ATTENTION_OPS | {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}
# Ops that copy only when their input is not laid out as their output must be.
_COPY_IF_STRIDED = {aten.reshape.default, aten.contiguous.default, aten.clone.default}


def _val(x):
    return x.meta.get("val") if isinstance(x, Node) else None


def _nbytes(t) -> int:
    """A tensor's bytes at the example's sizes (0 where a size depends on data: routed tokens)."""
    if not isinstance(t, torch.Tensor):
        return 0
    try:
        return int(sym_hint(t.numel())) * t.element_size()
    except TypeError:  # an unbacked size has no hint
        return 0


def _tensors(args) -> list:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out += _tensors(a)
        elif isinstance(_val(a), torch.Tensor):
            out.append(_val(a))
    return out


def _moves_data(node: Node) -> bool:
    """Whether ``node`` runs a kernel that reads and writes memory (not a view, a check or a no-op cast)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op in _PRICED_APART or not isinstance(_val(node), torch.Tensor):
        return False
    inputs = _tensors(node.args)
    if op in _COPY_IF_STRIDED:
        return op is aten.clone.default or bool(inputs) and not inputs[0].is_contiguous()
    if op in (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout):
        return bool(inputs) and inputs[0].dtype != _val(node).dtype
    returns = op._schema.returns
    return not (returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write)


def graph_bytes(nodes) -> int:
    """Bytes the element-wise kernels among ``nodes`` read and write (each tensor input, the output)."""
    return sum(sum(_nbytes(t) for t in _tensors(n.args)) + _nbytes(_val(n)) for n in nodes if _moves_data(n))


def _rms_norm(x, weight):
    """Llama's RMSNorm as eager PyTorch runs it: in fp32, then the weight in the input's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def llama_layer_elementwise(t: dict) -> tuple:
    """The element-wise part of one Llama decoder layer's forward, its matrix products and attention
    replaced by the leaf tensors they would produce (``t``): the outputs whose gradients backward gets."""
    b, heads, s, d = t["o"].shape
    g = t["k"].shape[-1] // d
    q, k, v = (t[n].view(b, s, -1, d).transpose(1, 2) for n in ("q", "k", "v"))  # the projections' outputs
    n1 = _rms_norm(t["x"], t["w1"])                                           # into q/k/v projections
    q, k = _rope(q, t["cos"], t["sin"]), _rope(k, t["cos"], t["sin"])
    k = k[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)   # grouped-query copies
    v = v[:, :, None].expand(b, g, heads // g, s, d).reshape(b, heads, s, d)
    out = t["o"].transpose(1, 2).reshape(b, s, heads * d)                     # into o_proj
    r1 = t["x"] + t["attn"]
    n2 = _rms_norm(r1, t["w2"])                                               # into gate/up
    act = (torch.nn.functional.silu(t["gate"]) * t["up"] if "gate" in t     # into down_proj
           else torch.nn.functional.gelu(t["up"]))
    return n1, q, k, v, out, n2, act, r1 + t["down"]


def layer_leaves(b: int, s: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, *,
                 device="cpu", dtype=torch.float32, requires_grad: bool = True, gated: bool = True) -> dict:
    """The leaf tensors :func:`llama_layer_elementwise` takes, for ``b`` sequences of ``s`` tokens
    (``gated``: a gate projection's output beside the up projection's)."""
    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=requires_grad)

    a, g, d, H, F = heads, kv_heads, head_dim, hidden, ffn
    t = dict(x=leaf(b, s, H), q=leaf(b, s, a * d), k=leaf(b, s, g * d), v=leaf(b, s, g * d), o=leaf(b, a, s, d),
             attn=leaf(b, s, H), up=leaf(b, s, F), down=leaf(b, s, H), w1=leaf(H), w2=leaf(H),
             cos=torch.randn(s, d, device=device, dtype=dtype), sin=torch.randn(s, d, device=device, dtype=dtype))
    if gated:
        t["gate"] = leaf(b, s, F)
    return t


class _Reference(torch.nn.Module):
    def forward(self, t: dict):
        return llama_layer_elementwise(t)


def reference_bytes(b: int, s: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                    dtype=torch.float32, gated: bool = True) -> int:
    """:func:`graph_bytes` of the Llama layer's forward at these sizes, traced on the meta device as
    the model is (torch.export, non-strict)."""
    t = layer_leaves(b, s, hidden, heads, kv_heads, head_dim, ffn, device="meta", dtype=dtype, requires_grad=False,
                     gated=gated)
    gm = torch.export.export(_Reference(), (t,), strict=False).module()
    return graph_bytes(gm.graph.nodes)


def elementwise_factor(layer_nodes, tokens: tuple[int, int], dims: dict, dtype: torch.dtype) -> float:
    """``ModelSpec.elementwise_factor`` of a traced model (the module docstring): ``layer_nodes`` its
    first layer's nodes, ``tokens`` its example's (batch, seq), ``dims`` the spec's dimensions,
    ``dtype`` its activations'."""
    b, s = tokens
    H, a, g, d, F = (dims[k] for k in ("hidden", "num_heads", "num_kv_heads", "head_dim", "ffn"))
    model = graph_bytes(layer_nodes)
    ref = reference_bytes(b, s, H, a, g, d, F, dtype, gated=dims.get("gated_mlp", True))
    return round(model / ref, 3) if model > 0 and ref > 0 else 1.0
