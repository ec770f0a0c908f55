"""Expert parallelism of dense experts (every expert on every token, Llama 4), in one process.

Under ep the EP pass (passes/dense_expert_parallel.py) cuts the dense experts out of the graph and
makes their expert count local by placement propagation: rank ``r`` runs experts ``[r E/ep, (r+1)
E/ep)`` on every token of its ep group, and the ranks' partial sums are reduce-scattered back
(autopar/ops/dense_moe.py).  Here the cut-out body is run once per simulated rank on its experts'
parameter rows and score columns: the sum of the ranks' outputs, and the parameters' gradients
assembled from the ranks' rows, must be those of the unparallelized module.  A body that mixes
the experts' scores (a softmax over the experts) cannot be split by columns: refused by name.
The multi-rank training half is tests/dist/test_ep.py::test_dense_experts_match_single_process.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.errors import AutoparError
from autopar.runtime import compile_program

VOCAB, HIDDEN, WIDTH, EXPERTS = 32, 16, 8, 4


class DenseExperts(nn.Module):
    """Llama 4's experts block written by hand: the tokens repeated per expert, scaled by the
    sigmoid of the top-k router logits (0 elsewhere), one batched matmul over every expert.
    ``mix``: the scores are normalised over the experts inside the experts (a softmax)."""

    def __init__(self, top_k: int = 2, mix: bool = False):
        super().__init__()
        self.top_k, self.mix = top_k, mix
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * WIDTH) / HIDDEN ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) / WIDTH ** 0.5)

    def scores(self, x):
        logits = self.router(x)
        top, index = logits.topk(self.top_k, dim=1)
        return torch.full_like(logits, float("-inf")).scatter(1, index, top).sigmoid()

    def experts(self, x, scores):
        weights = scores.t().softmax(0) if self.mix else scores.t()
        rows = x.repeat(EXPERTS, 1) * weights.reshape(-1, 1)
        gate, up = torch.bmm(rows.view(EXPERTS, -1, HIDDEN), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down).view(-1, HIDDEN)
        return out.view(EXPERTS, -1, HIDDEN).sum(0)

    def forward(self, x):
        return self.experts(x, self.scores(x))


class TinyDense(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.moe = DenseExperts(**kwargs)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.moe(h.reshape(-1, HIDDEN)).view(h.shape))


def _loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _model(**kwargs):
    torch.manual_seed(0)
    return TinyDense(**kwargs), torch.randint(0, VOCAB, (4, 8))


def _split_sum(body, x, scores, params, ep):
    """The ranks' partial sums added up, each rank given its experts' parameter rows and score columns
    (what dense_gather and the parameter layout hand it), on every token."""
    local = EXPERTS // ep
    return sum(body(x, scores[:, r * local:(r + 1) * local], *(p[r * local:(r + 1) * local] for p in params))
               for r in range(ep))


@pytest.mark.parametrize("ep,top_k", [(2, 2), (4, 1)])
def test_the_ranks_experts_add_up_to_the_block(ep, top_k):
    model, ids = _model(top_k=top_k)
    traced, program = compile_program(model, (ids,), {}, f"dp={ep},ep={ep}", _loss, world_size=ep)
    moe = model.moe
    params = [moe.gate_up, moe.down]
    assert set(program.expert_params) == {"model.moe.gate_up", "model.moe.down"}
    assert all(program.param_shards[f"model.moe.{p}"]["ep"].dim == 0 for p in ("gate_up", "down"))
    torch.manual_seed(1)
    x = torch.randn(12, HIDDEN)
    scores = moe.scores(x).detach()
    got = _split_sum(traced.gm.dense_experts_0, x, scores, params, ep)
    want = moe.experts(x, scores)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.square().sum(), params),
                    torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(g, w)


def test_each_rank_repeats_the_tokens_for_its_own_experts_only():
    model, ids = _model()
    traced, _ = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    body = traced.gm.dense_experts_0
    repeats = [n for n in body.graph.nodes if n.target is torch.ops.aten.repeat.default]
    assert [list(n.args[1]) for n in repeats] == [[EXPERTS // 2, 1]]
    assert "local_shard" not in body.code  # no slice of all E copies


def test_the_program_view_shows_the_local_experts():
    from autopar.views.program import format_program

    model, ids = _model()
    traced, program = compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    text = format_program(traced.gm, program)
    assert "# dense_experts_0: this rank's experts" in text and f"repeat.default(tokens, [{EXPERTS // 2}, 1])" in text
    assert "dense_gather(" in text and "fwd all_gather sends" in text and "fwd reduce_scatter sends" in text


def test_scores_mixed_over_the_experts_are_refused():
    model, ids = _model(mix=True)
    with pytest.raises(AutoparError) as info:
        compile_program(model, (ids,), {}, "dp=2,ep=2", _loss, world_size=2)
    message = str(info.value)
    assert message.startswith("autopar: cannot shard node 'softmax'") and "mesh axis 'ep'" in message, message
    assert "(DenseExperts)" in message and "reduces over the sharded dim 0" in message, message
    assert "use a plan without ep" in message, message


def test_without_ep_the_experts_run_as_traced():
    model, ids = _model()
    traced, program = compile_program(model, (ids,), {}, "dp=2", _loss, world_size=2)
    assert not hasattr(traced.gm, "dense_experts_0") and not program.expert_params
