"""Rules for ops that attention variants reach under tp (issue 40, item 3), on hand-built graphs.

- ``einsum`` by its equation's letters: a kept letter's shard moves to its output position (an
  operand holding it unsplit is sliced); a summed letter split in both operands gives partial
  sums; operands split on different letters, or a summed letter split in one operand only, are
  refused;
- an in-place element-wise op (``masked_fill_`` on XLM's scores) is exact only when its
  destination is placed as its result: a replicated destination met by a sharded operand is
  refused, since the rank would write into a slice while later readers read the tensor unchanged;
- ``view_as_complex`` / ``view_as_real`` (DeepSeek-V2's rotary) keep a shard on any dim but the
  pairs' last one;
- ``baddbmm`` with the heads merged into the batch (Bloom's ALiBi scores, [b * heads, s, d]: the rank
  holds its share of every run of heads) cuts the replicated bias at the same runs (``local_runs``),
  which takes the rank's share of each run and puts the gradient back;
- ``repeat`` keeps a shard on a dim repeated once and lays a tiled even shard out by copies; a
  replicated table read at sharded positions (``index``, ``index_select``) and ``polar`` of sharded
  angles are sharded like the positions (rotary tables under cp);
- ``tensor_split`` of the sharded dim at its whole size keeps the rank's share (a mixer's chunked part).
- ``linalg_vector_norm`` keeps a shard of a dim it does not reduce (ZAYA's per-head q/k norm under cp).
- a ``slice`` of the last ``s`` of ``s`` positions (``h[:, -s:]``) keeps the shard.

Their models under ``tp=2,sp`` against one device: docs/zoo.md (``xlm``, ``deepseek_v2``, ``bloom``,
``gpt_neox_japanese``).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

from autopar.errors import AutoparError
from autopar.ops import whole_rows
from autopar.ops.whole_rows import local_runs
from tests.unit.test_soundness import _Builder

aten = torch.ops.aten


def _sum(b, x):
    """Every element of ``x`` summed: the loss (its rule all-reduces a sharded input's partial sum)."""
    return b.op(aten.sum.dim_IntList, x, list(range(x.meta["val"].dim())), shape=())


def test_einsum_moves_a_kept_letter_and_sums_a_split_one():
    b = _Builder()
    h = b.input("h", 6, 2, 8, shard=0)  # "ibh": positions i split
    w = b.param("w", 8, 4, 3)           # "hnd"
    q = b.op(aten.einsum.default, "ibh,hnd->ibnd", [h, w], shape=(6, 2, 4, 3))
    k = b.input("k", 6, 2, 4, 3, shard=2)  # heads n split
    v = b.input("v", 6, 2, 4, 3, shard=2)
    scores = b.op(aten.einsum.default, "ibnd,jbnd->bnij", [k, v], shape=(2, 4, 6, 6))
    ctx = b.op(aten.einsum.default, "ibnd,ibnd->ib", [k, v], shape=(6, 2))
    placements, _ = b.place(b.op(aten.add.Tensor, _sum(b, q), _sum(b, scores), shape=()))
    assert placements[q] == Shard(0) and placements[scores] == Shard(1) and isinstance(placements[ctx], Partial)


@pytest.mark.parametrize("equation,shards,found", [
    ("ibnd,jbnd->bnij", (0, 2), "split on different letters"),
    ("ibnd,ibnd->ib", (2, None), "sums over the split letter 'n'"),
])
def test_einsum_refuses_what_no_rank_can_compute_alone(equation, shards, found):
    b = _Builder()
    x = b.input("x", 6, 2, 4, 3, shard=shards[0])
    y = b.input("y", 6, 2, 4, 3, shard=shards[1])
    out = b.op(aten.einsum.default, equation, [x, y], shape=(2, 4, 6, 6) if "ij" in equation else (6, 2))
    with pytest.raises(AutoparError, match=found):
        b.place(_sum(b, out))


def test_in_place_fill_keeps_its_destinations_placement():
    b = _Builder()
    scores = b.op(aten.mul.Tensor, b.input("s", 2, 4, 5, 5, shard=1), 0.5, shape=(2, 4, 5, 5))
    mask = b.input("mask", 2, 4, 5, 5, shard=1)
    filled = b.op(aten.masked_fill_.Scalar, scores, mask, -1e4, shape=(2, 4, 5, 5))
    placements, _ = b.place(_sum(b, b.op(aten.softmax.int, scores, -1, shape=(2, 4, 5, 5))))
    assert placements[filled] == Shard(1)


def test_in_place_write_into_a_replicated_tensor_is_refused():
    b = _Builder()
    scores = b.op(aten.mul.Tensor, b.input("s", 2, 4, 5, 5), 0.5, shape=(2, 4, 5, 5))
    bias = b.input("bias", 2, 4, 5, 5, shard=1)
    b.op(aten.add_.Tensor, scores, bias, shape=(2, 4, 5, 5))
    with pytest.raises(AutoparError, match=r"writes a result placed S\(1\) into 'mul_tensor', placed R"):
        b.place(_sum(b, scores))


def test_complex_views_keep_a_shard_off_the_pairs_dim():
    b = _Builder()
    x = b.input("x", 2, 4, 5, 8, shard=1)
    pairs = b.op(aten.view.default, x, [2, 4, 5, 4, 2], shape=(2, 4, 5, 4, 2))
    as_complex = b.op(aten.view_as_complex.default, pairs, shape=(2, 4, 5, 4))
    as_real = b.op(aten.view_as_real.default, as_complex, shape=(2, 4, 5, 4, 2))
    placements, _ = b.place(_sum(b, as_real))
    assert placements[as_complex] == Shard(1) and placements[as_real] == Shard(1)
    b = _Builder()
    y = b.input("y", 2, 4, 5, 8, 2, shard=4)
    with pytest.raises(AutoparError, match="reads pairs of the sharded last dim"):
        b.place(_sum(b, b.op(aten.view_as_complex.default, y, shape=(2, 4, 5, 8))))


def test_alibi_scores_cut_the_bias_at_the_runs_of_heads():
    """q [b, h, s, d] sharded on heads, merged into the batch ([b * h, s, d]: runs of h); the bias
    [b * h, 1, s] is replicated: each rank adds its heads' rows of it."""
    b = _Builder()
    q = b.op(aten.reshape.default, b.input("q", 2, 4, 5, 8, shard=1), [8, 5, 8], shape=(8, 5, 8))
    k = b.op(aten.reshape.default, b.input("k", 2, 4, 8, 5, shard=1), [8, 8, 5], shape=(8, 8, 5))
    alibi = b.input("alibi", 8, 1, 5)
    scores = b.op(aten.baddbmm.default, alibi, q, k, shape=(8, 5, 5))
    back = b.op(aten.view.default, scores, [2, 4, 5, 5], shape=(2, 4, 5, 5))
    placements, _ = b.place(_sum(b, back))
    (cut,) = [n for n in b.graph.nodes if n.target is local_runs]
    assert cut.args[0] is alibi and cut.args[1:] == (0, 4, "tp") and scores.args[0] is cut
    assert placements[scores] == Shard(0) and scores.meta["autopar_every"] == 4 and placements[back] == Shard(1)


def test_local_runs_takes_each_runs_share_and_puts_the_gradient_back(monkeypatch):
    class Group:
        size, rank = 2, 1

    monkeypatch.setattr(whole_rows, "find_group", lambda axis: Group)
    x = torch.arange(8.0, requires_grad=True)
    out = local_runs(x.view(8, 1), 0, 4, "tp")
    assert out.flatten().tolist() == [2.0, 3.0, 6.0, 7.0]
    out.sum().backward()
    assert x.grad.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]


def test_equal_blocks_viewed_as_a_stack_are_an_even_shard_of_the_block_dim():
    """A fused gate|up output (blocks (4, 4), each split over tp) viewed as [b, s, 2, 4]: the rank
    holds its share of both blocks, so the block dim (3) is an even shard; selecting a block is exact."""
    b = _Builder()
    x = b.input("x", 2, 3, 8, shard=2)
    x.meta["autopar_blocks"] = (4, 4)
    view = b.op(aten.view.default, x, [2, 3, 2, 4], shape=(2, 3, 2, 4))
    view.meta["autopar_blocks"] = (4, 4)  # as the TP pass marks the projection's chain
    gate = b.op(aten.select.int, view, 2, 0, shape=(2, 3, 4))
    placements, _ = b.place(_sum(b, gate))
    assert placements[view] == Shard(3) and "autopar_blocks" not in view.meta and placements[gate] == Shard(2)
    assert view.args[1] == [2, 3, 2, 2]


def test_repeat_keeps_a_shard_repeated_once_and_lays_out_a_tiled_one_by_copies():
    """DiffLlama's ``v.repeat(1, 2, 1, 1)`` over the heads of sequence shards keeps them.  Tiling the
    sharded dim puts the rank's part of every copy side by side: a static dim laid out by blocks, one per
    copy (tests/unit/test_head_groups.py), a dim already in runs keeps its runs (Llama 4's tokens
    repeated per expert: tests/unit/test_dense_experts.py), and the sum of every element is still the
    ranks' partial sums; a value laid out by blocks is not tiled."""
    b = _Builder()
    v = b.input("v", 2, 3, 8, 4, shard=2)
    tiled = b.op(aten.repeat.default, v, [1, 2, 1, 1], shape=(2, 6, 8, 4))
    placements, _ = b.place(_sum(b, tiled))
    assert placements[tiled] == Shard(2)
    b = _Builder()
    v = b.input("v", 2, 8, shard=1)
    tiled = b.op(aten.repeat.default, v, [1, 2], shape=(2, 16))
    placements, _ = b.place(_sum(b, tiled))
    assert placements[tiled] == Shard(1) and tiled.meta["autopar_blocks"] == (8, 8)
    b = _Builder()
    v = b.input("v", 2, 8, shard=1)
    v.meta["autopar_every"] = 4
    tiled = b.op(aten.repeat.default, v, [1, 2], shape=(2, 16))
    placements, _ = b.place(_sum(b, tiled))
    assert placements[tiled] == Shard(1) and tiled.meta["autopar_every"] == 4
    b = _Builder()
    v = b.input("v", 2, 8, shard=1)
    v.meta["autopar_blocks"] = (4, 4)
    tiled = b.op(aten.repeat.default, v, [1, 2], shape=(2, 16))
    with pytest.raises(AutoparError, match=r"tiles the sharded dim 1 2 times, which is laid out by blocks"):
        b.place(_sum(b, tiled))


def test_a_replicated_table_read_at_sharded_positions_is_sharded_like_them():
    """CodeGen's rotary table indexed by this rank's position ids (``index``), XGLM's sinusoidal table
    by ``index_select``, DeepSeek-V2's complex rotary table from ``polar``: each result row is the table's
    row at the rank's position, so the result is sharded as the positions are."""
    b = _Builder()
    table = b.param("table", 64, 8)
    pos = b.input("pos", 2, 16, shard=1)
    pos.meta["val"] = torch.zeros(2, 16, dtype=torch.long)
    rows = b.op(aten.index.Tensor, table, [pos], shape=(2, 16, 8))
    flat = b.input("flat", 32, shard=0)
    flat.meta["val"] = torch.zeros(32, dtype=torch.long)
    picked = b.op(aten.index_select.default, table, 0, flat, shape=(32, 8))
    angles = b.input("angles", 16, 4, shard=0)
    rotary = b.op(aten.polar.default, b.op(aten.ones_like.default, angles, shape=(16, 4)), angles, shape=(16, 4))
    total = b.op(aten.add.Tensor, _sum(b, rows), _sum(b, picked), shape=())
    placements, _ = b.place(b.op(aten.add.Tensor, total, _sum(b, b.op(aten.abs.default, rotary, shape=(16, 4))),
                                 shape=()))
    assert placements[rows] == Shard(1) and placements[picked] == Shard(0) and placements[rotary] == Shard(0)


@pytest.mark.parametrize("at,refused", [(8, False), (4, True)])
def test_tensor_split_of_the_sharded_dim_keeps_the_share_only_at_its_whole_size(at, refused):
    """A mixer's ``tensor_split(beta, [s], 1)``: the chunked part is all ``s`` positions, the rest empty,
    so the rank's share stays whole; at another position the pieces are not the ranks' shares."""
    import operator

    b = _Builder()
    x = b.input("x", 2, 8, 4, shard=1)
    pieces = b.op(aten.tensor_split.indices, x, [at], 1, shape=(2, 8, 4))
    pieces.meta["val"] = (torch.zeros(2, at, 4), torch.zeros(2, 8 - at, 4))
    first = b.op(operator.getitem, pieces, 0, shape=(2, at, 4))
    if refused:
        with pytest.raises(AutoparError, match="splits the sharded dim 1 at positions"):
            b.place(_sum(b, first))
        return
    placements, _ = b.place(_sum(b, first))
    assert placements[first] == Shard(1)


@pytest.mark.parametrize("dim,keepdim,found", [(-1, True, Shard(1)), ([2], False, Shard(1)), (1, True, None)])
def test_vector_norm_keeps_a_shard_it_does_not_reduce(dim, keepdim, found):
    """ZAYA's per-head ``q.norm(p=2, dim=-1, keepdim=True)`` with positions split keeps the split; a norm
    over the split positions is no sum of the ranks' parts (refused)."""
    b = _Builder()
    x = b.input("x", 2, 8, 4, shard=1)
    shape = [2, 8, 4]
    for d in ([dim] if isinstance(dim, int) else dim):
        shape[d] = 1
    if not keepdim:
        shape = [n for i, n in enumerate([2, 8, 4]) if i not in [d % 3 for d in ([dim] if isinstance(dim, int) else dim)]]
    norm = b.op(aten.linalg_vector_norm.default, x, 2, dim, keepdim, shape=tuple(shape))
    if found is None:
        with pytest.raises(AutoparError, match="takes the norm over the sharded dim 1"):
            b.place(_sum(b, norm))
        return
    placements, _ = b.place(_sum(b, norm))
    assert placements[norm] == found


@pytest.mark.parametrize("start,kept", [(-8, True), (-4, False)])
def test_a_slice_of_the_last_s_positions_keeps_the_shard(start, kept):
    """ZAYA's router ``h[:, -seq_length:]`` of ``seq_length`` positions is all of them on every rank."""
    b = _Builder()
    x = b.input("x", 2, 8, 4, shard=1)
    last = b.op(aten.slice.Tensor, x, 1, start, 2 ** 63 - 1, shape=(2, -start, 4))
    if not kept:
        with pytest.raises(AutoparError, match="slices the sharded dim 1"):
            b.place(_sum(b, last))
        return
    placements, _ = b.place(_sum(b, last))
    assert placements[last] == Shard(1)
