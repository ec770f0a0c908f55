"""Rules and recognition that Falcon's new decoder and DeepSeek-V3 need (issue 15), one process.

- ``x @ w.T`` projections are linears (Falcon's ``FalconLinear``), their bias an add after them;
- grouped-query attention written with ``broadcast_to`` (Falcon's KV groups) counts its KV heads;
- ``index.Tensor`` with replicated indices, ``gather`` / ``scatter`` along an unsharded dim, an
  in-place ``copy_`` and ``cat`` with a KV cache's legacy empty tensor have exact rules, and refuse
  what they cannot place;
- DeepSeek's routing weights gathered from sigmoid scores are the router's, outside the experts;
- multi-head latent attention under tp is refused naming the projection and its source line.

The multi-rank equality of these models is tests/dist/test_architectures.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import GraphModule

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.model_dims import structure_dims
from autopar.frontend.trace import trace_model
from autopar.ops import collectives as C
from autopar.passes.rules import RuleContext, lookup, tensor_inputs
from autopar.runtime import compile_program
from tests.support.models import MODELS, make_batch
from tests.unit.test_soundness import _Builder

aten = torch.ops.aten


def _structure(name: str, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    ids, target = make_batch(128, 4, 16, 0)  # the batch _compile and test_traced_fields trace: one export
    return analyze(trace_model(factory(**overrides), (ids,), kwargs, loss_fn, target).gm)


def _compile(name: str, plan: str, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(factory(**overrides), (ids,), kwargs, plan, loss_fn, world_size=2)


def test_falcon_projections_are_recognised_as_linears():
    s = _structure("hf_falcon")
    assert [(r.kind, [c.module.rsplit(".", 1)[-1] for c in r.columns], [w.module.rsplit(".", 1)[-1] for w in r.rows])
            for r in s.regions if ".h.0." in r.module + "."] == [("attention", ["query_key_value"], ["dense"]),
                                        ("mlp", ["dense_h_to_4h"], ["dense_4h_to_h"])]
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (4, 2, 16)  # 2 KV groups, broadcast to 4 heads
    dims = structure_dims(s)
    assert dims["norm"] == "layernorm" and not dims["gated_mlp"]


def test_falcon_bias_added_after_the_row_reduction():
    """``x @ w.T + b``: a column bias is sharded with the weight, a row bias added once after the
    all-reduce (the runner refuses a row-parallel partial sum plus a replicated bias)."""
    traced, _ = _compile("hf_falcon", "tp=2", bias=True)
    reduces = [n for n in traced.gm.graph.nodes if n.target is C.all_reduce
               and n.meta["autopar"].role == "row_output"]
    assert len(reduces) == 4  # attention and MLP, 2 layers
    for node in reduces:
        (user,) = node.users
        assert user.target is aten.add.Tensor and user.args[1].op == "get_attr"
        assert user.args[1].target.endswith(".bias")


def _placed(b, node, axis="tp", **options):
    """The rule's output placement for ``node``, its inputs placed as ``b`` says (no loss needed)."""
    b.graph.output((node,))
    rc = RuleContext(GraphModule(b.root, b.graph), axis, 2, {}, **options)
    return lookup(node.target)(node, [b.sharded.get(a, Replicate()) for a in tensor_inputs(node)], rc)


def _index(b, x, index_shape, positions, out_shape):
    idx = b.input("idx", *index_shape)
    idx.meta["val"] = torch.zeros(index_shape, dtype=torch.long)
    indices = [idx if i in positions else None for i in range(max(positions) + 1)]
    return b.op(aten.index.Tensor, x, indices, shape=out_shape)


@pytest.mark.parametrize("shard,positions,index_shape,out_shape,want", [
    (1, [3], (1,), (2, 8, 2, 1, 4), Shard(1)),  # Falcon's qkv[:, :, :, [-2]] on sequence shards
    (4, [3], (1,), (2, 8, 2, 1, 4), Shard(4)),  # a dim after the index keeps its place
    (4, [2, 3], (3,), (2, 8, 3, 4), Shard(3)),  # two adjacent indices: one dim of the index's shape
    (1, [0, 2], (3,), (3, 8, 6, 4), Shard(1)),  # separated indices: their dim first, then the rest
])
def test_index_moves_the_sharded_dim(shard, positions, index_shape, out_shape, want):
    b = _Builder()
    x = b.input("x", 2, 8, 2, 6, 4, shard=shard)
    out = _index(b, x, index_shape, positions, out_shape)
    want_shape = tuple(torch.zeros(2, 8, 2, 6, 4)[tuple(torch.zeros(index_shape, dtype=torch.long)
                                                        if i in positions else slice(None)
                                                        for i in range(max(positions) + 1))].shape)
    assert want_shape == out_shape  # the case's shapes are PyTorch's
    assert _placed(b, out) == want


def test_index_along_the_sharded_dim_is_refused():
    b = _Builder()
    x = b.input("x", 2, 8, 2, 6, 4, shard=3)
    out = _index(b, x, (1,), [3], (2, 8, 2, 1, 4))
    with pytest.raises(AutoparError, match=r"indexes along the sharded dim 3"):
        _placed(b, out)


def _picks(shard: int):
    """``scores.gather(1, idx)`` with scores [8, 4] and idx [8, 2] both sharded on ``shard``."""
    b = _Builder()
    scores = b.input("scores", 8, 4, shard=shard)
    idx = b.input("idx", 8, 2, shard=shard)
    idx.meta["val"] = torch.zeros(8, 2, dtype=torch.long)
    return b, idx, b.op(aten.gather.default, scores, 1, idx, shape=(8, 2))


def test_gather_and_scatter_follow_the_rows():
    """DeepSeek's router: ``scores.gather(1, idx)`` and ``mask.scatter_(1, idx, 1)`` per token."""
    b, idx, picked = _picks(0)
    mask = b.op(aten.scatter_.value, b.input("zeros", 8, 4, shard=0), 1, idx, 1.0, shape=(8, 4))
    assert _placed(b, picked, "cp") == Shard(0)
    assert lookup(mask.target)(mask, [Shard(0), Shard(0)], RuleContext(GraphModule(b.root, b.graph), "cp", 2, {})) \
        == Shard(0)


def test_gather_along_the_sharded_dim_is_refused():
    b, _, picked = _picks(1)
    with pytest.raises(AutoparError, match=r"gathers or scatters along dim 1"):
        _placed(b, picked)


@pytest.mark.parametrize("dst,src,ok", [(Shard(1), Shard(1), True), (Replicate(), Shard(1), False),
                                        (Shard(1), Replicate(), True)])
def test_copy_keeps_the_destination_placement(dst, src, ok):
    """A sharded value copied into a replicated tensor the graph did not just allocate is refused;
    a replicated one copied into a shard is sliced to it first (no communication)."""
    b = _Builder()
    d = b.input("dst", 2, 4, 8, 6, shard=dst.dim if isinstance(dst, Shard) else None)
    s = b.input("src", 2, 4, 8, 6, shard=src.dim if isinstance(src, Shard) else None)
    out = b.op(aten.copy_.default, d, s, shape=(2, 4, 8, 6))
    if ok:
        assert _placed(b, out) == dst
        assert (out.args[1].target is C.local_shard) == isinstance(src, Replicate)
    else:
        with pytest.raises(AutoparError, match=r"copies a value placed .* into a tensor placed"):
            _placed(b, out)


@pytest.mark.parametrize("read_first", [False, True])
def test_a_fresh_fill_takes_the_placement_of_its_first_write(read_first):
    """DeepSeek's keys: ``k = x.new_empty(b, heads, s, d); k[..., :n].copy_(k_nope)`` with the heads
    sharded allocates the rank's heads only (the fill's size rewritten); a fill read before the
    write stays replicated, and the write is refused."""
    b = _Builder()
    x = b.input("x", 2, 4, 8, 6)
    fill = b.op(aten.new_empty.default, x, [2, 4, 8, 10], shape=(2, 4, 8, 10))
    if read_first:
        b.op(aten.sum.default, fill, shape=())
    part = b.op(aten.slice.Tensor, fill, 3, 0, 6, shape=(2, 4, 8, 6))
    src = b.input("src", 2, 4, 8, 6, shard=1)
    out = b.op(aten.copy_.default, part, src, shape=(2, 4, 8, 6))
    placements = {n: b.sharded.get(n, Replicate()) for n in b.graph.nodes if n is not out}  # placed before it
    b.graph.output((out,))
    rc = RuleContext(GraphModule(b.root, b.graph), "tp", 2, {}, placements=placements)
    rule = lookup(out.target)
    if read_first:
        with pytest.raises(AutoparError, match=r"copies a value placed"):
            rule(out, [Replicate(), Shard(1)], rc)
        return
    assert rule(out, [Replicate(), Shard(1)], rc) == Shard(1)
    assert placements[fill] == placements[part] == Shard(1) and fill.args[1] == [2, 2, 8, 10]


def test_cat_skips_a_legacy_empty_tensor():
    """A KV cache's first ``cat([empty, k], dim=-2)`` under cp is this rank's k, not a concat
    along the sharded sequence."""
    b = _Builder()
    empty = b.input("empty", 0)
    k = b.input("k", 2, 4, 8, 6, shard=2)
    out = b.op(aten.cat.default, [empty, k], -2, shape=(2, 4, 8, 6))
    assert _placed(b, out, "cp", local_sizes=True) == Shard(2)


@pytest.mark.parametrize("op", [aten.cat.default, aten.stack.default])
def test_a_replicated_part_joined_with_shards_is_sliced(op):
    """RoC-BERT's embeddings: a sequence-sharded lookup concatenated with a replicated one along
    the hidden dim; each rank takes its slice of the replicated part (no communication).  Under
    cp (sizes already local) a replicated part of the full length is refused."""
    b = _Builder()
    x = b.input("x", 2, 8, 6, shard=1)
    y = b.input("y", 2, 8, 6)
    out = b.op(op, [x, y], -1, shape=(2, 8, 12) if op is aten.cat.default else (2, 8, 6, 2))
    assert _placed(b, out) == Shard(1)
    assert out.args[0][1].target is C.local_shard and out.args[0][1].args[1:] == (1, "tp")
    b2 = _Builder()
    x2, y2 = b2.input("x", 2, 8, 6, shard=1), b2.input("y", 2, 8, 6)
    with pytest.raises(AutoparError, match="replicated y meets this rank's tokens"):
        _placed(b2, b2.op(op, [x2, y2], -1, shape=(2, 8, 12)), "cp", local_sizes=True)


def test_reshape_as_and_expand_as_follow_their_model():
    """``x.reshape_as(other)`` / ``x.expand_as(other)`` take their sizes from ``other``: the output is
    placed like it, a replicated ``x`` expanded like a shard is sliced (RoFormer's rotary, HRM's
    carried state)."""
    b = _Builder()
    x = b.input("x", 2, 4, 8, 3, 2, shard=1)
    other = b.input("other", 2, 4, 8, 6, shard=1)
    assert _placed(b, b.op(aten.reshape_as.default, x, other, shape=(2, 4, 8, 6))) == Shard(1)
    b = _Builder()
    x, other = b.input("x", 2, 4, 8, 3, 2, shard=1), b.input("other", 2, 4, 8, 6)
    with pytest.raises(AutoparError, match="like one placed R"):
        _placed(b, b.op(aten.reshape_as.default, x, other, shape=(2, 4, 8, 6)))
    b = _Builder()
    state, hidden = b.input("state", 1, 8, 6), b.input("hidden", 2, 8, 6, shard=1)
    out = b.op(aten.expand_as.default, state, hidden, shape=(2, 8, 6))
    assert _placed(b, out) == Shard(1) and out.args[0].target is C.local_shard
    b = _Builder()
    state, hidden = b.input("state", 1, 1, 6), b.input("hidden", 2, 8, 6, shard=1)
    out = b.op(aten.expand_as.default, state, hidden, shape=(2, 8, 6))
    assert _placed(b, out) == Shard(1) and out.args[0] is state  # a size-1 dim broadcasts: no slice


def test_deepseek_routing_weights_are_the_routers():
    (block,) = _structure("hf_deepseek_v3").moe
    assert (block.num_experts, block.top_k) == (4, 2)
    assert block.weights not in block.region  # gathered, normalised, scaled: router arithmetic
    assert not any(n.target is aten.gather.default for n in block.region)
    assert block.module.endswith("layers.1.mlp")


def test_latent_attention_under_tp_keeps_the_latents_whole():
    """MLA under tp: the up-projections (q_b, kv_b) split by heads with o, the down-projections
    (q_a, kv_a) and the latent norms whole on every rank, their gradients partial over tp (summed
    by the tp bucket); the keys' empty tensor is allocated per rank at its heads."""
    traced, program = _compile("hf_deepseek_v3", "tp=2,sp")
    names = [n for n, _ in traced.gm.named_parameters() if ".self_attn." in n]
    whole = [n for n in names if any(k in n for k in ("q_a_proj", "kv_a_proj", "q_a_layernorm", "kv_a_layernorm"))]
    split = [n for n in names if any(k in n for k in ("q_b_proj", "kv_b_proj", "o_proj"))]
    assert len(whole) == 2 * 4 and len(split) == 2 * 3
    for name in whole:
        assert "tp" not in program.param_shards.get(name, {}), name
        assert program.grad_partial_axes[name] == frozenset({"tp"}), name
    for name in split:
        assert "tp" in program.param_shards[name], name


@pytest.mark.parametrize("model_name", ["hf_falcon", "hf_gemma2", "hf_bert", "hf_opt", "hf_gpt2"])
def test_config_and_module_give_the_same_spec(model_name):
    """``ModelSpec.from_hf_config`` reads each architecture's own keys (Falcon's KV groups and the
    heads its CP moves, Gemma 2's four norms and soft-capped logits, BERT's encoder tables and head
    transform, learned position tables, OPT's mask-derived positions) as the traced module shows them."""
    import dataclasses

    from autopar.cost import ModelSpec

    factory, _, kwargs = MODELS[model_name]
    model = factory()
    ids, _ = make_batch(128, 4, 16, 0)
    traced = ModelSpec.from_module(model, (ids,), kwargs)
    read = ModelSpec.from_hf_config(model.config.to_dict())
    # elementwise_factor is counted on the traced graph only (a config leaves it 1)
    fields = [f.name for f in dataclasses.fields(ModelSpec) if f.name not in ("name", "elementwise_factor")]
    assert {f: getattr(read, f) for f in fields} == {f: getattr(traced, f) for f in fields}
    assert read.elementwise_factor == 1.0
    assert read.num_params == traced.num_params == sum(p.numel() for p in model.parameters())


def test_deepseek_config_and_module_give_the_same_latent_attention():
    """``from_hf_config`` reads MLA's shapes (not plain attention with ``head_dim`` = the rope
    part); the traced module shows the same, and both count the model's parameters."""
    from autopar.cost import Cluster, ModelSpec, estimate

    factory, _, kwargs = MODELS["hf_deepseek_v3"]
    model = factory()
    ids, _ = make_batch(128, 4, 16, 0)
    traced = ModelSpec.from_module(model, (ids,), kwargs)
    read = ModelSpec.from_hf_config(model.config.to_dict())
    fields = ("num_heads", "num_kv_heads", "head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank",
              "qk_rope_head_dim", "num_experts", "top_k", "moe_ffn", "num_shared_experts")
    assert {f: getattr(read, f) for f in fields} == {f: getattr(traced, f) for f in fields}
    assert (read.head_dim, read.v_head_dim, read.kv_lora_rank, read.q_lora_rank) == (24, 16, 16, 32)
    assert read.num_params == traced.num_params == sum(p.numel() for p in model.parameters())
    assert estimate(read, Cluster(gpu="cpu", num_nodes=1, gpus_per_node=2), "tp=2,sp", seq_len=16, global_batch=4)


def test_search_splits_latent_attention_over_tp():
    import autopar
    from autopar.cost import ModelSpec

    spec = ModelSpec.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 8, "hidden_size": 1024,
                                     "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
                                     "intermediate_size": 2816, "kv_lora_rank": 128, "q_lora_rank": 256,
                                     "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64})
    from autopar.planning.search import enumerate_plans
    assert enumerate_plans(spec, 8, 2048, 64)["tp"].max() == 8
    # the whole down-projections cost each tp rank their FLOPs and weights, which split attention does not
    cluster = autopar.Cluster(gpu="h100", num_nodes=1, gpus_per_node=8)
    plain = spec.replace(kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0, v_head_dim=None)
    share = {}
    for name, model in (("mla", spec), ("plain", plain)):
        one, two = (autopar.estimate(model, cluster, p, seq_len=2048, global_batch=64).memory()["params"]
                    for p in ("dp=8", "tp=2,dp=4"))
        share[name] = two / one
    assert 0.5 < share["plain"] < share["mla"] < 1


def test_bert_regions_span_sibling_modules():
    """BERT's attention output and second MLP projection sit in sibling modules: each region is
    the enclosing module (``attention``, the layer), with the usual columns and rows."""
    s = _structure("hf_bert")
    layer0 = [(r.kind, r.module.split("layer.0")[-1], [c.module.rsplit(".", 2)[-2:] for c in r.columns],
               [w.module.rsplit(".", 2)[-2:] for w in r.rows]) for r in s.regions if ".layer.0." in r.module + "."]
    assert layer0 == [("attention", ".attention", [["self", "query"], ["self", "key"], ["self", "value"]],
                       [["output", "dense"]]),
                      ("mlp", "", [["intermediate", "dense"]], [["output", "dense"]])]
    assert structure_dims(s)["norm"] == "layernorm"


def test_a_mask_allowing_every_position_is_dropped():
    """An encoder's all-allowed mask becomes no mask (non-causal); causal masks still become
    ``is_causal=True``; CP then runs BERT's attention non-causal."""
    from autopar.ops import cp_attention as CPA

    traced, _ = _compile("hf_bert", "cp=2:allgather")
    attention = [n for n in traced.gm.graph.nodes if n.target is CPA.allgather_attention]
    assert len(attention) == 2 and all(n.kwargs["causal"] is False for n in attention)
    traced, _ = _compile("hf_llama", "cp=2:allgather")
    assert all(n.kwargs["causal"] is True for n in traced.gm.graph.nodes if n.target is CPA.allgather_attention)


@pytest.mark.parametrize("plan,fwd,bwd", [("cp=2:ulysses", 640, 640), ("cp=2:ring", 640, 1280)])
def test_latent_attention_cp_provenance_bytes(plan, fwd, bwd):
    """The CP attention node records the bytes it moves with K (24 = 16 + 8 dims) wider than
    V (16), per token of a rank: ulysses moves half of q, k, v and the output (4 heads:
    (96 + 96 + 64 + 64) * 4 B / 2); a ring hop packed K and V ((96 + 64) * 4 B), twice in backward."""
    import sympy

    from autopar.ops import cp_attention as CPA

    traced, _ = _compile("hf_deepseek_v3", plan)
    (node, *_) = [n for n in traced.gm.graph.nodes if n.target in (CPA.ulysses_attention, CPA.ring_attention)]
    got = node.meta["autopar"].bytes
    for phase, want in (("fwd", fwd), ("bwd", bwd)):
        coeff, rest = sympy.sympify(got[phase][1]).as_coeff_Mul()
        assert coeff == want and len(rest.free_symbols) == 2  # times the batch rows and local tokens
