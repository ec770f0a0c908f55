"""The runtime checks each step's global shapes against the guards torch.export recorded.

A model that unrolls a loop over chunks of the sequence (a chunked scan) is traced for the
lengths with as many chunks as the example; cleanup drops export's ``_guards_fn`` from the graph,
so without the runtime's check a longer batch would train on the first chunks only.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import AutoparError
from autopar.frontend.trace import trace_memo, trace_model
from autopar.plan import Plan
from autopar.runtime.stepping.shape_guards import ShapeGuards

CHUNK = 4


class _ChunkedScan(nn.Module):
    """A running sum over chunks of ``CHUNK`` positions, the chunks unrolled by Python."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 32)

    def forward(self, ids):
        h = self.embed(ids)
        state = h.new_zeros(h.shape[0], h.shape[2])
        outs = []
        for i in range((ids.shape[1] + CHUNK - 1) // CHUNK):  # export guards the number of chunks
            chunk = h[:, CHUNK * i:CHUNK * (i + 1)]
            state = state + chunk.sum(1)
            outs.append(chunk + state[:, None])
        return self.proj(torch.cat(outs, 1))


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _batch(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (2, length), generator=g), torch.randint(0, 32, (2, length), generator=g)


def test_a_step_longer_than_the_traced_chunks_is_refused_not_cut_short():
    torch.manual_seed(0)
    model = _ChunkedScan()
    ids, target = _batch(8)
    with torch.no_grad():
        expected = float(_loss(model(ids), target))
    with trace_memo(None):  # a fresh export: the suite's trace cache keeps no guards
        pm = autopar.parallelize(model, example_inputs=(ids,), plan="none", loss_fn=_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    assert pm.train_step((ids,), target) == pytest.approx(expected, abs=1e-6)  # as traced: one device's loss
    longer, longer_target = _batch(12)
    with pytest.raises(AutoparError, match=r"autopar: the model was traced at input shapes \[\(2, 8\), \(2, 8\)\]"
                                           r".*global batch has shapes \[\(2, 12\), \(2, 12\)\]"):
        pm.train_step((longer,), longer_target)


def test_the_guards_see_the_global_shapes_of_a_local_batch():
    ids, target = _batch(8)
    with trace_memo(None):
        traced = trace_model(_ChunkedScan(), (ids,), None, _loss, target)
    assert traced.input_guards is not None
    guards = ShapeGuards(traced.input_guards, (ids, target), Plan.parse("cp=2"))
    half, half_target = _batch(4)
    guards.check((half,), half_target, local=True)  # this rank's 4 of 8 tokens
    guards.check((ids,), target, local=False)
    longer, longer_target = _batch(6)
    with pytest.raises(AutoparError, match=r"shapes \[\(2, 12\), \(2, 12\)\]"):
        guards.check((longer,), longer_target, local=True)  # 6 of 12 tokens: three chunks
