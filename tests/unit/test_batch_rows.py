"""On ``dp`` an op that keeps the batch dim but reads across the batch's rows is placed by its rule,
never from its shape (passes/batch_propagation.py, ``_along_rows``).

Batch propagation places a node whose shape holds the batch symbol as working row by row; a flip,
sort or softmax along the rows keeps that shape but mixes the rows of every rank, so each rank
would compute a different value than one device (docs/soundness.md, "Limits").  Those are refused
by their rules, naming the node; a cumulative sum along the rows has a rule that makes it the
global one (``cp_cumsum`` over dp); the same ops along another dim stay row-wise.
"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.runtime import compile_program


class _AlongRows(torch.nn.Module):
    def __init__(self, op: str, dim: int):
        super().__init__()
        self.op, self.dim = op, dim
        self.embed, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.embed(ids)
        if self.op == "flip":
            h = h + h.flip(self.dim)
        elif self.op == "softmax":
            h = h * h.softmax(self.dim)
        elif self.op == "sort":
            h = h + h.sort(self.dim).values
        else:
            h = h + 0.1 * h.cumsum(self.dim)
        return self.head(h)


def _compile(op: str, dim: int):
    ids = torch.randint(0, 16, (4, 6))
    ce = lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    return compile_program(_AlongRows(op, dim), (ids,), {}, "dp=2", ce, world_size=2)


@pytest.mark.parametrize("op", ["flip", "softmax", "sort"])
def test_an_op_across_the_batchs_rows_is_refused(op):
    with pytest.raises(AutoparError, match=rf"^autopar: cannot shard node '{op}.*on mesh axis 'dp'"):
        _compile(op, 0)


@pytest.mark.parametrize("op", ["flip", "softmax", "sort", "cumsum"])
def test_the_same_op_along_another_dim_is_row_wise(op):
    traced, _ = _compile(op, 1)
    assert not any("cp_cumsum" in str(n.target) for n in traced.gm.graph.nodes)


def test_a_cumulative_sum_along_the_rows_becomes_the_global_one():
    traced, _ = _compile("cumsum", 0)
    assert any("cp_cumsum" in str(n.target) for n in traced.gm.graph.nodes)
