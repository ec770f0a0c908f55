"""ZeRO in one process: the flat shard layout, and ZeRO stages 1-3 without a process group.

The multi-rank half (equivalence with the unparallelized model on gloo ranks, the sharded
state per rank, ZeRO-3 outside ``train_step``) is tests/dist/test_zero.py; byte equality is
tests/dist/test_zero_bytes.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.runtime.gradients.flat_layout import FlatSegment
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import build
from tests.support.zero_jobs import SEQ, VOCAB


@functools.lru_cache(maxsize=None)
def _reference(model_name: str, opt_name: str, batch: int):
    _, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, batch, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, {})[0], batches, loss_fn, OPTIMIZERS[opt_name], kwargs)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_flat_segment_pads_and_round_trips(n):
    """A segment's buffer is its parameters back to back, then zeros to ``n`` equal shards: rank
    ``r``'s shard is the ``r``-th run of the buffer (what a reduce-scatter leaves in place)."""
    shapes = {"w": torch.Size([3, 5]), "b": torch.Size([2])}
    seg = FlatSegment(["w", "b"], shapes, n)
    tensors = {k: torch.arange(s.numel(), dtype=torch.float32).view(s) + 100 * i
               for i, (k, s) in enumerate(shapes.items())}
    assert seg.shard_numel == -(-17 // n) and seg.padded_numel == n * seg.shard_numel
    buf = seg.write(torch.full((seg.padded_numel,), 7.0), tensors)
    whole = torch.cat([tensors["w"].reshape(-1), tensors["b"]])
    assert torch.equal(buf[:17], whole) and not buf[17:].any()  # zero padding
    views = seg.views(buf)
    assert all(torch.equal(views[k], tensors[k]) for k in shapes)
    assert all(v.data_ptr() >= buf.data_ptr() and v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
               for v in views.values())  # views, no copy
    for r in range(n):
        piece = seg.rank_piece(buf, r)
        assert torch.equal(piece, buf[r * seg.shard_numel:(r + 1) * seg.shard_numel])
        cut = seg.cut(tensors, r, torch.full((seg.shard_numel,), 9.0))
        assert torch.equal(cut, piece)
        for name, start, stop, offset in seg.shard_pieces(r):
            assert torch.equal(cut[start:stop], tensors[name].reshape(-1)[offset:offset + stop - start])


def test_flat_segment_views_give_the_padded_gradient_in_one_buffer():
    """The views' backward is the gradient of the whole padded buffer (zeros in the padding and for
    a parameter without gradient): the reduce-scatter's input, with no flattening copy."""
    seg = FlatSegment(["w", "b"], {"w": torch.Size([2, 3]), "b": torch.Size([3])}, 4)
    buf = torch.zeros(seg.padded_numel, requires_grad=True)
    views = seg.views(buf)
    (views["w"] * 2).sum().backward()
    assert buf.grad.shape == (12,)
    assert torch.equal(buf.grad, torch.tensor([2.0] * 6 + [0.0] * 6))


@pytest.mark.parametrize("plan", ["zero=1", "zero=2", "zero=3"])
def test_zero_without_process_group(plan):
    """dp=1 in one process: ZeRO keeps one shard (the whole model) and issues no collective."""
    import autopar

    model, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, 4, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    losses = [pm.train_step(*b) for b in batches]
    assert pm.comm_stats() == []
    assert_equivalent(_reference("example", "adamw", 4), (losses, pm.state_dict()))

