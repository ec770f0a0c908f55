"""Unit tests of the graph passes on tiny graphs, in one process (no process group)."""
from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ops import collectives as C
from autopar.errors import AutoparError
from autopar.passes.context import META_KEY, PLACEMENT_KEY, ParamShard
from autopar.passes.runner import run_passes
from autopar.runtime import compile_program
from tests.support.models import MODELS, make_batch


def _compile(name, plan, world, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    model = factory(**overrides) if overrides else factory()
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(model, (ids,), kwargs, plan, loss_fn, world_size=world)


_COMM = {C.all_gather, C.reduce_scatter, C.all_reduce, C.region_entry, C.vocab_parallel_cross_entropy}


def _collectives(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _COMM]


def test_tp_shards_columns_rows_embedding_and_head():
    traced, ctx = _compile("example", "tp=2", 2)
    shards = ctx.param_shards
    assert shards["model.layers.0.attn.q_proj.weight"]["tp"] == ParamShard(0)
    assert shards["model.layers.0.attn.o_proj.weight"]["tp"] == ParamShard(1)
    assert shards["model.layers.1.mlp.down_proj.weight"]["tp"] == ParamShard(1)
    assert shards["model.embed_tokens.weight"]["tp"] == ParamShard(0)
    assert shards["model.lm_head.weight"]["tp"] == ParamShard(0)
    assert "model.norm.weight" not in shards
    ops = collections.Counter(n.target for n in traced.gm.graph.nodes)
    assert ops[C.region_entry] == 2 * 2 + 1  # attention + MLP per layer, LM head
    assert ops[C.all_reduce] == 2 * 2 + 1  # o_proj + down_proj per layer, embedding
    assert ops[C.vocab_parallel_embedding] == 1 and ops[C.vocab_parallel_cross_entropy] == 1
    assert ops[torch.ops.aten.cross_entropy_loss.default] == 0
    assert not ctx.grad_partial_axes  # no SP: replicated weights see replicated data


def test_every_inserted_collective_records_provenance():
    traced, ctx = _compile("example", "tp=2,sp", 2)
    nodes = _collectives(traced.gm)
    assert nodes
    for n in nodes:
        meta = n.meta[META_KEY]
        assert meta["pass"] in ("tensor_parallel_pass", "sequence_parallel_pass")
        assert meta["axis"] == "tp" and meta["reason"]
        assert meta["bytes"], n.name


def test_fused_projection_sharded_per_part():
    traced, ctx = _compile("example_fused", "tp=2", 2)
    qkv = ctx.param_shards["model.layers.0.attn.qkv_proj.weight"]["tp"]
    assert qkv == ParamShard(0, (64, 32, 32))
    split = next(n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.split_with_sizes.default)
    assert list(split.args[1]) == [32, 16, 16]


def test_local_shapes_rewritten_for_heads():
    traced, ctx = _compile("example", "tp=2", 2)
    views = [n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.view.default
             and n.meta[PLACEMENT_KEY]["tp"] == Shard(2) and len(n.args[1]) == 4]
    assert views, "the per-head views must be sharded on the heads dim"
    for v in views:
        heads = v.args[1][2]
        assert heads in (2, 1, -1), v.format_node()  # 4 query heads / 2 KV heads, split over tp=2


def test_sp_turns_boundaries_into_all_gather_and_reduce_scatter():
    traced, ctx = _compile("hf_llama", "tp=2,sp", 2)
    ops = collections.Counter(n.target for n in traced.gm.graph.nodes)
    assert ops[C.all_gather] == 5 and ops[C.reduce_scatter] == 5
    assert ops[C.region_entry] == 0 and ops[C.all_reduce] == 0
    for n in traced.gm.graph.nodes:
        if n.target in (C.all_gather, C.reduce_scatter):
            assert n.args[1] == 1  # the sequence dim of [batch, seq, hidden]
    # norms run on sequence shards, so their gradients are partial sums over tp
    assert set(ctx.grad_partial_axes) == {
        "model.model.layers.0.input_layernorm.weight", "model.model.layers.0.post_attention_layernorm.weight",
        "model.model.layers.1.input_layernorm.weight", "model.model.layers.1.post_attention_layernorm.weight",
        "model.model.norm.weight"}
    norm_out = next(n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.rsqrt.default)
    assert norm_out.meta[PLACEMENT_KEY]["tp"] == Shard(1)


def test_dp_buckets_cover_every_gradient_once():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, _ = make_batch(128, 4, 16, 0)
    traced, ctx = compile_program(factory(), (ids,), kwargs, "tp=2,sp,dp=2", loss_fn, world_size=4,
                                  bucket_bytes=20_000)
    dp = [b for b in ctx.grad_buckets if b.axis == "dp"]
    assert len(dp) > 1, "a small bucket cap must give several buckets"
    names = [p for b in dp for p in b.params]
    assert sorted(names) == sorted(n for n, _ in traced.gm.named_parameters())
    local = 0
    for name, p in traced.gm.named_parameters():
        local += p.numel() * 4 // (2 if name in ctx.param_shards else 1)
    assert sum(b.num_bytes for b in dp) == local


def test_row_parallel_bias_added_after_reduction():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(32, 16)
            self.up = nn.Linear(16, 32)
            self.down = nn.Linear(32, 16)
            self.head = nn.Linear(16, 32, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            x = x + self.down(F.gelu(self.up(x)))
            return self.head(x)

    ids = torch.randint(0, 32, (2, 8))
    traced, ctx = compile_program(Block(), (ids,), None, "tp=2", lambda o, t: F.cross_entropy(
        o.flatten(0, 1), t.flatten()), world_size=2)
    reduce = next(n for n in traced.gm.graph.nodes if n.target is C.all_reduce and "down" in n.args[2])
    (add,) = reduce.users
    assert add.target == torch.ops.aten.add.Tensor and add.args[1].target == "model.down.bias"
    assert ctx.param_shards["model.up.bias"]["tp"] == ParamShard(0)
    assert "model.down.bias" not in ctx.param_shards


class _Unruly(nn.Module):
    """An attention block with an op no sharding rule covers (cummax over the head dim)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.q = nn.Linear(16, 16, bias=False)
        self.k = nn.Linear(16, 16, bias=False)
        self.v = nn.Linear(16, 16, bias=False)
        self.o = nn.Linear(16, 16, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2)
        k = self.k(x).view(b, s, 4, 4).transpose(1, 2)
        v = self.v(x).view(b, s, 4, 4).transpose(1, 2)
        q = torch.cummax(q, dim=-1).values
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, 16)) @ self.embed.weight.t()


def test_op_without_rule_names_node_module_and_source_line():
    ids = torch.randint(0, 32, (2, 8))
    with pytest.raises(AutoparError) as info:
        compile_program(_Unruly(), (ids,), None, "tp=2", lambda o, t: F.cross_entropy(
            o.flatten(0, 1), t.flatten()), world_size=2)
    msg = str(info.value)
    assert msg.startswith("autopar:")
    assert "cummax" in msg and "no sharding rule" in msg
    assert "in module" in msg and "test_passes.py" in msg  # the source line of the user's code
    assert "in pass shard_propagation_pass" in msg and "tensor_parallel_pass" in msg


def test_runner_logs_time_and_op_count_changes():
    traced, ctx = _compile("example", "tp=2,sp", 2)
    assert [line.split(":")[0] for line in ctx.log] == [
        "cleanup_pass", "causal_mask_pass", "tensor_parallel_pass", "sequence_parallel_pass", "expert_parallel_pass",
        "shard_propagation_pass", "data_parallel_pass"]
    assert "all_gather +5" in ctx.log[3] and "region_entry -5" in ctx.log[3]


def test_runner_names_failing_pass_and_predecessors():
    def broken_pass(gm, ctx):
        raise ValueError("boom")

    traced, ctx = _compile("example", "none", 1)
    from autopar.passes.cleanup import cleanup_pass

    with pytest.raises(AutoparError, match=r"^autopar: pass broken_pass failed: ValueError: boom\n"
                                           r"  \(passes that ran before it: cleanup_pass\)"):
        run_passes(traced.gm, ctx, [cleanup_pass, broken_pass])

    def broken_on_a_node(gm, ctx):
        for node in gm.graph.nodes:
            if node.target is torch.ops.aten.scaled_dot_product_attention.default:
                raise IndexError("tuple index out of range")

    with pytest.raises(AutoparError, match=r"^autopar: pass broken_on_a_node failed at node 'scaled_dot_product_attention"
                                           r".*in module '.*attn.*'.*at .*model.py.*: IndexError"):
        run_passes(traced.gm, ctx, [broken_on_a_node])


def test_placements_are_pytorch_placements():
    traced, _ = _compile("example", "tp=2", 2)
    seen = {type(n.meta[PLACEMENT_KEY]["tp"]) for n in traced.gm.graph.nodes if PLACEMENT_KEY in n.meta
            and not isinstance(n.meta[PLACEMENT_KEY]["tp"], tuple)}
    assert {Replicate, Shard, Partial} <= seen


@pytest.mark.parametrize("plan,expected", [("tp=2,sp", True), ("tp=2", False), ("dp=2", False)])
def test_regather_hooks_only_where_sp_gathers(plan, expected):
    """The executors push the re-gather hooks (ops/regather.py) only for a program whose SP
    all-gathers backward re-gathers; elsewhere every saved tensor would pay a Python call for nothing."""
    from autopar.ops.regather import regathers

    traced, _ = _compile("example", plan, 2)
    assert regathers(traced.gm) is expected



class _Slices(nn.Module):
    """Full slices Python skips but torch.export records under dynamic shapes (every
    ``[:, :, None]``, ``[:, 0:]``), beside slices that cut or stride."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x):
        h = self.proj(x)
        a = h[:, :, None, :] * h[:, 0:][:, :, None, :]
        return a.sum() + h[:, 1:].sum() + h[::2, :, :3].sum()


def _slices(gm):
    return [n.args[1:] for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor]


def _keeps_whole_dim(args):
    start, end, step = (list(args[1:]) + [None, None, 1][len(args) - 1:])[:3]  # args: dim, start, end, step
    return start in (0, None) and end in (None, sys.maxsize) and step == 1


def test_cleanup_drops_only_slices_that_keep_a_whole_dim():
    """cleanup_pass replaces a slice of a whole dim with its input (eager PyTorch runs no op
    there) and keeps every slice that cuts or strides; the loss and gradients are unchanged."""
    from autopar.frontend.trace import trace_model
    from autopar.passes.cleanup import cleanup_pass

    model, x = _Slices(), torch.randn(4, 5, 6)
    traced = trace_model(model, (x,), loss_fn=lambda out, target: out)
    gm = traced.gm
    before = _slices(gm)
    assert sum(map(_keeps_whole_dim, before)) >= 4, before  # what torch.export records here
    loss_before = gm(x, traced.example_target)
    grads_before = torch.autograd.grad(loss_before, list(gm.parameters()))
    cleanup_pass(gm, None)
    gm.recompile()
    after = _slices(gm)
    assert not any(map(_keeps_whole_dim, after)), after
    assert sorted(after) == sorted([(1, 1, sys.maxsize), (0, 0, sys.maxsize, 2), (2, 0, 3)]), after
    loss = gm(x, traced.example_target)
    grads = torch.autograd.grad(loss, list(gm.parameters()))
    torch.testing.assert_close(loss, loss_before, rtol=0, atol=0)
    torch.testing.assert_close(grads, grads_before, rtol=0, atol=0)
    torch.testing.assert_close(loss, model(x), rtol=0, atol=0)


def test_a_mask_decision_taken_at_small_sizes_is_checked_past_every_window():
    """An 8-token sliding window looks causal at sequence 6 and 9 (what the pass checked before);
    the sizes it is checked at now reach past the window, so it stays a mask.  The plain causal
    mask of the same family is still proven causal."""
    import torch

    from autopar.frontend.trace import trace_model
    from passes.causal_mask import check_sizes, evaluate_sizes_only, mask_kind
    from tests.support.models import MODELS

    def first_mask(name):
        factory, loss_fn, kwargs = MODELS[name]
        ids = torch.zeros(2, 16, dtype=torch.long)
        traced = trace_model(factory(), (ids,), kwargs, loss_fn)
        sdpa = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
        return traced, sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs["attn_mask"]

    class Ctx:
        pass

    traced, mask = first_mask("hf_mistral_window")
    ctx = Ctx()
    ctx.batch_symbol, ctx.seq_symbol = traced.batch_symbol, traced.seq_symbol
    small = evaluate_sizes_only(mask, {str(ctx.batch_symbol): 2, str(ctx.seq_symbol): 6}, {})
    assert bool((small[0, 0] == torch.ones(6, 6, dtype=torch.bool).tril()).all())  # causal-looking at 6
    assert max(s for _, s in check_sizes(mask)) > 8
    assert mask_kind(mask, ctx) is None
    traced, mask = first_mask("hf_llama")
    ctx.batch_symbol, ctx.seq_symbol = traced.batch_symbol, traced.seq_symbol
    assert mask_kind(mask, ctx) == "causal"
