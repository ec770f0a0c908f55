"""KV-head replication in one process: tp that does not divide the KV heads (issue 28).

- the compiled program keeps the k and v projections whole (no tp layout), broadcasts one KV head
  to this rank's query heads only, or slices several after the GQA broadcast (a ``local_shard``
  with its provenance), and marks the K/V weights' gradients partial over tp (the DP pass's tp
  bucket);
- a fused QKV with one KV head (GPT-BigCode's ``c_attn`` cut by ``split``, Phi-3's ``qkv_proj`` by
  slices) keeps its KV rows whole and its query rows split (``ParamShard.whole``), the KV rows'
  gradient summed by ``sum_whole_rows`` (issue 40);
- what it cannot place is refused naming the projection: a fused QKV whose output is not cut at its
  parts (Falcon), an eager attention core (Gemma 2), and replication under context parallelism (the plan);
- the cost model prices it: the k/v weights whole in the rank's parameters and their gradient
  all-reduce over tp, in the tp partial-gradient row (a fused QKV's: per layer in backward).

The multi-rank equality and bytes are tests/dist/test_kv_replication.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops.whole_rows import sum_whole_rows
from autopar.passes.context import ParamShard
from autopar.plan_space import kv_cp_ok, kv_replicated
from autopar.runtime import compile_program
from autopar.runtime.weights.layout import local_index, shard_local
from tests.support.models import MODELS, make_batch


def _compile(name: str, plan: str, world: int = 2, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(factory(**overrides), (ids,), kwargs, plan, loss_fn, world_size=world)


def test_rules():
    assert kv_replicated(2, 1) and kv_replicated(4, 2) and kv_replicated(2, 5) and not kv_replicated(2, 4)
    assert kv_cp_ok(2, 1, 1) and kv_cp_ok(2, 2, 4) and not kv_cp_ok(2, 2, 1)


def _kv_replicated(traced, program) -> None:
    names = [n for n, _ in traced.gm.named_parameters()]
    kv = [n for n in names if n.endswith(("k_proj.weight", "v_proj.weight"))]
    assert len(kv) == 4
    for name in kv:
        assert "tp" not in program.param_shards.get(name, {}), name
        assert program.grad_partial_axes[name] == frozenset({"tp"}), name
    assert all("tp" in program.param_shards[n] for n in names if n.endswith("q_proj.weight"))
    assert any(b.axis == "tp" and set(kv) <= set(b.params) for b in program.grad_buckets)


def test_multi_query_broadcast_makes_only_the_ranks_copies():
    """One KV head: repeat_kv's expand makes this rank's a/tp copies (no slice, no rank holds all)."""
    traced, program = _compile("hf_llama", "tp=2,sp", num_key_value_heads=1)
    _kv_replicated(traced, program)
    assert not [n for n in traced.gm.graph.nodes if n.target is C.local_shard]
    attention = [n for n in traced.gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(attention) == 2
    for op in attention:
        for kv in op.args[1:3]:
            assert kv.meta["autopar_placement"]["tp"] == Shard(1) and kv.args[1][1] == 2  # 4 heads / tp
            expand = kv.args[0]
            assert expand.meta["autopar_placement"]["tp"] == Shard(2) and expand.args[1][1:3] == [1, 2]


def test_grouped_kv_heads_are_sliced_after_the_broadcast():
    """Two KV heads over tp=4: every rank computes both, broadcasts them to the 4 query heads and
    keeps its one head's copy (a local_shard with its provenance)."""
    traced, program = _compile("hf_llama", "tp=4", world=4, num_key_value_heads=2)
    _kv_replicated(traced, program)
    cuts = [n for n in traced.gm.graph.nodes if n.target is C.local_shard]
    assert len(cuts) == 4  # keys and values of 2 layers
    for cut in cuts:
        assert "KV-head replication" in cut.meta["autopar"].reason
        assert all("scaled_dot_product_attention" in str(u.target) for u in cut.users)


@pytest.mark.parametrize("name,overrides,cut", [("hf_gpt_bigcode", {}, "split_with_sizes"),
                                                ("hf_phi3", {"num_key_value_heads": 1}, "slice")])
def test_fused_qkv_keeps_its_kv_rows_whole(name, overrides, cut):
    """A fused QKV with one KV head (GPT-BigCode's split, Phi-3's slices): the weight and bias laid out
    block by block, the query block split, the KV blocks whole; propagation places the query part
    sharded and the KV parts replicated; each tensor enters through ``sum_whole_rows`` (with its
    provenance), whose KV rows' gradient is partial, so no tp bucket holds them."""
    traced, program = _compile(name, "tp=2,sp", **overrides)
    fused = {n: s["tp"] for n, s in program.param_shards.items() if n.endswith(("c_attn.weight", "qkv_proj.weight"))}
    assert len(fused) == 2 and all(s.whole == (False, True, True) and s.dim == 0 for s in fused.values())
    assert all(sum(s.local_blocks(2)) == s.blocks[0] // 2 + sum(s.blocks[1:]) for s in fused.values())
    assert not set(fused) & set(program.grad_partial_axes)
    sums = [n for n in traced.gm.graph.nodes if n.target is sum_whole_rows]
    assert {n.args[0].target for n in sums} >= set(fused)
    for n in sums:
        assert n.meta["autopar"].role == "whole_rows" and n.meta["autopar"].bytes["bwd"][0] == "all_reduce"
        assert n.meta["autopar_grad_placement"]["tp"] == Shard(0)
    parts = [n for n in traced.gm.graph.nodes if n.op == "call_function" and str(n.target).startswith(f"aten.{cut}")
             and n.args[0].meta.get("autopar_whole")]
    placed = [n.meta["autopar_placement"]["tp"] for n in parts]
    if cut == "slice":  # one node per part
        placed = [tuple(placed[i:i + 3]) for i in range(0, len(placed), 3)]
    assert len(placed) == 2 and all(p[0] == Shard(p[0].dim) and p[1:] == (Replicate(), Replicate()) for p in placed)


def test_fused_qkv_under_replication_without_its_parts_is_refused():
    """Falcon's fused qkv (``x @ w.T``, then a view by KV group): no split of its output feeds the
    query alone or the key and value alone, so it stays refused, naming the projection."""
    with pytest.raises(AutoparError, match=r"(?s)KV-head replication.*line.*fused weight.*plan without tp"):
        _compile("hf_falcon", "tp=2", num_kv_heads=1)


def test_whole_blocks_layout_cuts_and_indexes_alike():
    """``ParamShard.whole``: each rank keeps its share of the sharded blocks and every whole block."""
    shard = ParamShard(0, (4, 1, 1), whole=(False, True, True))
    full = torch.arange(6.0)
    pieces = [shard_local(full, {"tp": shard}, {"tp": (r, 2)}) for r in range(2)]
    assert [p.tolist() for p in pieces] == [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 4.0, 5.0]]
    assert local_index((6,), {"tp": shard}, {"tp": (1, 2)})[0].tolist() == [2, 3, 4, 5]


def test_eager_attention_under_replication_is_refused():
    with pytest.raises(AutoparError, match="KV-head replication needs attention through scaled_dot_product"):
        _compile("hf_gemma2", "tp=2", num_key_value_heads=1)


def test_replication_under_cp_is_refused():
    with pytest.raises(AutoparError, match="KV-head replication"):
        _compile("hf_llama", "tp=2,cp=2", world=4, num_key_value_heads=1)


def test_cost_model_prices_replicated_kv():
    """tp=2 on 1 KV head (no SP, so no norm is partial): the k/v weights, 2*g*d*H per layer, are
    whole on the rank and their gradient all-reduce is 2*(tp-1)/tp of their fp32 bytes."""
    L, H, A, D = 2, 64, 4, 16
    base = dict(name="mqa", num_layers=L, hidden=H, num_heads=A, ffn=128, vocab=128)
    cluster = autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=2)
    costs = {g: autopar.estimate(autopar.ModelSpec(**base, num_kv_heads=g), cluster, "tp=2", seq_len=16,
                                 global_batch=4) for g in (1, 2)}
    rows = [r for r in costs[1].comm_table() if r.phase == "grad" and r.axis == "tp"]
    assert [(r.collective, r.count) for r in rows] == [("all_reduce", 1)]
    kv_bytes = L * 2 * 1 * D * H * 4
    assert rows[0].bytes_sent == 2 * (2 - 1) / 2 * kv_bytes
    assert not [r for r in costs[2].comm_table() if r.phase == "grad" and r.axis == "tp"]  # sharded


def test_cost_model_prices_fused_kv_rows_in_backward():
    """A fused QKV (``fused_qkv``) under KV-head replication: the KV rows' gradients leave the tp
    partial-gradient row and are summed in backward, one all-reduce per layer for the weight
    (``2 g d H`` elements) and one for the bias; with tp dividing the KV heads there is none."""
    L, H, A, D = 2, 64, 4, 16
    base = dict(name="mqa", num_layers=L, hidden=H, num_heads=A, ffn=128, vocab=128, qkv_bias=True, fused_qkv=True)
    cluster = autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=2)
    costs = {g: autopar.estimate(autopar.ModelSpec(**base, num_kv_heads=g), cluster, "tp=2", seq_len=16,
                                 global_batch=4, dtype_bytes=4) for g in (1, 2)}
    rows = [r for r in costs[1].comm_table() if "fused QKV" in r.what]
    ring = 2 * (2 - 1) / 2  # an all-reduce sends 2(n-1)/n of its buffer
    assert sorted((r.phase, r.collective, r.count, r.bytes_sent) for r in rows) == [
        ("bwd", "all_reduce", L, ring * 2 * D * 4), ("bwd", "all_reduce", L, ring * 2 * D * H * 4)]
    assert not [r for r in costs[1].comm_table() if r.phase == "grad" and r.axis == "tp" and r.bytes_sent]
    assert not [r for r in costs[2].comm_table() if "fused QKV" in r.what]
