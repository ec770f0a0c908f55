"""The cost model's fields that the traced graph gives beyond the decoder's dimensions.

:func:`graph_dims` reads them from the traced model and its :class:`ModelStructure` in general
terms (ops, shapes and parameters, never names) for ``ModelSpec.from_module``
(``autopar.frontend.model_dims.model_dims``):

- ``layer_norms``: norms per layer, from the norm weights of the first layer less the q/k and
  latent norms the spec counts on their own (Gemma 2 normalises attention and MLP outputs again: 4);
- ``proj_bias``: the row-parallel projections (attention output, MLP down) have biases, and
  then every MLP projection (GPT-2, OPT, BERT);
- ``embedding_extra_params``: embedding tables beyond the token table (learned positions, token types);
- ``embedding_norm``: the parameters outside the layers that ops before the first layer read are
  one norm's (BERT's LayerNorm of the summed embeddings: the first pipeline stage's);
- ``head_extra_params``: the other parameters outside the layers, besides the token table, the
  final norm and the LM head (BERT's MLM transform: a dense layer and a LayerNorm);
- ``lm_head_bias``: the LM head has a bias (sharded over the vocabulary with it);
- ``norm_weight_offset``: the final norm's weight reaches the program only as ``weight + c``
  (Gemma's ``x * (1 + w)``), so its backward never reads the weight;
- ``gathered_logits``: the logits reach the loss through other ops than views (a soft cap), so
  under tp they are all-gathered, not given to a vocabulary-parallel cross-entropy
  (``autopar.frontend.loss.logits_loss``);
- ``seq_cumsums`` / ``seq_cumsum_bytes``: cumulative sums along the sequence (OPT's positions from
  the attention mask), which cp makes global with an all-gather of chunk totals
  (``autopar.ops.cp_attention.cp_cumsum``): how many, and the bytes of one sample's total per call;
- ``elementwise_factor``: the first layer's element-wise bytes over a Llama layer's of its sizes
  (autopar/frontend/elementwise.py), which scales the time model's element-wise formula;
- ``cp_kv_heads``: the K/V heads the CP collectives move: the KV heads when the GQA broadcast is
  right before the attention op (``strip_gqa``), else the heads the op receives (Falcon's RoPE
  after the broadcast).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from autopar.compat import sym_hint
from autopar.frontend.attention_dims import strip_gqa
from autopar.frontend.elementwise import elementwise_factor
from autopar.frontend.fx_utils import module_path, within
from autopar.frontend.loss import logits_consumer
from autopar.frontend.op_sets import ATTENTION_OPS, SOFTMAX_OPS

aten = torch.ops.aten

__all__ = ["graph_dims"]

# Where a mask's dataflow enters attention: the SDPA op, or the softmax of an eager core.
_ATTENTION_STOPS = ATTENTION_OPS | SOFTMAX_OPS


def graph_dims(gm: GraphModule, s, dims: dict) -> dict:
    """The fields above for ``ModelSpec``, given the structure ``s`` and its ``structure_dims``."""
    params = dict(gm.named_parameters())
    out = {"layer_norms": _layer_norms(s, params, dims),
           "proj_bias": any(r.bias for region in s.regions for r in region.rows),
           "lm_head_bias": bool(s.lm_head and s.lm_head.bias)}
    out.update(_outside_params(gm, s, params, dims))
    if s.lm_head is not None:
        _, user = logits_consumer(s.lm_head.node)
        out["gathered_logits"] = user is None or (user.op != "output" and user.target != aten.cross_entropy_loss.default)
    out.update(_seq_cumsums(gm, set(params)))
    attention = next((r.attention for r in s.regions if r.attention is not None), None)
    if attention is not None:
        out["cp_kv_heads"] = int(strip_gqa(attention.args[1])[0].meta["val"].shape[-3])
    out.update(_elementwise(gm, s, dims))
    return out


def _elementwise(gm: GraphModule, s, dims: dict) -> dict:
    """``elementwise_factor``: the first layer's element-wise bytes over a Llama layer's (frontend/elementwise.py)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if not s.layers or not placeholders or placeholders[0].meta["val"].dim() < 2 or not dims.get("hidden"):
        return {}
    if not any(r.attention is not None and r.attention.target in ATTENTION_OPS for r in s.regions):
        return {}  # an eager attention core: its scores are priced apart (time.py, flash = 0)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and within(module_path(n), s.layers[0])]
    dtype = next((p.dtype for p in gm.parameters() if p.dtype.is_floating_point), torch.float32)
    tokens = tuple(sym_hint(x) for x in placeholders[0].meta["val"].shape[:2])
    return {"elementwise_factor": elementwise_factor(nodes, tokens, dims, dtype)}


def _norm_elems(dims: dict) -> int:
    """Elements of one norm's weights: a scale (RMSNorm), and a bias too (LayerNorm)."""
    return dims["hidden"] * (2 if dims["norm"] == "layernorm" else 1)


def _layer_norms(s, params: dict, dims: dict) -> int:
    if not s.layers or not dims["hidden"]:
        return 2
    elems = sum(params[n].numel() for n in s.norm_weights if n in params and within(n, s.layers[0]))
    a, g, d = dims["num_heads"], dims["num_kv_heads"], dims["head_dim"]
    qk = (a + g) * d * dims["qk_norm"] + 2 * d * dims["qk_head_norm"]
    latent = dims.get("q_lora_rank", 0) + dims.get("kv_lora_rank", 0) if dims.get("kv_lora_rank") else 0
    count, rest = divmod(elems - qk - latent, _norm_elems(dims))
    return count if count > 0 and not rest else 2


def _outside_params(gm: GraphModule, s, params: dict, dims: dict) -> dict:
    """Parameters outside every layer: extra embedding tables, a norm of the embeddings (read
    before the first layer: the first pipeline stage's), and the rest beyond the spec's token
    table, final norm and LM head (tied parameters counted once)."""
    def ids(names):
        return {id(gm.get_parameter(n)) for n in names if n}

    token = s.embeddings[0].args[0].target if s.embeddings else None
    head = (s.lm_head.weight, s.lm_head.bias) if s.lm_head else ()
    tables = {n.args[0].target for n in s.embeddings if id(gm.get_parameter(n.args[0].target)) not in ids((token, *head))}
    counted = ids((token, *head, *tables))
    moe = {name for b in s.moe for name in params if within(name, b.module)}
    outside = {name: p for name, p in params.items()
               if not any(within(name, layer) for layer in s.layers) and name not in moe and id(p) not in counted}
    norm = _norm_elems(dims)
    before = _read_before_layers(gm, s, set(outside))
    embedding_norm = bool(before) and sum(outside[n].numel() for n in before) == norm
    rest = sum(p.numel() for n, p in outside.items() if not (embedding_norm and n in before))
    final_norm = [n for n in s.norm_weights if n in outside and n not in before]
    return {"embedding_extra_params": sum(gm.get_parameter(t).numel() for t in tables),
            "embedding_norm": embedding_norm, "head_extra_params": max(0, rest - norm),
            "norm_weight_offset": bool(final_norm) and all(_offset_only(gm, n) for n in final_norm)}


# Ops that pass a weight on unchanged (a cast to its own dtype, a view) and checks that read nothing.
_PASS_THROUGH = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.view.default}
_CHECKS = {aten._assert_tensor_metadata.default}


def _offset_only(gm: GraphModule, name: str) -> bool:
    """Whether weight ``name`` reaches the program only as ``weight + c`` for a number ``c`` (Gemma's
    ``x * (1 + w)``): its backward then reads the sum, never the weight."""
    frontier = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == name]
    seen = False
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.target in _CHECKS:
                continue
            if user.target in _PASS_THROUGH:
                frontier.append(user)
            elif user.target in (aten.add.Tensor, aten.add.Scalar) and any(
                    isinstance(x, (int, float)) for x in user.args if x is not node):
                seen = True
            else:
                return False
    return seen


def _read_before_layers(gm: GraphModule, s, names: set) -> set:
    """Those of parameters ``names`` that an op before the first layer's first op reads."""
    if not s.layers:
        return set()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    start = next((order[n] for n in gm.graph.nodes if n.op == "call_function" and within(module_path(n), s.layers[0])),
                 len(order))
    return {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in names
            and any(order[u] < start for u in n.users)}


def _seq_cumsums(gm: GraphModule, params: set) -> dict:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)]
    if not placeholders or placeholders[0].meta["val"].dim() < 2:
        return {}
    batch, seq = (sym_hint(x) for x in placeholders[0].meta["val"].shape[:2])
    calls, nbytes = 0, 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.cumsum.default:
            continue
        x = n.args[0].meta["val"]
        dim = n.args[1] % x.dim()
        if not isinstance(x.shape[dim], torch.SymInt) or sym_hint(x.shape[dim]) != seq or not _feeds_params(n, params):
            continue
        numel = 1
        for size in x.shape:
            numel *= sym_hint(size)
        calls += 1
        nbytes += numel // (batch * seq) * n.meta["val"].element_size()
    return {"seq_cumsums": calls, "seq_cumsum_bytes": nbytes}


def _feeds_params(node, params: set) -> bool:
    """Does ``node`` reach an op that reads a parameter (positions for a table), other than through an
    attention op or an eager core's softmax (a cumulative sum that only shapes the attention mask is
    dropped with the mask by ``passes/causal_mask.py``, or is refused with eager attention under cp)?"""
    todo, seen = [node], {node}
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op != "call_function" or user.target in _ATTENTION_STOPS:
                continue
            if any(i.op == "get_attr" and i.target in params for i in user.all_input_nodes):
                return True
            seen.add(user)
            todo.append(user)
    return False
