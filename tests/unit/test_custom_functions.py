"""Custom autograd Functions are placed from their traced forward and backward, never trusted.

autopar runs a kept Function's code as it is on the rank's tensors
(autopar/frontend/custom_functions.py), so the code on local tensors must compute the one-device
values: passes/autograd_functions.py places the aten ops of its forward, and of its forward with its
own backward, by the same rules as the graph.  A Function whose forward mixes rows, or whose
backward does (a gradient centred over the batch), and one of whole values whose backward is not
linear in the gradient (each rank's is its share of the batch's), is refused on a data axis; a
row-wise one compiles (its training against one device: tests/dist/test_custom_functions.py).
"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime import compile_program
from tests.support.models import HalfGradient


class _RowWise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.tanh(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (1 - torch.tanh(x) ** 2).clamp(min=0.5)  # a bounded derivative, row by row


class _CentredOverBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x - x.mean(0, keepdim=True)  # mixes the batch's rows

    @staticmethod
    def backward(ctx, grad):
        return grad


class _CentredGradient(HalfGradient):
    @staticmethod
    def backward(ctx, grad):
        return grad - grad.mean(0, keepdim=True)  # centred over the batch's rows


class _ClippedGradient(HalfGradient):
    @staticmethod
    def backward(ctx, grad):
        return grad.clamp(-0.01, 0.01)  # not linear in the gradient


class _OnWeight(torch.nn.Module):
    """The head's weight through a Function: replicated on every rank, its gradient each rank's share."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, ids):
        return torch.nn.functional.linear(self.embed(ids), _ClippedGradient.apply(self.head.weight), self.head.bias)


class _Model(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.function.apply(self.embed(ids)))


def _ce(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _compile(function, plan="dp=2"):
    ids = torch.randint(0, 16, (4, 6))
    return compile_program(_Model(function), (ids,), {}, plan, _ce, world_size=2)


def test_a_row_wise_function_compiles():
    traced, _ = _compile(_RowWise)
    assert any("autograd_function" in str(n.target) for n in traced.gm.graph.nodes)


def test_a_function_whose_forward_mixes_rows_is_refused():
    with pytest.raises(AutoparError, match=r"^autopar: cannot shard .* on mesh axis 'dp': its forward \(custom "
                                           r"torch.autograd.Function '_CentredOverBatch'\) would need its code changed"):
        _compile(_CentredOverBatch)


def test_a_function_whose_backward_mixes_rows_is_refused():
    with pytest.raises(AutoparError, match=r"^autopar: cannot shard .* on mesh axis 'dp': its backward \(custom "
                                           r"torch.autograd.Function '_CentredGradient'\) would need its code changed"):
        _compile(_CentredGradient)


def test_a_function_of_whole_values_whose_backward_is_not_linear_is_refused_on_a_data_axis():
    """On dp each rank's gradient is its share of the batch's, summed after backward: a backward
    that clips it would clip the shares, not their sum."""
    ids = torch.randint(0, 16, (4, 6))
    with pytest.raises(AutoparError, match=r"its backward \(custom torch.autograd.Function '_ClippedGradient'\)"):
        compile_program(_OnWeight(), (ids,), {}, "dp=2", _ce, world_size=2)
