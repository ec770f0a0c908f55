"""Projections written as ``einsum`` with a parameter ``[h, n, d]`` (XLNet's relative attention).

XLNet projects to heads with ``einsum("ibh,hnd->ibnd", x, self.q)`` and back with
``einsum("ibnd,hnd->ibh", attn, self.o)``, not ``nn.Linear``.  The analysis reads such an einsum as
a column (the input's last letter contracted with the weight's first) or a row (the input's last two
letters contracted with the weight's last two), named after its parameter in its module, so the
module is the region; the TP pass splits the weight's heads ``n`` (dim 1) either way, and shard
propagation places each einsum by its letters.  A column input that no trainable parameter reaches
and that holds no sequence (the relative position encoding, ``[2s, b, h]``, from positions alone)
gets no region entry: under SP it stays replicated, and its gradient is never used.

Its model under ``tp=2,sp`` against one device: tests/e2e/test_zoo.py (``xlnet``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.ops import collectives as C
from autopar.runtime import compile_program
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build


class RelativeAttention(nn.Module):
    """XLNet's relative attention, reduced: sequence-first ``[s, b, h]``, heads by einsum."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        d = hidden // heads
        for name in "qkvor":
            setattr(self, name, nn.Parameter(torch.randn(hidden, heads, d) * 0.1))
        self.seg = nn.Parameter(torch.randn(2, heads, d) * 0.1)  # an einsum that is no projection

    def forward(self, h, r):
        q = torch.einsum("ibh,hnd->ibnd", h, self.q)
        k = torch.einsum("ibh,hnd->ibnd", h, self.k)
        v = torch.einsum("ibh,hnd->ibnd", h, self.v)
        kr = torch.einsum("ibh,hnd->ibnd", r, self.r)[: h.shape[0]]
        ef = torch.einsum("ibnd,snd->ibns", q, self.seg).sum(-1)
        scores = torch.einsum("ibnd,jbnd->bnij", q, k) + torch.einsum("ibnd,jbnd->bnij", q, kr)
        scores = scores + ef.permute(1, 2, 0).unsqueeze(-1)
        causal = torch.ones(h.shape[0], h.shape[0], dtype=torch.bool, device=h.device).triu(1)
        prob = torch.softmax(scores.masked_fill(causal, -1e9), dim=3)
        attn = torch.einsum("bnij,jbnd->ibnd", prob, v)
        return h + torch.einsum("ibnd,hnd->ibh", attn, self.o)


class EinsumDecoder(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.hidden = hidden
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList([RelativeAttention(hidden, heads) for _ in range(2)])
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids).transpose(0, 1)  # [s, b, hidden]
        pos = torch.arange(2 * ids.shape[1], device=ids.device, dtype=torch.float32)
        freq = 1.0 / 10000 ** (torch.arange(0, self.hidden, 2, device=ids.device).float() / self.hidden)
        angles = pos[:, None] * freq[None]
        r = torch.cat([angles.sin(), angles.cos()], -1)[:, None].expand(-1, ids.shape[0], -1)
        for layer in self.layers:
            h = layer(torch.nn.functional.layer_norm(h, (self.hidden,)), r)
        return self.lm_head(h.transpose(0, 1))


def _inputs():
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return inputs


def test_einsum_projections_make_a_region():
    _, loss_fn, _ = build("example", {})
    s = analyze(trace_model(EinsumDecoder(), _inputs(), {}, loss_fn).gm)
    (region, *_) = [r for r in s.regions if r.module.endswith("layers.0")]
    assert [c.module.rsplit(".", 1)[-1] for c in region.columns] == ["q", "k", "v", "r"]
    assert [c.module.rsplit(".", 1)[-1] for c in region.rows] == ["o"]
    assert all(c.einsum and c.out_dim == c.in_dim == 1 for c in region.columns + region.rows)


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp"])
def test_einsum_projections_split_the_heads(plan):
    _, loss_fn, _ = build("example", {})
    traced, program = compile_program(EinsumDecoder(), _inputs(), {}, plan, loss_fn, world_size=2)
    layout = {name.split("layers.0.")[-1]: axes["tp"] for name, axes in program.param_shards.items()
              if "layers.0." in name and "tp" in axes}
    assert {name: shard.dim for name, shard in layout.items()} == {"q": 1, "k": 1, "v": 1, "r": 1, "o": 1}
    entries = [n for n in traced.gm.graph.nodes if n.target in (C.region_entry, C.all_gather)
               and n.meta["autopar"].role == "column_input"]
    assert len(entries) == 2  # the hidden states of each layer; none on the position encoding
