"""Rules that linear-attention and state-space mixers need under tp (issue 40, item 2), one process.

- ``cat`` of parts each sharded on the joined dim lays the result out by blocks
  (``passes/block_layout.py``), which element-wise ops, transposes and a depthwise ``conv1d`` carry
  and a split at the parts reads; the convolution's replicated weight is cut block by block
  (``local_blocks``) and its gradient is a partial sum over tp;
- a value laid out by blocks never meets one split evenly on the same dim (refused);
- a dim merged behind others (a gated norm's ``reshape(-1, head_dim)``) is only split back;
- ``conv1d`` along the sharded sequence is refused by its rule; under cp the convolution of LFM3's
  short convolution is found first and runs whole over the gathered sequence;
- ``local_blocks`` takes the rank's share of each block, and its backward puts the gradient back;
- a tensor written in place by ``copy_`` gives what was written its gradient (a recurrence's output).

The multi-rank equality (Qwen3-Next and LFM3 under tp=2 and tp=2,sp) is tests/dist/test_mixers.py and
tests/e2e/test_zoo.py.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Shard

from autopar.errors import AutoparError
from autopar.ops import whole_rows
from autopar.ops.whole_rows import local_blocks
from tests.unit.test_soundness import _Builder

aten = torch.ops.aten


def _loss(b, x):
    """Every element of ``x`` summed: the loss (its rule all-reduces the partial sum)."""
    return b.op(aten.sum.dim_IntList, x, list(range(x.meta["val"].dim())), shape=())


def _mixer(b, parts=(4, 4, 8)):
    """q, k, v [2, 5, size] sharded on their last dim, cat, transposed to channels, then a depthwise conv."""
    xs = [b.input(f"x{i}", 2, 5, n, shard=2) for i, n in enumerate(parts)]
    c = sum(parts)
    cat = b.op(aten.cat.default, xs, -1, shape=(2, 5, c))
    t = b.op(aten.transpose.int, cat, 1, 2, shape=(2, c, 5))
    w = b.param("conv_weight", c, 1, 3)
    conv = b.op(aten.conv1d.default, t, w, None, [1], [2], [1], c, shape=(2, c, 7))
    return cat, t, w, conv


def test_cat_of_sharded_parts_is_laid_out_by_blocks_through_a_depthwise_conv():
    b = _Builder()
    cat, t, w, conv = _mixer(b)
    act = b.op(aten.silu.default, conv, shape=(2, 16, 7))
    back = b.op(aten.transpose.int, act, 1, 2, shape=(2, 7, 16))
    split = b.op(aten.split_with_sizes.default, back, [4, 4, 8], -1, shape=(2, 7, 16))
    split.meta["val"] = tuple(torch.zeros(2, 7, n) for n in (4, 4, 8))
    placements, grads = b.place(_loss(b, act))
    assert placements[cat] == Shard(2) and placements[t] == placements[act] == Shard(1)
    assert cat.meta["autopar_blocks"] == (4, 4, 8) and act.meta["autopar_blocks"] == (4, 4, 8)
    assert placements[conv] == Shard(1) and conv.args[6] == 8  # groups: the local channels
    cut = conv.args[1]
    assert cut.target is local_blocks and cut.args[0] is w and cut.args[2] == [4, 4, 8]
    assert isinstance(grads[w], Partial)  # the replicated weight's gradient: summed over tp
    assert split.args[1] == [2, 2, 4] and placements[split] == (Shard(2),) * 3


def test_blocks_meeting_an_even_shard_are_refused():
    b = _Builder()
    cat, *_ = _mixer(b)
    other = b.input("other", 2, 5, 16, shard=2)
    out = b.op(aten.add.Tensor, cat, other, shape=(2, 5, 16))
    with pytest.raises(AutoparError, match=r"laid out differently .* other split evenly"):
        b.place(_loss(b, out))


def test_conv1d_along_the_sharded_sequence_is_refused():
    b = _Builder()
    x = b.input("x", 2, 16, 6, shard=2)
    conv = b.op(aten.conv1d.default, x, b.param("w", 16, 1, 3), None, [1], [2], [1], 16, shape=(2, 16, 8))
    with pytest.raises(AutoparError, match=r"cannot shard node 'conv1d.*a convolution along the sharded sequence"):
        b.place(_loss(b, conv))


def test_heads_merged_behind_rows_only_split_back():
    """``x.reshape(-1, d)`` of [b, s, h, d] sharded on h, normed row-wise, viewed back to [b, s, h, d]
    or to [b, s, h * d]; a view that cuts the runs of heads otherwise is refused."""
    b = _Builder()
    x = b.input("x", 2, 3, 4, 8, shard=2)
    rows = b.op(aten.reshape.default, x, [-1, 8], shape=(24, 8))
    sq = b.op(aten.mul.Tensor, rows, rows, shape=(24, 8))
    back = b.op(aten.view.default, sq, [2, 3, 4, 8], shape=(2, 3, 4, 8))
    placements, _ = b.place(_loss(b, back))
    assert placements[sq] == Shard(0) and sq.meta["autopar_every"] == 4
    assert placements[back] == Shard(2) and back.args[1] == [2, 3, 2, 8]

    # back to [b, s, h * d] (Qwen3.5's gated norm before its out-projection): the heads lead the
    # merged last dim, an even shard of it; flattened whole: the rank's share of every h * d elements
    b = _Builder()
    x = b.input("x", 2, 3, 4, 8, shard=2)
    rows = b.op(aten.reshape.default, x, [-1, 8], shape=(24, 8))
    merged = b.op(aten.reshape.default, rows, [2, 3, -1], shape=(2, 3, 32))
    flat = b.op(aten.view.default, rows, [192], shape=(192,))
    placements, _ = b.place(b.op(aten.add.Tensor, _loss(b, merged), _loss(b, flat), shape=()))
    assert placements[merged] == Shard(2) and "autopar_every" not in merged.meta
    assert placements[flat] == Shard(0) and flat.meta["autopar_every"] == 32

    b = _Builder()
    x = b.input("x", 2, 3, 4, 8, shard=2)
    rows = b.op(aten.reshape.default, x, [-1, 8], shape=(24, 8))
    other = b.op(aten.view.default, rows, [12, 16], shape=(12, 16))
    with pytest.raises(AutoparError, match=r"share of every 4 elements"):
        b.place(_loss(b, other))


def test_local_blocks_takes_each_blocks_share_and_puts_the_gradient_back(monkeypatch):
    class Group:
        size, rank = 2, 1

    monkeypatch.setattr(whole_rows, "find_group", lambda axis: Group)
    x = torch.arange(12.0, requires_grad=True)
    out = local_blocks(x, 0, [4, 8], "tp")
    assert out.tolist() == [2.0, 3.0, 8.0, 9.0, 10.0, 11.0]
    out.sum().backward()
    assert x.grad.tolist() == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]


def test_a_tensor_written_in_place_passes_its_gradient_to_what_was_written():
    """A recurrence's output filled step by step (``out = zeros_like(x); out[:, :, 0] = y[:, :, 0]``):
    the loss reads ``out``, whose edges do not show the write, yet the replicated weight that ``y``
    met on shards has a partial gradient, summed over tp (it was missed before: silently wrong)."""
    b = _Builder()
    x = b.input("x", 2, 4, 3, shard=1)
    w = b.param("w", 4, 1)
    y = b.op(aten.mul.Tensor, x, w, shape=(2, 4, 3))
    out = b.op(aten.zeros_like.default, x, shape=(2, 4, 3))
    dst = b.op(aten.select.int, out, 2, 0, shape=(2, 4))
    b.op(aten.copy_.default, dst, b.op(aten.select.int, y, 2, 0, shape=(2, 4)), shape=(2, 4))
    _, grads = b.place(_loss(b, out))
    assert isinstance(grads[w], Partial) and grads[out] == Shard(1)


def test_a_mixer_under_cp_runs_its_convolution_whole():
    """LFM's short convolution convolves over the sequence: under cp its input (channels first) is
    gathered into global order and the convolution runs whole (passes/cp_cores.py); its rule alone
    refuses a sharded sequence.  Equal to one device: tests/dist/test_mixers.py."""
    pytest.importorskip("transformers")
    from autopar.ops import cp_attention as CPA
    from autopar.runtime import compile_program
    from tests.support.models import MODELS, make_batch

    factory, loss_fn, kwargs = MODELS["hf_lfm3"]
    ids, _ = make_batch(128, 4, 16, 0)
    traced, _ = compile_program(factory(), (ids,), kwargs, "cp=2:ring", loss_fn, world_size=2)
    (conv,) = [n for n in traced.gm.graph.nodes if n.target is aten.conv1d.default]
    assert conv.args[0].target is CPA.cp_gather_sequence and conv.args[0].args[1] == 2


@pytest.mark.parametrize("shape,dim,every", [
    ((24, 8), 0, 4),         # a gated norm's gate.reshape(-1, head_dim): runs of 4 heads in b * s * heads
    ((6, 4, 8), 1, None),    # the heads get a dim of their own: an even shard
    ((3, 64), 1, 32),        # two positions' features side by side: runs of all 32
    ((2, 6, 16), 1, 2),      # only the heads' outer factor of 2 in the dim: 2 ranks split it
])
def test_a_split_dim_merged_behind_others_lands_on_its_outermost_factor(shape, dim, every):
    """[2, 3, 32] (4 heads x 8) sharded on its last dim, viewed so that it merges behind positions."""
    b = _Builder()
    x = b.input("x", 2, 3, 32, shard=2)
    view = b.op(aten.reshape.default, x, list(shape), shape=shape)
    placements, _ = b.place(_loss(b, view))
    assert placements[view] == Shard(dim) and view.meta.get("autopar_every") == every


def test_a_split_dim_merged_so_that_no_dim_holds_its_shards_is_refused():
    """A run of 2 elements (the heads' outer factor) cannot be split over 4 ranks."""
    b = _Builder()
    x = b.input("x", 2, 3, 32, shard=2)
    view = b.op(aten.reshape.default, x, [2, 6, 16], shape=(2, 6, 16))
    with pytest.raises(AutoparError, match="merged behind another dim"):
        b.place(_loss(b, view), size=4)
