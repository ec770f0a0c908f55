"""Custom autograd Functions are placed from their traced forward and backward, never trusted.

autopar runs a kept Function's code as it is on the rank's tensors
(autopar/frontend/custom_functions.py), so the code on local tensors must compute the one-device
values: passes/autograd_functions.py places the aten ops of its forward, and of its forward with its
own backward, by the same rules as the graph.  A Function whose forward mixes rows, or whose
backward does (a gradient centred over the batch), is refused on a data axis; a
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
