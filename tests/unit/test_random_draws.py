"""Random draws over a dp rank's rows, in one process: the op, the rewrite and the refusals.

:func:`autopar.ops.draws.rows_draw` run as rank ``r`` of a 2-rank ``dp`` axis (a step context
without process groups) gives rows ``r`` of the draw one device makes for the whole batch, for
in-place fills, ``*_like`` draws, draws sized by a list, along any dim and in any layout.  A
sampling router (tests/support/draw_jobs.py) compiled for ``dp=2`` has every draw over its tokens
made that way; what cannot be one device's numbers is refused with an ``autopar:`` error naming
the draw: micro-batches, the tokens interleaved by a view, rows in a rank-local order, numbers that
depend on the drawn-for values, a draw inside a custom autograd Function.  The multi-rank half is
tests/dist/test_random_draws.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.frontend.op_sets import RANDOM_DRAWS
from autopar.ops import draws
from autopar.ops.step import AxisGroup, StepContext, activate
from autopar.runtime import compile_program

pytest.importorskip("transformers")
from tests.support.draw_jobs import HIDDEN, VOCAB, SamplingMoE, loss_fn  # noqa: E402

aten = torch.ops.aten


def _as_rank(rank: int, call):
    """``call()`` as rank ``rank`` of a 2-rank dp axis, from seed 3."""
    torch.manual_seed(3)
    with activate(StepContext(groups={"dp": AxisGroup(None, 2, rank)})):
        return call()


@pytest.mark.parametrize("op,dim,local,args,whole", [
    ("aten::exponential_.default", 0, lambda: torch.empty(3, 4), (), lambda: torch.empty(6, 4).exponential_()),
    ("aten::uniform_.default", 1, lambda: torch.empty(2, 3, 5), (0.5, 2.0),
     lambda: torch.empty(2, 6, 5).uniform_(0.5, 2.0)),
    ("aten::rand_like.default", 0, lambda: torch.empty(4, 1), (), lambda: torch.rand(8, 1)),
    ("aten::randn_like.default", 1, lambda: torch.empty(3, 2).t(), (), lambda: torch.randn_like(torch.empty(6, 2).t())),
    ("aten::bernoulli_.float", 0, lambda: torch.empty(3, 2), (0.3,), lambda: torch.empty(6, 2).bernoulli_(0.3)),
])
def test_each_rank_gets_its_rows_of_the_whole_draw(op, dim, local, args, whole):
    torch.manual_seed(3)
    want = whole()
    for rank in (0, 1):
        x = local()
        got = _as_rank(rank, lambda: draws.rows_draw(op, dim, "dp", x, *args))
        rows = x.shape[dim]
        torch.testing.assert_close(got, want.narrow(dim, rank * rows, rows), rtol=0, atol=0)
        if op.endswith("_.default") or op.endswith("_.float"):
            assert got is x  # an in-place fill fills the tensor it was given


def test_a_draw_sized_by_a_list_and_the_generator_after_it():
    torch.manual_seed(3)
    want, after = torch.randint(0, 9, (2, 8)), torch.rand(1)
    for rank in (0, 1):
        got = _as_rank(rank, lambda: (draws.rows_draw("aten::randint.low", 1, "dp", 0, 9, [2, 4]), torch.rand(1)))
        torch.testing.assert_close(got[0], want[:, 4 * rank:4 * rank + 4], rtol=0, atol=0)
        assert torch.equal(got[1], after)  # every rank's generator advanced as one device's did


def test_outside_a_step_it_is_the_op():
    torch.manual_seed(3)
    want = torch.empty(3, 4).exponential_()
    torch.manual_seed(3)
    assert torch.equal(draws.rows_draw("aten::exponential_.default", 0, "dp", torch.empty(3, 4)), want)


def _compile(model: nn.Module, plan: str = "dp=2"):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 8))
    return compile_program(model, (ids,), {}, plan, loss_fn, world_size=2)


def test_every_draw_over_the_tokens_is_made_for_the_whole_batch():
    traced, _ = _compile(SamplingMoE())
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert not [n for n in nodes if n.target in RANDOM_DRAWS]
    made = [n.args[:3] for n in nodes if n.target is draws.rows_draw]
    assert sorted(made) == sorted([("aten::uniform_.default", 0, "dp"), ("aten::exponential_.default", 0, "dp"),
                                   ("aten::exponential_.default", 0, "dp"), ("aten::rand_like.default", 0, "dp")])


def test_over_values_replicated_on_tp_a_draw_stays():
    """Every tp rank holds all the tokens: each makes the one device's draw itself."""
    traced, _ = _compile(Drawn("plain"), "tp=2")
    assert [n.target for n in traced.gm.graph.nodes if n.target in RANDOM_DRAWS] == [aten.rand_like.default]
    assert not [n for n in traced.gm.graph.nodes if n.target is draws.rows_draw]


class Drawn(nn.Module):
    """A draw over the tokens that cannot be one device's numbers, by ``use``."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)  # an MLP for tp to split
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        if self.use == "hidden":  # on the MLP's hidden features, split over tp
            return self.head(h + self.down(self.up(h).relu() * torch.rand_like(self.up(h))))
        h = h + self.down(self.up(h).relu())
        if self.use == "attended":  # attention over the sequence, for cp to split
            h = h + nn.functional.scaled_dot_product_attention(h[:, None], h[:, None], h[:, None], is_causal=True)[:, 0]
        if self.use == "interleaved":  # the tokens sequence-major: a rank's rows are no block of the batch's
            noise = torch.rand_like(h.transpose(0, 1).reshape(-1, HIDDEN))
            h = h * noise.view(ids.shape[1], ids.shape[0], HIDDEN).transpose(0, 1)
        elif self.use == "probabilities":  # numbers that depend on the values drawn for
            h = h * torch.bernoulli(torch.sigmoid(h))
        elif self.use == "function":
            h = _Jitter.apply(h)
        elif self.use == "unread":  # BigBird's forward initialises a layer it drops: numbers nothing reads
            torch.empty(HIDDEN, HIDDEN).detach().uniform_(-1.0, 1.0)
        else:
            h = h * torch.rand_like(h)
        return self.head(h)


class _Jitter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * torch.rand_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("use,plan,found", [
    ("plain", "dp=2,mb=2", "with 2 micro-batches each micro-batch draws again"),
    ("interleaved", "dp=2", "does not (it merges the rows behind another dim"),
    ("probabilities", "dp=2", "bernoulli.default draws numbers for this rank's rows that depend on the values"),
    ("attended", "cp=2", "this rank's tokens on 'cp' are load-balanced chunks of each sequence"),
    ("function", "dp=2", "custom torch.autograd.Function '_Jitter') draws random numbers for this rank's rows"),
    ("plain", "tp=2,sp", "on mesh axis 'tp': it draws random numbers from the default generator for values placed"),
    ("hidden", "tp=2", "on mesh axis 'tp': it draws random numbers from the default generator for values placed"),
])
def test_draws_that_cannot_be_one_devices_are_refused(use, plan, found):
    with pytest.raises(AutoparError) as info:
        _compile(Drawn(use), plan)
    message = str(info.value)
    assert message.startswith("autopar:") and found in message, message
    assert "test_random_draws.py" in message, message  # the draw's source line


def test_a_plain_draw_over_the_tokens_compiles():
    traced, _ = _compile(Drawn("plain"))
    assert [n.args[0] for n in traced.gm.graph.nodes if n.target is draws.rows_draw] == ["aten::rand_like.default"]


def test_a_draw_nothing_reads_is_left_alone_under_micro_batches():
    traced, _ = _compile(Drawn("unread"), "dp=2,mb=2")
    assert [n.target for n in traced.gm.graph.nodes if n.target in RANDOM_DRAWS] == [aten.uniform_.default]
