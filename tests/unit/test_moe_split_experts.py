"""Stacked experts run expert by expert on rows split by per-expert counts (JetMoE), in one process.

A tiny block written the way transformers writes JetMoE's MLP: the router counts the (token, slot)
pairs per expert (a one-hot of the top-k ids summed over the tokens, ``.tolist()``), sorts the pairs
by expert and gathers their tokens; two ``ParallelExperts`` each split the rows by the counts and
apply ``F.linear(rows_e, W[e])`` per expert, a gated activation runs between them; the outputs are
weighted and summed back with ``index_add``, and a bias is added after.  The analysis proves every
chunk runs expert 0's code with its own slice of the weights (:mod:`autopar.frontend.moe_split_experts`);
the cut-out body, run through dispatch / experts / combine, gives the module's output and gradients,
also on a rank's shard of the weights.  An attention-like block whose expert halves run around work
across tokens cannot be split: under ep it stays whole on every rank, a plan with tp is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.analyze_moe import expert_width
from autopar.frontend.trace import trace_model
from autopar.ops import moe as M
from autopar.runtime import compile_program

VOCAB, HIDDEN, WIDTH, EXPERTS, TOP_K = 32, 16, 8, 4, 2


class ParallelExperts(nn.Module):
    def __init__(self, out_size: int, in_size: int, odd: bool = False):
        super().__init__()
        self.odd = odd
        self.weight = nn.Parameter(torch.randn(EXPERTS, out_size, in_size) / in_size ** 0.5)

    def forward(self, rows, sizes):
        outs = []
        for e, chunk in enumerate(rows.split(sizes)):
            out = F.linear(chunk, self.weight[e])
            outs.append(out.tanh() if self.odd and e == 1 else out)  # "odd": expert 1 is not expert 0's code
        return torch.cat(outs)


def route(router: nn.Linear, x):
    """JetMoE's router: the pairs per expert, the pairs sorted by expert, their tokens and weights."""
    values, index = router(x).topk(TOP_K, dim=1)
    gates = values.softmax(1)
    sizes = x.new_zeros(x.shape[0], EXPERTS).scatter(1, index, 1).long().sum(0).tolist()
    _, order = index.flatten().sort(0)
    return order, order.div(TOP_K, rounding_mode="trunc"), gates.flatten()[order], sizes


class SplitMLP(nn.Module):
    """JetMoE's MoE: ``ParallelExperts`` up (gate and up halves), ``silu(g) * u``, ``ParallelExperts`` down."""

    def __init__(self, odd: bool = False):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.up = ParallelExperts(2 * WIDTH, HIDDEN, odd)
        self.down = ParallelExperts(HIDDEN, WIDTH)
        self.bias = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x):
        _, token, gates, sizes = route(self.router, x)
        return self.experts(x, token, gates, sizes) + self.bias

    def experts(self, x, token, gates, sizes):
        gate, up = self.up(x[token], sizes).chunk(2, dim=-1)
        out = self.down(F.silu(gate) * up, sizes) * gates[:, None]
        return x.new_zeros(x.shape).index_add(0, token, out)


class SplitAttention(nn.Module):
    """JetMoE's MoA: each expert's first half maps its rows back to (token, slot) order, where work
    across the tokens (here a running sum over the sequence standing for attention) runs before the second half."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.query = ParallelExperts(WIDTH, HIDDEN)
        self.output = ParallelExperts(HIDDEN, WIDTH)

    def forward(self, x, batch: int):
        order, token, gates, sizes = route(self.router, x)
        q = x.new_zeros(x.shape[0] * TOP_K, WIDTH).index_add(0, order, self.query(x[token], sizes))
        mixed = q.view(batch, -1, TOP_K, WIDTH).cumsum(1).view(-1, WIDTH)
        out = self.output(mixed[order], sizes) * gates[:, None]
        return x.new_zeros(x.shape).index_add(0, token, out)


class TinyJet(nn.Module):
    def __init__(self, mix: str = ""):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.attention = SplitAttention() if mix == "attention" else None
        self.mlp = SplitMLP(odd=mix == "odd")
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        x = h.reshape(-1, HIDDEN)
        if self.attention is not None:
            x = x + self.attention(x, ids.shape[0])
        return self.head(x + self.mlp(x)).view(*ids.shape, VOCAB)


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model(mix: str = "") -> tuple[TinyJet, torch.Tensor]:
    torch.manual_seed(0)
    return TinyJet(mix), torch.randint(0, VOCAB, (4, 8))


def test_split_experts_are_one_stacked_block():
    model, ids = _model()
    structure = analyze(trace_model(model, (ids,), {}, _loss).gm)
    block, = structure.moe
    assert block.style == "stacked" and block.split is not None and structure.moe_error is None
    assert block.param_names == ["model.mlp.up.weight", "model.mlp.down.weight"]
    assert block.expert_numel == 2 * WIDTH * HIDDEN + HIDDEN * WIDTH and (block.num_experts, block.top_k) == (4, 2)
    assert expert_width(block) == (WIDTH, True)  # the cost model's expert: gated, WIDTH wide


def test_the_rewritten_experts_compute_the_traced_block():
    """dispatch / experts / combine with the cut-out body (one process, every expert local) against
    the module: the same output and the same weight gradients."""
    model, ids = _model()
    traced, ctx = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    assert all(set(ctx.param_shards[f"model.mlp.{p}.weight"]) == {"ep"} for p in ("up", "down"))
    mlp, x = model.mlp, torch.randn(12, HIDDEN)
    params = [mlp.up.weight, mlp.down.weight]
    index = mlp.router(x).topk(TOP_K, dim=1)
    weights = index.values.softmax(1)
    rows, routing = M.moe_dispatch(x, index.indices, EXPERTS, "ep")
    got = M.moe_combine(M.moe_experts(rows, routing, traced.gm.moe_experts_0, params, "stacked", "ep"), weights,
                        routing, "ep")
    want = mlp(x) - mlp.bias
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(g, w)


def test_a_rank_runs_its_experts_with_its_own_slices():
    """The body on the rows of experts 2 and 3 with the shard ``W[2:4]`` (ep rank 1 of 2) gives those
    rows' outputs of the body on every expert: local expert j reads slice j of the shard."""
    model, ids = _model()
    traced, _ = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    body, mlp = traced.gm.moe_experts_0[0], model.mlp
    counts = torch.tensor([3, 1, 2, 4])
    rows = torch.randn(int(counts.sum()), HIDDEN)
    every = body(rows, counts.cumsum(0).to(torch.int32), mlp.up.weight, mlp.down.weight)
    mine = body(rows[4:], counts[2:].cumsum(0).to(torch.int32), mlp.up.weight[2:], mlp.down.weight[2:])
    torch.testing.assert_close(mine, every[4:])
    with pytest.raises(AutoparError, match=r"^autopar: 2 local experts but stacked weights of \[4\]"):
        body(rows[4:], counts[2:].cumsum(0).to(torch.int32), mlp.up.weight, mlp.down.weight[2:])


def test_experts_around_work_across_tokens_stay_whole_under_ep_and_refuse_tp():
    model, ids = _model("attention")
    structure = analyze(trace_model(model, (ids,), {}, _loss).gm)
    assert [b.module for b in structure.moe] == ["model.mlp"]
    traced, ctx = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    assert hasattr(traced.gm, "moe_experts_0") and not hasattr(traced.gm, "moe_experts_1")
    assert set(ctx.param_shards["model.mlp.up.weight"]) == {"ep"}
    assert "model.attention.query.weight" not in ctx.param_shards
    with pytest.raises(AutoparError) as info:
        compile_program(model, (ids,), {}, "tp=2", _loss, world_size=2)
    message = str(info.value)
    assert message.startswith("autopar: the stacked experts of 'model.attention', routed at"), message
    assert "is not row-wise" in message and "Use a plan with ep=1 and tp=1" in message, message


def test_an_expert_with_code_of_its_own_is_refused():
    model, ids = _model("odd")
    with pytest.raises(AutoparError) as info:
        compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    message = str(info.value)
    assert message.startswith("autopar: the stacked experts of 'model.mlp'"), message
    assert "expert 1's computation node 'tanh'" in message and "is not expert 0's" in message, message
