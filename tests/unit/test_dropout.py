"""Dropout streams in one process: the seeds, the operators, and the pass's choice of stream.

The multi-rank masks themselves are compared in tests/dist/test_dropout.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.ops import rng
from autopar.ops.step import AxisGroup, StepContext, activate
from autopar.passes.compile import compile_program
from autopar.passes.context import META_KEY
from tests.support.models import example_model, lm_loss, make_batch

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "mlp_dropout": 0.2}


def _step(seed: int = 7, **ranks) -> StepContext:
    """A step context on a mesh of ``axis=(rank, size)``, without process groups."""
    return StepContext(groups={a: AxisGroup(None, size, rank) for a, (rank, size) in ranks.items()}, seed=seed)


def test_stream_seeds_separate_data_and_shards():
    sizes = {"pp": 2, "dp": 2, "cp": 2, "tp": 2}
    replicated, sharded = {}, {}
    for ranks in itertools.product(*(range(n) for n in sizes.values())):
        coords = dict(zip(sizes, ranks))
        step = _step(**{a: (coords[a], sizes[a]) for a in sizes})
        replicated[ranks] = rng.stream_seed(step, rng.REPLICATED)
        sharded[ranks] = rng.stream_seed(step, rng.TP)
    # the replicated stream: one seed per (pp, dp, cp), shared by the tp ranks
    for ranks, seed in replicated.items():
        for other, other_seed in replicated.items():
            assert (seed == other_seed) == (ranks[:3] == other[:3])
    # the tp stream: a seed of its own on every rank, none shared with the replicated stream
    assert len(set(sharded.values())) == len(sharded)
    assert not set(sharded.values()) & set(replicated.values())
    assert rng.stream_seed(_step(seed=2 ** 64 - 1), rng.REPLICATED) == rng.OFFSET - 1  # wraps like a uint64
    with pytest.raises(ValueError, match="unknown dropout stream"):
        rng.stream_seed(_step(), "dp")


@pytest.mark.parametrize("kind", rng.KINDS)
def test_dropout_is_torch_dropout_drawn_from_the_stream(kind):
    x = torch.randn(4, 8, 16)
    step = _step()
    default_state = torch.get_rng_state()
    with activate(step):
        gen = rng.generator(step, rng.REPLICATED, x.device)
        state = gen.get_state()
        y = rng.dropout(x, 0.3, True, rng.REPLICATED, kind)
        again = rng.dropout(x, 0.3, True, rng.REPLICATED, kind)
    assert torch.equal(torch.get_rng_state(), default_state)  # the default generator is untouched
    assert not torch.equal(y, again)  # the stream advances
    torch.default_generator.set_state(state)
    assert torch.equal(y, getattr(torch.ops.aten, kind).default(x, 0.3, True))
    torch.set_rng_state(default_state)
    if kind.startswith("feature"):  # one draw per (batch, channel)
        a = 1 / ((rng._ALPHA ** 2 * 0.3 + 1) * 0.7) ** 0.5
        dropped = y == 0 if kind == "feature_dropout" else torch.isclose(y, torch.tensor(rng._ALPHA * a * (0.3 - 1)))
        assert 0 < dropped.float().mean() < 1
        assert torch.equal(dropped, dropped[..., :1].expand_as(dropped))


def test_dropout_outside_a_step_and_in_eval():
    x = torch.randn(4, 8, 16)
    torch.manual_seed(3)
    plain = rng.dropout(x, 0.3, True, rng.TP)
    torch.manual_seed(3)
    assert torch.equal(plain, F.dropout(x, 0.3, True))
    step = _step()
    with activate(step, training=False):
        assert rng.dropout(x, 0.3, True, rng.TP) is x
    with activate(step):
        assert rng.dropout(x, 0.0, True, rng.TP) is x
        assert rng.dropout(x, 0.3, False, rng.TP) is x
        assert not rng.dropout(x, 1.0, True, rng.TP).any()
        with pytest.raises(ValueError, match="between 0 and 1"):
            rng.dropout(x, 1.5)
    assert not step.generators  # nothing drawn


def test_dropout_statistics_and_ranks():
    x = torch.ones(64, 256)
    outs = {}
    for tp_rank in (0, 1):
        step = _step(tp=(tp_rank, 2), dp=(0, 2))
        with activate(step):
            outs[tp_rank] = {s: rng.dropout(x, 0.25, True, s) for s in rng.STREAMS}
    y = outs[0][rng.REPLICATED]
    assert set(y.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}
    assert abs((y == 0).float().mean().item() - 0.25) < 0.02
    assert torch.equal(outs[0][rng.REPLICATED], outs[1][rng.REPLICATED])
    assert not torch.equal(outs[0][rng.TP], outs[1][rng.TP])
    with activate(_step(tp=(0, 2), dp=(1, 2))):  # another dp rank: other masks on both streams
        for s in rng.STREAMS:
            assert not torch.equal(rng.dropout(x, 0.25, True, s), outs[0][s])


def test_attention_dropout_draws_from_the_stream():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    default_state = torch.get_rng_state()
    outs = {}
    for tp_rank in (0, 1):
        with activate(_step(tp=(tp_rank, 2))):
            outs[tp_rank] = {s: rng.attention(q, k, v, None, 0.5, True, stream=s) for s in rng.STREAMS}
    assert torch.equal(torch.get_rng_state(), default_state)
    assert torch.equal(outs[0][rng.REPLICATED], outs[1][rng.REPLICATED])
    assert not torch.equal(outs[0][rng.TP], outs[1][rng.TP])
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(outs[0][rng.TP], exact)
    with activate(_step(), training=False):
        assert torch.equal(rng.attention(q, k, v, None, 0.5, True, stream=rng.TP), exact)
    torch.manual_seed(5)
    plain = rng.attention(q, k, v, None, 0.5, True)  # outside a step: torch's own
    torch.manual_seed(5)
    assert torch.equal(plain, F.scaled_dot_product_attention(q, k, v, None, 0.5, True))


def _compile(plan: str, world: int, **overrides):
    model = example_model(0, **overrides)
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(model, (ids,), None, plan, lm_loss, world_size=world)


def _streams(gm) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (rng.dropout, rng.attention):
            stream = n.args[3] if n.target is rng.dropout else n.kwargs["stream"]
            what = "attention" if n.target is rng.attention else ("mlp" if n.args[1] == 0.2 else "hidden")
            out.setdefault(what, []).append(stream)
            assert n.meta[META_KEY].pass_name == "dropout_pass" and stream in n.meta[META_KEY].reason
    return out


def test_pass_chooses_streams_by_placement():
    traced, ctx = _compile("none", 1, **DROPOUT)
    assert "dropout_pass" in [line.split(":")[0] for line in ctx.log]
    assert not any(n.target in (torch.ops.aten.dropout.default, torch.ops.aten.scaled_dot_product_attention.default)
                   for n in traced.gm.graph.nodes)
    assert _streams(traced.gm) == {"hidden": ["replicated"] * 5, "attention": ["replicated"] * 2,
                                   "mlp": ["replicated"] * 2}
    traced, _ = _compile("tp=2", 2, **DROPOUT)
    assert _streams(traced.gm) == {"hidden": ["replicated"] * 5, "attention": ["tp"] * 2, "mlp": ["tp"] * 2}
    traced, _ = _compile("tp=2,sp", 2, **DROPOUT)  # the residual stream on sequence shards
    assert _streams(traced.gm) == {"hidden": ["tp"] * 5, "attention": ["tp"] * 2, "mlp": ["tp"] * 2}


def test_cp_still_refuses_attention_dropout():
    with pytest.raises(Exception, match="context parallelism needs attention without dropout"):
        _compile("cp=2:ring", 2, attention_dropout=0.1)


class _ZeroDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.0)

    def forward(self, ids):
        return self.proj(self.drop(self.embed(ids)))


@pytest.mark.parametrize("make", [lambda: example_model(0), _ZeroDropout], ids=["no dropout", "p=0"])
def test_graphs_without_drawn_masks_are_unchanged(make):
    ids = torch.randint(0, 32, (2, 8))
    model = make()
    traced, ctx = compile_program(model, (ids,), None, "none", lambda o, t: F.cross_entropy(
        o.flatten(0, 1), t.flatten()), world_size=1)
    assert "dropout_pass" not in [line.split(":")[0] for line in ctx.log]
    assert not any(n.target in (rng.dropout, rng.attention) for n in traced.gm.graph.nodes)
    if isinstance(model, _ZeroDropout):  # left as torch's own p=0 dropout (the identity)
        assert any(n.target is torch.ops.aten.dropout.default for n in traced.gm.graph.nodes)
