"""Rules for ops that attention variants reach under tp (issue 40, item 3), on hand-built graphs.

- ``einsum`` by its equation's letters: a kept letter's shard moves to its output position (an
  operand holding it unsplit is sliced); a summed letter split in both operands gives partial
  sums; operands split on different letters, or a summed letter split in one operand only, are
  refused;
- an in-place element-wise op (``masked_fill_`` on XLM's scores) is exact only when its
  destination is placed as its result: a replicated destination met by a sharded operand is
  refused, since the rank would write into a slice while later readers read the tensor unchanged;
- ``view_as_complex`` / ``view_as_real`` (DeepSeek-V2's rotary) keep a shard on any dim but the
  pairs' last one.

Their models under ``tp=2,sp`` against one device: docs/zoo.md (``xlm``, ``deepseek_v2``).
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

from autopar.errors import AutoparError
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
