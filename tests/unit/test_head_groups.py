"""Heads that an attention module splits into groups again (differential attention's head pairs).

DiffLlama chunks its value heads in two (``chunk(v, 2, dim=1)``), repeats each half to every KV head,
runs attention twice and chunks the output heads in two again, pairing head ``h`` with head
``h + heads / 2``.  Split evenly, a rank would hold heads ``0..heads/tp`` and find no partner.  The
analysis proposes *head groups* (``LinearInfo.head_groups``); the TP pass lays q, k and v out by them
(each group split over tp, so every rank holds whole head pairs); shard propagation proves it:

- a view of a tensor laid out by blocks scales its blocks (``[b, s, F]`` as ``[b, s, heads, d]``:
  blocks of ``F / d`` heads; merged back, of features), refused where a rank's share of a block
  would not be whole units of the new dim;
- ``repeat`` tiling an even shard lays the result out by blocks, one per copy (the rank's part of
  each copy), which then must not meet an evenly split value;
- a split of a tensor laid out by blocks is exact only at exactly the blocks (a ``chunk`` elsewhere
  is refused).

Its model under ``tp=2,sp`` against one device: tests/e2e/test_zoo.py (``diffllama``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.runtime import compile_program
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.unit.test_soundness import _Builder

aten = torch.ops.aten


def _sum(b, x):
    return b.op(aten.sum.dim_IntList, x, list(range(x.meta["val"].dim())), shape=())


def test_a_view_into_heads_scales_the_blocks():
    b = _Builder()
    x = b.input("x", 2, 3, 32, shard=2)
    x.meta["autopar_blocks"] = (16, 16)  # two groups of 4 heads of 4
    heads = b.op(aten.view.default, x, [2, 3, -1, 4], shape=(2, 3, 8, 4))
    back = b.op(aten.view.default, heads, [2, 3, 32], shape=(2, 3, 32))
    placements, _ = b.place(_sum(b, back))
    assert placements[heads] == Shard(2) and heads.meta["autopar_blocks"] == (4, 4)
    assert back.meta["autopar_blocks"] == (16, 16)


def test_a_view_that_cuts_a_ranks_share_of_a_block_is_refused():
    b = _Builder()
    x = b.input("x", 2, 3, 16, shard=2)
    x.meta["autopar_blocks"] = (8, 8)  # two groups of 2 heads of 4: under tp=4 half a head per rank
    heads = b.op(aten.view.default, x, [2, 3, -1, 4], shape=(2, 3, 4, 4))
    with pytest.raises(AutoparError, match="cuts a block or this rank's share of one"):
        b.place(_sum(b, heads), size=4)


def test_tiling_a_shard_lays_it_out_by_copies():
    """DiffLlama's ``v.repeat(1, 2, 1, 1)`` of the heads of one half: the rank's heads tiled are its
    share of each copy; meeting an evenly split value of the same size is refused."""
    b = _Builder()
    v = b.input("v", 2, 4, 8, 4, shard=1)
    tiled = b.op(aten.repeat.default, v, [1, 2, 1, 1], shape=(2, 8, 8, 4))
    placements, _ = b.place(_sum(b, tiled))
    assert placements[tiled] == Shard(1) and tiled.meta["autopar_blocks"] == (4, 4)
    b = _Builder()
    v = b.input("v", 2, 4, 8, 4, shard=1)
    tiled = b.op(aten.repeat.default, v, [1, 2, 1, 1], shape=(2, 8, 8, 4))
    even = b.input("q", 2, 8, 8, 4, shard=1)
    with pytest.raises(AutoparError, match="laid out differently"):
        b.place(_sum(b, b.op(aten.add.Tensor, tiled, even, shape=(2, 8, 8, 4))))


def test_a_split_of_blocks_elsewhere_than_at_them_is_refused():
    b = _Builder()
    x = b.input("x", 2, 16, shard=1)
    x.meta["autopar_blocks"] = (4, 12)
    parts = b.op(aten.chunk.default, x, 2, 1, shape=(2, 8))
    parts.meta["val"] = (torch.zeros(2, 8), torch.zeros(2, 8))
    first = b.op(__import__("operator").getitem, parts, 0, shape=(2, 8))
    with pytest.raises(AutoparError, match="not at the blocks"):
        b.place(_sum(b, first))


class DiffAttention(nn.Module):
    """Differential attention as DiffLlama writes it: head ``h`` paired with head ``h + heads / 2``."""

    def __init__(self, hidden=32, heads=4, kv_heads=None):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        kv = (kv_heads or heads) * self.d
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, kv, bias=False)
        self.v_proj, self.o_proj = nn.Linear(hidden, kv, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.gqa = kv != hidden
        self.lam = nn.Parameter(torch.full((self.d,), 0.1))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.d).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        v1, v2 = (part.repeat(1, 2, 1, 1) for part in torch.chunk(v, 2, dim=1))
        o1 = F.scaled_dot_product_attention(q, k, v1, is_causal=True, enable_gqa=self.gqa).transpose(1, 2)
        o2 = F.scaled_dot_product_attention(q, k, v2, is_causal=True, enable_gqa=self.gqa).transpose(1, 2)
        a1, a2 = torch.chunk(torch.cat([o1, o2], dim=-1), 2, dim=2)
        out = F.rms_norm(a1 - torch.exp(self.lam.sum()) * a2, (2 * self.d,))
        return self.o_proj(out.reshape(b, s, -1))


class DiffDecoder(nn.Module):
    def __init__(self, heads=4, hidden=32, kv_heads=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList([DiffAttention(hidden, heads, kv_heads) for _ in range(2)])
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(F.rms_norm(h, (h.shape[-1],)))
        return self.lm_head(h)


def _inputs():
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return inputs


def test_the_analysis_finds_head_pairs():
    _, loss_fn, _ = build("example", {})
    s = analyze(trace_model(DiffDecoder(), _inputs(), {}, loss_fn).gm)
    (region, *_) = [r for r in s.regions if r.kind == "attention"]
    assert {c.module.rsplit(".", 1)[-1]: c.head_groups for c in region.columns} == \
        {"q_proj": 2, "k_proj": 2, "v_proj": 2}


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp"])
def test_differential_attention_holds_whole_head_pairs(plan):
    """q, k and v laid out by head pairs (each rank: its heads of both halves); o_proj splits evenly."""
    _, loss_fn, _ = build("example", {})
    _, program = compile_program(DiffDecoder(), _inputs(), {}, plan, loss_fn, world_size=2)
    layout = {name.split("layers.0.")[-1]: axes["tp"] for name, axes in program.param_shards.items()
              if "layers.0." in name and "tp" in axes}
    assert layout["q_proj.weight"].blocks == layout["k_proj.weight"].blocks == layout["v_proj.weight"].blocks == (16, 16)
    assert layout["o_proj.weight"].dim == 1 and not layout["o_proj.weight"].blocks


def test_head_groups_that_tp_cannot_split_into_whole_heads_are_refused():
    """Two heads: one per group, which tp=2 would cut."""
    _, loss_fn, _ = build("example", {})
    with pytest.raises(AutoparError, match=r"tp=2 does not divide the 1 heads of each of the 2 head groups"):
        compile_program(DiffDecoder(heads=2), _inputs(), {}, "tp=2", loss_fn, world_size=2)



def test_head_groups_with_replicated_kv_heads_are_refused():
    """Eight heads in pairs of groups of four, two KV heads: tp=4 splits each group into whole heads,
    but keeps both KV heads on every rank, which the attention rule would cut evenly, not by groups."""
    _, loss_fn, _ = build("example", {})
    with pytest.raises(AutoparError, match=r"replicated KV heads are not supported with head groups"):
        compile_program(DiffDecoder(heads=8, kv_heads=2), _inputs(), {}, "tp=4", loss_fn, world_size=4)
