"""What state-space mixers (Mamba, Mamba-2) need under tp and SP (issue 40, item 2), one process.

- SP finds the sequence on an activation by its size: the traced sequence symbol, the length export
  fixed it to (Mamba's scan loops over the positions), or a scan's length padded to whole chunks
  and traced at a multiple of the chunk (``m * ceil(s / m)``); a fixed length that another dim
  also has is not taken;
- a split whose parts are each several blocks of a fused projection (Mamba-2's ``z | xBC | dt``,
  laid out as z|x|B|C|dt) gives each part its blocks' local sizes: B and C kept whole replicated,
  ``xBC`` laid out by its blocks with their whole flags, which the convolution's weight is cut by
  (``local_blocks`` with whole blocks) and whose local channel count is its ``groups``;
- ``local_blocks`` takes whole blocks whole and puts their gradient back;
- a batched matmul of replicated operands is replicated (Mamba's ``dt_proj.weight @ time_step``);
  a partial one beside a replicated one stays partial;
- ``torch.concatenate`` is ``aten.cat`` for the rules (Zamba's hybrid layer).

Multi-rank equality: tests/dist/test_mixers.py (``hf_mamba``, ``hf_mamba2``) and the zoo subset.
"""
from __future__ import annotations

import operator

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._sympy.functions import FloorDiv, Mod

from autopar.ops import collectives as C, whole_rows
from autopar.ops.whole_rows import local_blocks
from autopar.passes.rules import is_seq_size
from tests.unit.test_soundness import _Builder

aten = torch.ops.aten


def _loss(b, x):
    return b.op(aten.sum.dim_IntList, x, list(range(x.meta["val"].dim())), shape=())


def test_sequence_size_symbol_fixed_length_and_padded_chunks():
    s = sympy.Symbol("s50", integer=True, positive=True)
    padded = s + Mod(16 - Mod(s, 16), 16)  # the scan's length padded to whole chunks of 16
    assert is_seq_size(s, s) and not is_seq_size(2 * s, s) and not is_seq_size(s + 1, s)
    assert is_seq_size(FloorDiv(padded, 16) * 16, s)
    assert not is_seq_size(FloorDiv(padded, 16) * 16 + 1, s)
    assert not is_seq_size(FloorDiv(padded, 16), s)  # the number of chunks
    assert is_seq_size(32, sympy.Integer(32)) and not is_seq_size(64, sympy.Integer(32))


def test_a_fixed_length_shared_with_another_dim_is_not_the_sequence():
    from autopar.passes.sequence_parallel import _seq_dim

    class Ctx:
        seq_symbol = sympy.Integer(32)

    b = _Builder()
    assert _seq_dim(b.input("x", 4, 32, 64), Ctx) == 1
    assert _seq_dim(b.input("y", 4, 32, 32), Ctx) is None


def _mamba2_in_proj(b):
    """in_proj output [2, 5, 8 + 12 + 2] laid out z(8) | x(8) B(2) C(2) | dt(2), B and C whole."""
    y = b.input("y", 2, 5, 22, shard=2)
    y.meta.update(autopar_blocks=(8, 8, 2, 2, 2), autopar_whole=(False, False, True, True, False))
    split = b.op(aten.split_with_sizes.default, y, [8, 12, 2], -1, shape=(1,))
    split.meta["val"] = tuple(torch.zeros(2, 5, n) for n in (8, 12, 2))
    z, xbc, dt = (b.op(operator.getitem, split, i, shape=(2, 5, n)) for i, n in enumerate((8, 12, 2)))
    return split, z, xbc, dt


def test_split_into_groups_of_blocks_keeps_each_groups_layout_and_the_whole_blocks():
    b = _Builder()
    split, z, xbc, dt = _mamba2_in_proj(b)
    t = b.op(aten.transpose.int, xbc, 1, 2, shape=(2, 12, 5))
    w, bias = b.param("conv_weight", 12, 1, 3), b.param("conv_bias", 12)
    conv = b.op(aten.conv1d.default, t, w, bias, [1], [2], [1], 12, shape=(2, 12, 7))
    out = b.op(aten.add.Tensor, _loss(b, conv), _loss(b, b.op(aten.mul.Tensor, z, dt.args[0], shape=(2, 5, 8))),
               shape=())
    placements, grads = b.place(out)
    assert split.args[1] == [4, 8, 1]  # z's share, x's share + B + C whole, dt's share
    assert placements[split] == (Shard(2), Shard(2), Shard(2))
    assert xbc.meta["autopar_blocks"] == (8, 2, 2) and xbc.meta["autopar_whole"] == (False, True, True)
    assert conv.args[6] == 8  # groups: 4 channels of x, B and C whole
    cut = conv.args[1]
    assert cut.target is local_blocks and cut.args[2] == [8, 2, 2] and cut.args[4] == [False, True, True]
    assert isinstance(grads[w], Partial)


def test_a_part_of_whole_blocks_only_is_replicated():
    b = _Builder()
    y = b.input("y", 2, 5, 12, shard=2)
    y.meta.update(autopar_blocks=(8, 2, 2), autopar_whole=(False, True, True))
    split = b.op(aten.split_with_sizes.default, y, [8, 4], -1, shape=(1,))
    split.meta["val"] = tuple(torch.zeros(2, 5, n) for n in (8, 4))
    first = b.op(operator.getitem, split, 0, shape=(2, 5, 8))
    placements, _ = b.place(_loss(b, first))
    assert split.args[1] == [4, 4] and placements[split] == (Shard(2), Replicate())


def test_local_blocks_keeps_whole_blocks_whole(monkeypatch):
    class Group:
        size, rank = 2, 1

    monkeypatch.setattr(whole_rows, "find_group", lambda axis: Group)
    x = torch.arange(8.0, requires_grad=True)
    out = local_blocks(x, 0, [4, 2, 2], "tp", [False, True, False])
    assert out.tolist() == [2.0, 3.0, 4.0, 5.0, 7.0]
    (out * torch.arange(1.0, 6.0)).sum().backward()
    assert x.grad.tolist() == [0, 0, 1, 2, 3, 4, 0, 5]


def test_batched_matmul_of_replicated_and_partial_operands():
    b = _Builder()
    w = b.param("dt_proj_weight", 6, 3)
    step = b.input("time_step", 2, 3, 5)
    prod = b.op(aten.matmul.default, w, step, shape=(2, 6, 5))
    placements, _ = b.place(_loss(b, prod))
    assert placements[prod] == Replicate()
    b = _Builder()
    x = b.input("x", 2, 5, 8, shard=2)
    partial = b.op(aten.linear.default, x, b.param("x_proj", 3, 8, shard=1), shape=(2, 5, 3))
    prod = b.op(aten.matmul.default, partial, b.param("m", 3, 4), shape=(2, 5, 4))
    reduced = b.op(C.all_reduce, prod, "tp", "x_proj", shape=(2, 5, 4))
    placements, _ = b.place(_loss(b, reduced))
    assert isinstance(placements[partial], Partial) and isinstance(placements[prod], Partial)


def test_concatenate_is_cat_after_cleanup():
    from autopar.passes.cleanup import _canonical_cats

    class Cat(torch.nn.Module):
        def forward(self, x):
            return torch.concatenate([x, x], dim=-1)

    gm = torch.export.export(Cat(), (torch.ones(2, 3),)).module()
    before = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    _canonical_cats(gm)
    after = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.cat.default in after and aten.concatenate.default not in after
    assert len(before) == len(after)
