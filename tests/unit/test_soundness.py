"""Soundness checks in one process (docs/soundness.md): gradient placements and the cp propagation.

Gradient placements (``passes/gradient_placement.py``) are tested on small hand-built graphs,
placed by the real rule registry: an all-gather gets the backward its gradient needs, and a
value whose gradient has no placement is refused.  The cp propagation (``passes/context_parallel.py``
step 4) is tested on tiny models and on OPT: a cumulative sum over the sequence becomes the
global one, anything that reads positions in a way the rewrite does not cover is refused with
the node, module and source line.  The multi-rank half (these architectures trained against one
device) is tests/dist/test_architectures.py.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Graph, GraphModule

from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops import cp_attention as CPA
from autopar.passes.context import META_KEY
from autopar.passes.gradient_placement import GRAD_PLACEMENT_KEY, gradient_placements
from autopar.passes.rules import R, RuleContext, is_loss_share
from autopar.passes.shard_propagation import propagate
from autopar.runtime import compile_program
from tests.support.models import MODELS, make_batch

aten = torch.ops.aten


class _Builder:
    """A graph of aten and autopar ops with shapes, for the rules to place."""

    def __init__(self):
        self.root, self.graph, self.sharded = nn.Module(), Graph(), {}

    def param(self, name, *shape, shard=None):
        self.root.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        node = self.graph.get_attr(name)
        node.meta["val"] = torch.zeros(shape)
        if shard is not None:
            self.sharded[node] = Shard(shard)
        return node

    def input(self, name, *shape, shard=None):
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.zeros(shape)
        if shard is not None:
            self.sharded[node] = Shard(shard)
        return node

    def op(self, fn, *args, shape):
        node = self.graph.call_function(fn, args)
        node.meta["val"] = torch.zeros(shape)
        return node

    def place(self, loss, axis="tp", size=2, **options):
        """Forward and gradient placements on ``axis`` (of ``size`` ranks), as shard propagation computes them."""
        self.graph.output((loss,))
        gm = GraphModule(self.root, self.graph)
        rc = RuleContext(gm, axis, size, {}, **options)
        placements = propagate(gm, rc, lambda n: self.sharded.get(n, R))
        return placements, gradient_placements(gm, rc, placements)


def test_gather_feeding_replicated_work_keeps_this_ranks_gradient_slice():
    """Gathered logits under a soft-capped loss (Gemma 2): every rank computes the same loss from
    them, so their gradient is replicated and the reduce-scatter backward would count it twice."""
    b = _Builder()
    normed = b.op(aten.mul.Tensor, b.input("x", 4, 8), b.param("norm_weight", 8), shape=(4, 8))
    entry = b.op(C.region_entry, normed, "tp", "entry", shape=(4, 8))
    logits = b.op(aten.linear.default, entry, b.param("w", 6, 8, shard=0), shape=(4, 6))
    gathered = b.op(C.all_gather, logits, 1, "tp", "logits", shape=(4, 6))
    capped = b.op(aten.tanh.default, gathered, shape=(4, 6))
    placements, grads = b.place(b.op(aten.sum.default, capped, shape=()))
    assert placements[gathered] == R and grads[gathered] == R
    assert gathered.target is C.gather_replicated  # backward: this rank's slice, no communication
    assert grads[logits] == Shard(1) and isinstance(grads[entry], Partial)
    assert grads[normed] == R and grads[b.graph.find_nodes(op="get_attr", target="norm_weight")[0]] == R


def test_gather_feeding_sharded_work_reduce_scatters():
    """SP's gather of sequence shards into a column-parallel projection: a partial gradient; the
    norm weight applied to the sequence shards before it has a partial gradient (summed over tp)."""
    b = _Builder()
    norm_weight = b.param("norm_weight", 8)
    x = b.op(aten.mul.Tensor, b.input("x", 2, 8, shard=0), norm_weight, shape=(2, 8))
    gathered = b.op(C.all_gather, x, 0, "tp", "sp", shape=(4, 8))
    w = b.param("w", 6, 8, shard=0)
    y = b.op(aten.linear.default, gathered, w, shape=(4, 6))
    out = b.op(C.gather_replicated, y, 1, "tp", "logits", shape=(4, 6))
    _, grads = b.place(b.op(aten.sum.default, out, shape=()))
    assert isinstance(grads[gathered], Partial) and gathered.target is C.all_gather
    assert grads[x] == Shard(0) and isinstance(grads[norm_weight], Partial)
    assert gathered.meta[GRAD_PLACEMENT_KEY]["tp"] == grads[gathered]


def test_value_with_replicated_and_partial_gradient_is_refused():
    """A replicated value feeding both sharded work (a slice per rank) and replicated work: its
    gradient would be the sum of a full and a partial gradient, which no placement holds."""
    b = _Builder()
    h = b.op(aten.mul.Tensor, b.input("x", 4, 8), b.param("w", 8), shape=(4, 8))
    part = b.op(C.local_shard, h, 0, "tp", shape=(2, 8))
    gathered = b.op(C.all_gather, b.op(aten.tanh.default, part, shape=(2, 8)), 0, "tp", "t", shape=(4, 8))
    total = b.op(aten.add.Tensor, b.op(aten.sum.default, gathered, shape=()),
                 b.op(aten.sum.default, h, shape=()), shape=())
    with pytest.raises(AutoparError, match=r"^autopar: cannot shard node 'mul.*a partial sum and replicated "
                                           r"along different uses"):
        b.place(total)


def test_reduced_partial_sum_feeding_sharded_work_directly_is_refused():
    """A row-parallel output all-reduced into a column-parallel projection with no region entry:
    the all-reduce's identity backward would pass a partial gradient on as the full one."""
    b = _Builder()
    x = b.input("x", 4, 8, shard=1)
    row = b.op(aten.linear.default, x, b.param("w_row", 8, 8, shard=1), shape=(4, 8))
    reduced = b.op(C.all_reduce, row, "tp", "row", shape=(4, 8))
    col = b.op(aten.linear.default, reduced, b.param("w_col", 6, 8, shard=0), shape=(4, 6))
    out = b.op(C.all_gather, col, 1, "tp", "t", shape=(4, 6))
    with pytest.raises(AutoparError, match="a partial sum whose gradient is a partial sum"):
        b.place(b.op(aten.sum.default, out, shape=()))


def test_region_entry_into_replicated_work_is_refused():
    b = _Builder()
    entry = b.op(C.region_entry, b.op(aten.mul.Tensor, b.input("x", 4, 8), b.param("w", 8), shape=(4, 8)),
                 "tp", "entry", shape=(4, 8))
    with pytest.raises(AutoparError, match="region entry whose result's gradient is replicated"):
        b.place(b.op(aten.sum.default, entry, shape=()))


def test_loss_shares_of_different_reductions_are_all_reduced_before_adding():
    """On cp a mean over this rank's tokens is its share of the mean and a sum its part of the
    sum; the two do not add up as shares, so each is all-reduced first (and the sum is replicated)."""
    b = _Builder()
    x = b.input("x", 4, 8, shard=0)
    total = b.op(aten.add.Tensor, b.op(aten.mean.default, x, shape=()), b.op(aten.sum.default, x, shape=()),
                 shape=())
    placements, _ = b.place(total, "cp", local_sizes=True)
    assert placements[total] == R
    assert sorted(a.args[2] for a in total.args) == ["avg", "sum"]  # token_all_reduce(x, 'cp', op, tag)
    assert all(a.target is C.token_all_reduce for a in total.args)


def test_a_replicated_term_adds_once_to_a_share_of_the_mean():
    """loss = mean share + replicated c: the ranks' values average to mean + c (a loss plus an
    exact auxiliary term); a replicated non-zero term added to a part of a sum is not that."""
    b = _Builder()
    x, c = b.input("x", 4, 8, shard=0), b.input("c")
    share = b.op(aten.add.Tensor, b.op(aten.mean.default, x, shape=()), c, shape=())
    placements, _ = b.place(share, "cp", local_sizes=True)
    assert is_loss_share(placements[share])
    b = _Builder()
    x, c = b.input("x", 4, 8, shard=0), b.input("c")
    part = b.op(aten.add.Tensor, b.op(aten.sum.default, x, shape=()), c, shape=())
    placements, _ = b.place(part, "cp", local_sizes=True)
    assert placements[part] == R and part.args[0].target is C.token_all_reduce


def test_gemma2_soft_capped_logits_gathered_with_slice_backward():
    """Gemma 2 under tp=2: the logits pass through soft-capping before the loss, so they are
    gathered; the gather's gradient is replicated (found by the backward walk), not partial."""
    factory, loss_fn, kwargs = MODELS["hf_gemma2"]
    ids, _ = make_batch(128, 4, 16, 0)
    traced, program = compile_program(factory(), (ids,), kwargs, "tp=2", loss_fn, world_size=2)
    gathers = [n for n in traced.gm.graph.nodes if n.target in (C.all_gather, C.gather_replicated)]
    assert [n.target for n in gathers] == [C.gather_replicated]
    assert gathers[0].meta[GRAD_PLACEMENT_KEY]["tp"] == Replicate()
    assert set(gathers[0].meta[META_KEY].bytes) == {"fwd"}  # no backward collective
    assert not program.grad_partial_axes  # tp without sp: every replicated weight sees replicated data


# --- context parallelism: the sequence dim holds this rank's tokens --------------------------


class _Tiny(nn.Module):
    """Embedding, one causal SDPA head, LM head; ``mix`` says how positions enter."""

    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.embed = nn.Embedding(32, 16)
        self.pos = nn.Parameter(torch.randn(64, 16) * 0.02)
        self.head = nn.Linear(16, 32, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        if self.mix == "sliced_table":  # positions as the first `seq` rows of a table
            h = h + self.pos[: ids.shape[1]]
        elif self.mix == "shifted_table":  # rows 1..seq of a table: not this rank's positions
            h = h + self.pos[1: ids.shape[1] + 1]
        elif self.mix == "centered":  # mixes every position of the sequence
            h = h - h.mean(dim=1, keepdim=True)
        elif self.mix == "mask_positions":  # OPT: positions from the cumulative sum of a mask
            mask = torch.ones(ids.shape[0], ids.shape[1], device=ids.device)
            h = h + F.embedding((torch.cumsum(mask, dim=1) * mask - 1).long(), self.pos)
        q = h[:, None]
        return self.head(F.scaled_dot_product_attention(q, q, q, is_causal=True)[:, 0])


def _cp_compile(model, plan="cp=2:allgather"):
    ids = torch.randint(0, 32, (2, 8))
    return compile_program(model, (ids,), None, plan, lambda o, t: F.cross_entropy(
        o.flatten(0, 1), t.flatten()), world_size=2)


@pytest.mark.parametrize("mix,found", [
    ("shifted_table", r"has the sequence length in dim 0 but it is placed R, .*computed from the "
                      r"local sequence length"),
])
def test_cp_refuses_positions_it_cannot_rewrite(mix, found):
    with pytest.raises(AutoparError) as info:
        _cp_compile(_Tiny(mix))
    msg = str(info.value)
    assert msg.startswith("autopar: cannot shard node ") and "on mesh axis 'cp'" in msg
    assert "in module" in msg and "test_soundness.py" in msg  # the user's source line
    assert re.search(found, msg), msg


def test_cp_takes_a_position_tables_rows_at_this_ranks_positions():
    """``pos[:seq]`` (BERT's position_ids buffer, a learned table) becomes the table's rows at
    this rank's global positions; its gradient lands on those rows."""
    traced, _ = _cp_compile(_Tiny("sliced_table"))
    (node,) = [n for n in traced.gm.graph.nodes if n.target is CPA.cp_table_rows]
    assert node.args[0].op == "get_attr" and node.args[1:2] == (0,) and node.args[3] == "cp"
    assert not any(n.target is aten.slice.Tensor and n.args[0] is node.args[0] for n in traced.gm.graph.nodes)


def test_cp_all_reduces_a_mean_over_the_sequence_before_using_it():
    """``h - h.mean(dim=1)``: a rank's mean over its tokens is its share of the sequence's mean
    (equal chunks); subtracting it is not linear in that share, so it is averaged over cp first."""
    traced, _ = _cp_compile(_Tiny("centered"))
    (node,) = [n for n in traced.gm.graph.nodes if n.target is C.token_all_reduce]
    assert node.args[1:3] == ("cp", "avg") and node.args[0].target is aten.mean.dim
    assert node.meta[META_KEY].bytes["fwd"][0] == node.meta[META_KEY].bytes["bwd"][0] == "all_reduce"


def test_cp_rewrites_a_cumulative_sum_over_the_sequence():
    traced, _ = _cp_compile(_Tiny("mask_positions"))
    (node,) = [n for n in traced.gm.graph.nodes if n.target is CPA.cp_cumsum]
    assert node.args[1:] == (1, "cp")
    # chunk totals of a [b, s] float mask: two fp32 values per row, all-gathered; no gradient
    meta = node.meta[META_KEY]
    assert meta.pass_name == "context_parallel_pass" and set(meta.bytes) == {"fwd"}
    assert meta.bytes["fwd"][0] == "all_gather"


def test_opt_positions_from_its_mask_are_rewritten():
    factory, loss_fn, kwargs = MODELS["hf_opt"]
    ids, _ = make_batch(128, 4, 16, 0)
    traced, _ = compile_program(factory(), (ids,), kwargs, "cp=2:allgather", loss_fn, world_size=2)
    assert not any(n.target is aten.cumsum.default for n in traced.gm.graph.nodes)
    assert sum(n.target is CPA.cp_cumsum for n in traced.gm.graph.nodes) == 1


@pytest.mark.parametrize("n,dtype", [(2, torch.float32), (3, torch.int64)])
def test_cp_cumsum_is_the_global_cumsum(monkeypatch, n, dtype):
    """Each rank's result equals the global cumsum at the rank's load-balanced positions."""
    seq = 4 * n
    full = (torch.arange(2 * 3 * seq) % 5).reshape(2, 3, seq).to(dtype)  # [.., seq] with the sequence last
    parts = [full[..., CPA.cp_chunk_indices(seq, r, n)] for r in range(n)]
    totals = [torch.stack([p.chunk(2, -1)[0].sum(-1), p.chunk(2, -1)[1].sum(-1)]) for p in parts]
    monkeypatch.setattr(C, "axis_size", lambda axis: n)
    monkeypatch.setattr(C, "all_gather", lambda t, dim, axis, tag="": torch.cat(totals, dim))
    for r in range(n):
        monkeypatch.setattr(C, "axis_rank", lambda axis, r=r: r)
        got = CPA.cp_cumsum(parts[r], 2, "cp")
        want = full.cumsum(-1)[..., CPA.cp_chunk_indices(seq, r, n)]
        assert got.dtype == want.dtype and torch.equal(got, want)
