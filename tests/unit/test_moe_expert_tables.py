"""Stacked experts with per-expert tables (GPT-OSS's biases) under the experts rewrite, in one process.

A tiny MoE block written the way transformers 5.x writes GPT-OSS's experts: the (token, slot)
pairs sorted by expert, a grouped matmul over the sorted rows plus a bias gathered by the sorted
expert ids (``bias[ids]``), then the weighting and the sum over slots.  The analysis proves that
``ids`` is each sorted row's expert (the values of the sort whose positions gathered the rows), so
the rewrite (passes/expert_parallel.py) hands the cut-out experts each row's expert among the
rank's experts and shards the tables with the weights under ep.  The dispatch / experts / combine
ops run in one process (no ep group) give the traced block's output and gradients.  The ids used
other than to read a per-expert table, or ids that the graph does not prove are the rows' experts
(a descending sort), are refused with an ``autopar:`` error.  Two routing variants are found too:
top-1 (HunYuan-MoE: the sorted rows are ``[T, h]`` like the output), LongCat's zero experts (the
top-k chosen in a ``torch.no_grad()`` region, choices past the experts folded onto them), Ergo's
row per (token, slot), routed with unit weights and weighted after the experts, and PhiMoE's slots
picked by a max each (no top-k: ids concatenated from max indices over the router's outputs).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.ops import moe as M
from autopar.runtime import compile_program

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as _hf_moe  # noqa: E402,F401  (registers grouped_mm_fallback)

VOCAB, HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 4, 2


class Experts(nn.Module):
    """Stacked experts with biases read at the sorted expert ids; ``mix`` alters the block."""

    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.top_k = 1 if mix == "top-1" else TOP_K
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH) / HIDDEN ** 0.5)
        self.up_bias = nn.Parameter(torch.randn(EXPERTS, WIDTH))
        self.down = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) / WIDTH ** 0.5)
        self.down_bias = nn.Parameter(torch.randn(EXPERTS, HIDDEN))

    def forward(self, x, index, weights):
        if self.mix == "per-slot":  # Ergo: a row per (token, slot) routed with unit weights, weighted after
            rows = self.routed(x.repeat_interleave(TOP_K, dim=0), index.reshape(-1, 1),
                               x.new_ones(index.numel(), 1), 1)
            return (rows.view(-1, TOP_K, HIDDEN) * weights.unsqueeze(-1)).sum(1)
        return self.routed(x, index, weights, self.top_k)

    def routed(self, x, index, weights, top_k):
        keys, perm = index.reshape(-1).sort(descending=self.mix == "descending")
        rows = x[perm // top_k]
        offsets = torch.histc(keys.float(), bins=EXPERTS, min=0, max=EXPERTS - 1).cumsum(0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(rows, self.up, offsets) + self.up_bias[keys]
        h = torch.nn.functional.silu(h)
        out = torch.ops.transformers.grouped_mm_fallback(h, self.down, offsets) + self.down_bias[keys]
        if self.mix == "ids-arith":  # the ids as a number: a rank's local ids would differ
            out = out + keys.unsqueeze(-1).to(out.dtype)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, top_k, HIDDEN).sum(1)


ZERO = 2  # "zero-experts": router outputs past the experts (LongCat)


class TinyMoE(nn.Module):
    def __init__(self, mix: str = ""):
        super().__init__()
        self.mix = mix
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS + ZERO * (mix == "zero-experts") + (mix == "skip"), bias=False)
        self.experts = Experts(mix)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        x = h.reshape(-1, HIDDEN)
        weights, index = self.skip(h) if self.mix == "skip" else self.route(x)
        return self.head(h + self.experts(x, index, weights).view(h.shape))

    def route(self, x):
        scores = self.router(x).softmax(-1)
        if self.mix == "groups":  # DeepSeek-V3 / Kimi: the best group of 2 experts first, then the top-k in it
            best = scores.view(-1, 2, EXPERTS // 2).amax(-1).topk(1, dim=-1).indices
            keep = torch.zeros_like(scores).view(-1, 2, EXPERTS // 2).scatter(1, best.unsqueeze(-1).expand(
                -1, 1, EXPERTS // 2), 1.0).view_as(scores)
            return scores.masked_fill(keep == 0, 0.0).topk(self.experts.top_k, dim=-1)
        if self.mix in ("max-slots", "max-widths"):  # PhiMoE: each slot's expert by a max, no top-k
            first = scores.max(dim=-1)[1].unsqueeze(-1)
            rest = scores.scatter(-1, first, 0.0)
            # "max-widths": the second pick over 3 of the 4 scores (no index over the router's outputs)
            second = (rest[:, :3] if self.mix == "max-widths" else rest).argmax(-1, keepdim=True)
            index = torch.cat([first, second], dim=-1)
            return scores.gather(-1, index), index
        if self.mix != "zero-experts":
            return scores.topk(self.experts.top_k, dim=-1)
        # LongCat: the choice made without gradients, choices past the experts weighted 0 and folded
        # onto the experts, whose outputs they then multiply by 0
        index = _choose(scores)
        zero = index >= EXPERTS
        weights = scores.gather(1, index).masked_fill(zero, 0.0)
        return weights, torch.where(zero, (index - EXPERTS) * EXPERTS // ZERO, index)


    def skip(self, h):
        """ZAYA: a top-k over ``[b, s, E + 1]`` scores whose last class is "no expert": chosen, it is
        weighted 0 and folded onto expert 0; the ids are flattened to ``[T, k]`` after."""
        scores = self.router(h).softmax(-1)
        weights, index = scores.topk(TOP_K, dim=-1)
        skipped = index == EXPERTS
        return weights.masked_fill(skipped, 0.0).reshape(-1, TOP_K), index.masked_fill(skipped, 0).reshape(-1, TOP_K)


@torch.no_grad()
def _choose(scores):
    return scores.topk(TOP_K, dim=-1).indices


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model(mix: str = "") -> tuple[TinyMoE, torch.Tensor]:
    torch.manual_seed(0)
    return TinyMoE(mix), torch.randint(0, VOCAB, (4, 8))


def test_per_expert_tables_read_at_the_sorted_ids_are_part_of_the_experts():
    model, ids = _model()
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.style == "stacked" and block.expert_ids is not None
    assert sorted(block.param_names) == sorted(f"model.experts.{p}" for p in ("up", "up_bias", "down", "down_bias"))
    assert block.expert_numel == HIDDEN * WIDTH * 2 + WIDTH + HIDDEN


def test_ep_shards_the_tables_with_the_weights():
    model, ids = _model()
    _, ctx = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    for name in ("up", "up_bias", "down", "down_bias"):
        assert set(ctx.param_shards[f"model.experts.{name}"]) == {"ep"}, name
    assert {f"model.experts.{p}" for p in ("up_bias", "down_bias")} <= set(ctx.expert_params)


def test_routing_chosen_without_gradients_and_folded_onto_the_experts():
    """LongCat: the top-k runs in a ``torch.no_grad()`` region of its own, over 6 router outputs, and
    the two past the 4 experts are folded onto them by a ``where``: the block's ids are the fold's."""
    model, ids = _model("zero-experts")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.num_experts == EXPERTS and block.top_k == TOP_K
    assert block.index.target is torch.ops.aten.where.self and block.expert_ids is not None


def test_a_group_limited_router_is_one_block_of_its_last_top_k():
    """Two top-k's (the groups, then the experts in them): the ids the block sorts by are the last
    top-k's own, not a fold of the groups' top-k, so the block is found once, from the last."""
    model, ids = _model("groups")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.index.args[0].target is torch.ops.aten.topk.default and block.index.args[0].args[1] == TOP_K


def test_a_row_per_slot_routed_with_unit_weights():
    """Ergo: the tokens repeated per slot, each (token, slot) row routed alone (ids ``[T * k, 1]``)
    with unit weights, weighted and summed over the slots after the experts (outside the block)."""
    model, ids = _model("per-slot")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.top_k == 1 and tuple(block.index.meta["val"].shape) == (ids.numel() * TOP_K, 1)
    assert block.tokens.target is torch.ops.aten.repeat_interleave.self_int
    assert block.weights.target is torch.ops.aten.new_ones.default


def test_a_skip_class_over_the_batch_and_sequence_is_folded_onto_the_experts():
    """ZAYA: the top-k runs over ``[b, s, E + 1]`` (3-D ids); the block sorts the flattened fold."""
    model, ids = _model("skip")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.num_experts == EXPERTS and block.top_k == TOP_K
    assert tuple(block.index.meta["val"].shape) == (ids.numel(), TOP_K)


def test_slots_picked_by_max_are_a_routing():
    """PhiMoE's sparse mixer: no top-k; each slot's expert is the index of a max over the router's 4
    scores (the second with the first masked out), the columns concatenated into the ids the experts
    sort.  The ids are indices over the 4 outputs by their dataflow, so the block is found."""
    model, ids = _model("max-slots")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.num_experts == EXPERTS and block.top_k == TOP_K and block.style == "stacked"
    assert block.index.target is torch.ops.aten.cat.default and block.router is not None
    assert block.weights.target is torch.ops.aten.gather.default


def test_max_columns_over_other_widths_are_no_routing():
    """A column that is a max over 3 of the 4 scores: the ids are no proven index over one router's
    outputs, so no block is found (and ep has no experts to split)."""
    model, ids = _model("max-widths")
    assert analyze(trace_model(model, (ids,), {}, _loss).gm).moe == []
    with pytest.raises(AutoparError, match="has no experts; drop ep"):
        compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)


def test_dispatch_refuses_ids_past_the_experts():
    x, index = torch.randn(3, HIDDEN), torch.tensor([[0, 1], [2, EXPERTS], [1, 3]])
    with pytest.raises(AutoparError, match=r"^autopar: MoE dispatch met expert id 4 but the block has 4"):
        M.moe_dispatch(x, index, EXPERTS, "ep")


def test_with_top_1_the_output_is_the_rows_back_in_token_order():
    """Top-1 (HunYuan-MoE): the expert rows sorted by expert are [T, h] like the block's output; the
    output is where the rows are put back in token order (``out[inverse]``), not the sorted rows."""
    model, ids = _model("top-1")
    block, = analyze(trace_model(model, (ids,), {}, _loss).gm).moe
    assert block.top_k == 1 and block.output.target is torch.ops.aten.index.Tensor
    assert block.output.args[0] in block.region and block.body_io[0][2] is not block.output


@pytest.mark.parametrize("mix,capacity", [("", None), ("", 0.5), ("top-1", None), ("zero-experts", None),
                                         ("per-slot", None), ("skip", None), ("max-slots", None)])
def test_the_rewritten_experts_compute_the_traced_block(mix, capacity):
    """dispatch / experts / combine with the cut-out body (ep=1, one process) against the module:
    the same output and the same gradients of the tables (``capacity`` drops rows: the ids must
    follow the rows that are kept)."""
    model, ids = _model(mix)
    traced, _ = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    body = traced.gm.moe_experts_0
    experts = model.experts
    x = torch.randn(12, HIDDEN)
    weights, index = model.skip(x.view(3, 4, HIDDEN)) if mix == "skip" else model.route(x)
    params = [experts.up, experts.up_bias, experts.down, experts.down_bias]
    x_in, index_in, weights_in = x, index, weights
    if mix == "per-slot":
        x_in, index_in = x.repeat_interleave(TOP_K, dim=0), index.reshape(-1, 1)
        weights_in = x.new_ones(index.numel(), 1)
    rows, routing = M.moe_dispatch(x_in, index_in, EXPERTS, "ep", capacity)
    got = M.moe_combine(M.moe_experts(rows, routing, body, params, "stacked", "ep", True), weights_in, routing,
                        "ep")
    if mix == "per-slot":
        got = (got.view(-1, TOP_K, HIDDEN) * weights.unsqueeze(-1)).sum(1)
    got_grads = torch.autograd.grad(got.square().sum(), params)
    if capacity is None:
        want = experts(x, index, weights)
    else:  # the reference drops the same rows: each expert keeps its earliest pairs
        keep = torch.zeros(index.numel(), dtype=torch.bool)
        keep[routing.order] = True
        want = experts(x, index, weights * keep.view_as(weights))
    want_grads = torch.autograd.grad(want.square().sum(), params)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_local_expert_ids_follow_the_counts():
    assert M.local_expert_ids([2, 0, 3], "cpu").tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize("mix,found", [
    ("ids-arith", "depend on ['to_1', 'cumsum'] besides the sorted tokens, the parameters and per-expert"),
    ("descending", "depend on ['index_2', 'cumsum', 'index_1'] besides"),
])
def test_ids_the_rewrite_cannot_carry_are_refused(mix, found):
    model, ids = _model(mix)
    with pytest.raises(AutoparError) as info:
        compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    message = str(info.value)
    assert message.startswith("autopar:") and found in message, message
    assert "(Experts)" in message, message


def test_experts_around_other_work_are_refused_naming_the_routing():
    """JetMoE's mixture of attention heads: each expert's query projection and output projection run
    around the attention, so they are not split; its MLP experts are (tests/unit/test_moe_split_experts.py),
    and under tp, which needs every block rewritten, the attention experts are refused by name."""
    from benchmarks.models import hf_loss, hf_model

    model = hf_model("JetMoeConfig", "JetMoeForCausalLM", 0, dict(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64), {})
    with pytest.raises(AutoparError) as info:
        compile_program(model, (torch.randint(0, 128, (2, 16)),), {"use_cache": False}, "tp=2", hf_loss,
                        world_size=2)
    message = str(info.value)
    assert message.startswith("autopar: the stacked experts of 'model.model.layers.0.self_attention.experts'"), message
    assert "(JetMoeTopKGating)" in message and "is not row-wise" in message, message
    assert "Use a plan with ep=1 and tp=1" in message, message


class _TopKeys(nn.Module):
    """A sparse attention indexer: each position keeps its 2 best keys by a top-k over the positions."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 8)
        self.head = nn.Linear(8, 128)

    def forward(self, ids):
        h = self.embed(ids)
        keys = (h @ h.transpose(1, 2)).topk(2, dim=-1).indices  # [b, s, 2] over s positions
        picked = torch.gather(h.unsqueeze(1).expand(-1, ids.shape[1], -1, -1), 2,
                              keys[..., None].expand(-1, -1, -1, 8)).mean(2)
        return self.head(h + picked)


def test_a_top_k_over_the_positions_is_no_routing():
    """DeepSeek-V4's indexer: a top-k over a symbolic number of positions picks keys, not experts (the
    analysis crashed converting the sequence length to an int)."""
    loss = lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    s = analyze(trace_model(_TopKeys(), (torch.randint(0, 128, (2, 8)),), None, loss).gm)
    assert s.moe == [] and s.moe_error is None
