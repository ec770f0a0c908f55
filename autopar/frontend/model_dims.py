"""``autopar.cost.ModelSpec``'s fields of a model, read from its traced and analysed graph.

:func:`structure_dims` (the sizes of an analysed :class:`autopar.frontend.analyze.ModelStructure`:
layers, widths, heads, vocabulary, gated MLP, norms, biases, MoE) and :func:`model_dims` (trace,
analyse, then those sizes plus what :mod:`autopar.frontend.spec_dims` reads from the graph), which
``ModelSpec.from_module`` calls.  Neighbours: :mod:`autopar.frontend.analyze` (the structure),
:mod:`autopar.frontend.spec_dims` (the graph's further fields).
"""
from __future__ import annotations

import torch

from autopar.errors import AutoparError
from autopar.frontend.analyze import ModelStructure, normalised_per_head, normalised_whole, analyze
from autopar.frontend.analyze_moe import expert_width
from autopar.frontend.spec_dims import graph_dims
from autopar.frontend.trace import trace_model

__all__ = ["model_dims", "structure_dims"]


def model_dims(model: torch.nn.Module, example_inputs, example_kwargs: dict | None = None) -> dict:
    """Dimensions of ``model`` for ``autopar.cost.ModelSpec`` (traced, not read from names)."""
    gm = trace_model(model, example_inputs, example_kwargs).gm
    s = analyze(gm)
    if not s.regions:
        raise AutoparError(
            f"autopar: found no attention or MLP region in {type(model).__name__}; expected a decoder "
            "with linear projections around an attention op. Describe the model with ModelSpec(...) instead."
        )
    dims = structure_dims(s)
    dims.update(graph_dims(gm, s, dims))  # norms per layer, biases, tables, logits, cumsums (frontend/spec_dims.py)
    # Whether the loss adds the load-balancing loss is the user's choice; a Hugging Face MoE model
    # computes it when configured to return router logits (priced if the loss uses it).
    config = getattr(model, "config", None)
    dims["router_aux_loss"] = bool(getattr(config, "output_router_logits", False)) and dims.get("num_experts", 0) > 0
    return {"name": type(model).__name__, **dims}


def structure_dims(s: ModelStructure) -> dict:
    """``ModelSpec`` fields (all but the name) of an analyzed model."""
    mlp = next((r for r in s.regions if r.kind == "mlp"), None)
    gated = bool(mlp and (len(mlp.columns) >= 2 or any(c.split_sizes for c in mlp.columns)))
    attention = next((r for r in s.regions if r.kind == "attention"), None)
    qkv_bias = bool(attention and any(c.bias for c in attention.columns))  # Qwen2's q, k, v biases
    fused_qkv = bool(attention and any(c.split_sizes for c in attention.columns))  # GPT-2's c_attn
    qk_norm = bool(attention) and sum(normalised_whole(c) for c in attention.columns) >= 2  # OLMo 2
    qk_head_norm = bool(attention) and not qk_norm and s.head_dim > 0 and sum(  # Qwen3
        normalised_per_head(c, s.head_dim) for c in attention.columns) >= 2
    moe = {}
    if s.moe:
        width, gated_experts = expert_width(s.moe[0])
        gated = gated if mlp else gated_experts
        per_shared = (3 if gated_experts else 2) * s.hidden * width
        num_shared = s.moe[0].shared_numel // per_shared
        moe = {"num_experts": s.moe[0].num_experts, "top_k": s.moe[0].top_k, "moe_ffn": width,
               "num_shared_experts": num_shared,
               # Qwen2-MoE's sigmoid gate Linear(hidden, 1) on the shared experts' output
               "shared_expert_gate": s.moe[0].shared_numel - num_shared * per_shared == s.hidden,
               "moe_layer_freq": max(1, s.num_layers // len(s.moe)),
               "first_dense_layers": s.num_layers - len(s.moe) * max(1, s.num_layers // len(s.moe))}
    return {
        **s.latent,
        "num_layers": s.num_layers,
        "hidden": s.hidden,
        "num_heads": s.num_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "ffn": s.ffn or moe.get("moe_ffn", 0),
        "vocab": s.vocab,
        "gated_mlp": gated,
        "tied_embeddings": s.tied_embeddings,
        "qkv_bias": qkv_bias,
        "qk_norm": qk_norm,
        "qk_head_norm": qk_head_norm,
        "fused_qkv": fused_qkv,
        "norm": "layernorm" if s.norm_biases else "rmsnorm",
        **moe,
    }
