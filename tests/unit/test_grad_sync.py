"""Gradient buckets as views (autopar/runtime/gradients/grad_sync.py ``GradSync._bucket_views``), on one
rank: backward accumulates into the bucket, the average is taken in place, the gradients stay
views across steps, and a gradient replaced meanwhile (set to None, assigned) is put back into
the bucket before the bucket is reduced.  The multi-rank reductions: tests/dist."""
from __future__ import annotations

import torch

from autopar.ops.step import AxisGroup
from autopar.passes.context import GradBucket
from autopar.runtime.gradients.grad_sync import GradSync


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
        self.b = torch.nn.Parameter(torch.tensor([3.0]))

    def forward(self, x):
        return (self.a * x).sum() + self.b.square().sum()


def _sync(model):
    bucket = GradBucket("dp", ("b", "a"), True, 12, divisor=4)  # one rank here: the divisor alone averages
    groups = {"dp": AxisGroup(group=None, size=1, rank=0)}
    return GradSync(model, [bucket], groups, lambda params: torch.optim.SGD(params, lr=0.5))


def test_gradients_are_views_of_one_bucket_across_steps():
    model = _Two()
    sync = _sync(model)
    flat, views = sync._views[0]
    model(torch.tensor(2.0)).backward()
    model(torch.tensor(2.0)).backward()  # two micro-batches accumulate in place
    sync.sync()
    assert model.a.grad is views[1] and model.b.grad is views[0]
    assert torch.equal(flat, torch.tensor([12.0, 4.0, 4.0]) / 4)  # d/db b^2 = 6, twice; d/da = x, twice
    sync.step()
    assert torch.equal(model.a.detach(), torch.tensor([0.5, 1.5])) and torch.equal(flat, torch.zeros(3))
    assert model.a.grad is views[1]  # zeroed in place, still the bucket


def test_a_replaced_gradient_is_put_back_into_the_bucket():
    model = _Two()
    sync = _sync(model)
    flat, views = sync._views[0]
    model.a.grad = None  # as torch's zero_grad(set_to_none=True) would
    model.b.grad = torch.tensor([8.0])  # a fresh tensor, not the view
    model(torch.tensor(1.0)).backward()
    sync.sync()
    assert model.a.grad is views[1] and model.b.grad is views[0]
    assert torch.equal(flat, torch.tensor([8.0 + 6.0, 1.0, 1.0]) / 4)
