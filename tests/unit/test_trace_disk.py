"""The trace cache's files (tests/support/trace_disk.py): a trace another process wrote is the
program a fresh export gives, and only keys every process writes alike are shared.

Every equivalence test of tests/dist runs its ranks on traces read back this way too (the pool
workers share the session's folder); these tests pin the properties one by one.
"""
from __future__ import annotations

import os

import pytest
import torch

from autopar.frontend import trace
from tests.support import trace_cache, trace_disk
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import make_batches


@pytest.fixture
def other_process(tmp_path, monkeypatch):
    """A session folder of its own, and an in-process cache that forgets between calls (what
    another process of the session would see)."""
    monkeypatch.setenv(trace_disk.ENV, str(tmp_path))

    def forget():
        monkeypatch.setattr(trace_cache, "_CACHE", {})
    forget()
    return forget


def _memo(model, kwargs, loss_fn, ids):
    return trace_cache.memo(trace.export_model, model, (ids,), kwargs, loss_fn)


def test_a_trace_read_back_is_the_fresh_program_bound_to_the_new_model(other_process):
    (ids,), target = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)[0]
    first, loss_fn, kwargs = build("hf_llama", {})
    _memo(first, kwargs, loss_fn, ids)
    assert [n for n in os.listdir(os.environ[trace_disk.ENV]) if n.endswith(".trace")], "nothing written"
    other_process()
    second, _, _ = build("hf_llama", {}, seed=7)
    loaded = trace_cache.STATS["loaded"]
    read = _memo(second, kwargs, loss_fn, ids)
    assert trace_cache.STATS["loaded"] == loaded + 1
    fresh = trace.export_model(second, (ids,), kwargs, loss_fn)
    assert read.gm.code == fresh.gm.code
    assert (read.batch_symbol, read.seq_symbol) == (fresh.batch_symbol, fresh.seq_symbol)
    own = {id(t) for t in list(second.parameters()) + list(second.buffers())}
    assert all(id(p) in own for p in read.gm.parameters()) and all(id(b) in own for b in read.gm.buffers())
    for a, b in zip(read.gm.graph.nodes, fresh.gm.graph.nodes, strict=True):
        assert (a.name, a.op, str(a.target)) == (b.name, b.op, str(b.target))
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack")
        assert a.meta.get("stack_trace") == b.meta.get("stack_trace")
        va, vb = a.meta.get("val"), b.meta.get("val")
        if isinstance(vb, torch.Tensor):
            assert (str(va.shape), str(va.stride()), va.dtype) == (str(vb.shape), str(vb.stride()), vb.dtype), a.name
    assert torch.equal(read.gm(ids, target), fresh.gm(ids, target))


def test_keys_are_named_alike_in_every_process_or_not_shared():
    model, loss_fn, kwargs = build("hf_llama", {})
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)

    def name(m, loss=loss_fn, inputs=(ids,)):
        return trace_disk.digest(trace_cache._call_key(m, inputs, kwargs, loss, None, False, True))

    base = name(model)
    assert base is not None and base == name(build("hf_llama", {}, seed=3)[0])
    assert name(build("hf_llama", {"num_hidden_layers": 3})[0]) not in (None, base)
    assert name(model, inputs=(torch.zeros(BATCH, SEQ + 1, dtype=torch.long),)) not in (None, base)
    assert name(model, loss=lambda out, y: loss_fn(out, y)) is None  # a lambda: one object per process

    class Local(torch.nn.Module):  # a test's local class: its name does not say which class
        def forward(self, x):
            return x
    assert trace_disk.digest(trace_cache._call_key(Local(), (ids,), {}, None, None, False, True)) is None
    assert trace_disk.digest(("repr", "<object at 0x7f12aa34>")) is None
