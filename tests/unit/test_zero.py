"""ZeRO in one process: the flat shard layout, and ZeRO stages 1-3 without a process group.

The multi-rank half (equivalence with the unparallelized model on gloo ranks, the sharded
state per rank, ZeRO-3 outside ``train_step``) is tests/dist/test_zero.py; byte equality is
tests/dist/test_zero_bytes.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from autopar.runtime.flat_layout import FlatLayout
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import build
from tests.support.zero_jobs import SEQ, VOCAB


@functools.lru_cache(maxsize=None)
def _reference(model_name: str, opt_name: str, batch: int):
    _, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, batch, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, {})[0], batches, loss_fn, OPTIMIZERS[opt_name], kwargs)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_flat_layout_pads_and_round_trips(n):
    shapes = {"w": torch.Size([3, 5]), "norm": torch.Size([7]), "b": torch.Size([2])}
    lay = FlatLayout(["w", "norm", "b"], shapes, {"norm"}, n)
    tensors = {k: torch.arange(s.numel(), dtype=torch.float32).view(s) + 100 * i
               for i, (k, s) in enumerate(shapes.items())}
    flat = lay.flatten(tensors)
    # A segment: w (15) then b (2) = 17 elements; B segment: norm (7), each padded to a multiple of n.
    sa, sb = -(-17 // n), -(-7 // n)
    assert (lay.sa, lay.sb) == (sa, sb)
    buf = lay.rank_major(flat)
    assert buf.numel() == n * (sa + sb)
    rows = buf.view(n, sa + sb)
    a_full = torch.cat([tensors["w"].reshape(-1), tensors["b"]])
    assert torch.equal(rows[:, :sa].reshape(-1)[:17], a_full)
    assert torch.equal(rows[:, sa:].reshape(-1)[:7], tensors["norm"])
    assert not rows[:, :sa].reshape(-1)[17:].any() and not rows[:, sa:].reshape(-1)[7:].any()  # zero padding
    assert torch.equal(lay.from_rank_major(buf), flat)
    views = lay.views(flat)
    assert all(torch.equal(views[k], tensors[k]) for k in shapes)


@pytest.mark.parametrize("n,numel", [(1, 17), (2, 16), (2, 17), (3, 17), (4, 16)])
def test_flat_layout_without_partial_segment(n, numel):
    """No ``B`` segment: the rank-major buffer is ``A`` then zeros, in a buffer of its own even
    when nothing is padded (the cost model counts it; a one-rank reduce-scatter averages it in place)."""
    lay = FlatLayout(["w", "b"], {"w": torch.Size([numel - 2]), "b": torch.Size([2])}, set(), n)
    flat = torch.arange(1, numel + 1, dtype=torch.float32)
    buf = lay.rank_major(flat)
    assert buf.numel() == n * lay.sa and lay.sb == 0
    assert torch.equal(buf[:numel], flat) and torch.equal(buf[numel:], torch.zeros(n * lay.sa - numel))
    assert buf.data_ptr() != flat.data_ptr()
    assert torch.equal(lay.from_rank_major(buf), flat)


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

