"""Pipeline parallelism in one process: plans the pipeline pass refuses, and why.

The multi-rank half (equivalence with single-process training, P2P bytes against
``autopar.estimate(...).comm_table(stage)``, uneven and user splits, state dicts) is
tests/dist/test_pp.py.
"""
from __future__ import annotations

import pytest

import autopar
from autopar.errors import AutoparError
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build


def _compile(plan, overrides=None, split=None, world=2):
    from autopar.runtime import compile_program

    model, loss_fn, kwargs = build("example", overrides or {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return compile_program(model, inputs, kwargs, plan, loss_fn, world_size=world, pipeline_split=split)


def test_more_chunks_than_layers_names_valid_plans():
    with pytest.raises(AutoparError, match=r"autopar: .*4 pipeline chunks .* only 2 decoder layers.*"
                                           r"use pp=2:1f1b \(one chunk per rank\) or pp=1"):
        _compile("pp=2:interleaved,vpp=2,mb=4")
    with pytest.raises(AutoparError, match=r"autopar: .*4 pipeline chunks .* only 2 .*use pp=2 or pp=1"):
        _compile("pp=4:1f1b,mb=8", world=4)


@pytest.mark.parametrize("plan,nearest", [
    ("pp=2:1f1b,mb=1", "mb=2"),                      # 1F1B needs mb >= pp
    ("pp=4:1f1b,mb=3", "mb=4"),
    ("pp=2:dualpipev,mb=3", "mb=4"),                # DualPipeV: mb >= 2*pp (its number of chunks)
    ("pp=2:interleaved,vpp=2,mb=5", "mb=4 or mb=6"),  # mb // pp rounds must divide mb
])
def test_unsupported_microbatch_count_names_nearest(plan, nearest):
    """A schedule's micro-batch rule belongs to the plan alone: no such Plan exists, so nothing
    traces or compiles it (the plan text is refused when parsed)."""
    with pytest.raises(AutoparError, match=f"autopar: .*; use {nearest}"):
        autopar.Plan.parse(plan)


def test_bad_user_split():
    with pytest.raises(AutoparError, match=r"autopar: pipeline split \[2, 1\] .* 2 layers"):
        _compile("pp=2:1f1b,mb=2", split=(2, 1))


def test_a_number_crossing_a_pipeline_cut_is_refused():
    """torch's pipelining sends tensors only: an int carried between layers (RecurrentGemma's
    reshape size) crossing a cut is refused at compile time, not in the first step."""
    import pytest
    import torch

    from autopar.errors import AutoparError
    from passes.pipeline import _check_tensors_cross

    graph = torch.fx.Graph()
    hidden, size = graph.placeholder("hidden"), graph.placeholder("size")
    hidden.meta["val"], size.meta["val"] = torch.empty(2, 3), 6
    _check_tensors_cross([[hidden]], set())
    with pytest.raises(AutoparError, match=r"^autopar: a value that is not a tensor \(int\) crosses pipeline boundary 0"):
        _check_tensors_cross([[hidden, size]], set())


def test_a_size_is_rebuilt_from_the_input_sizes():
    """A SymInt an earlier chunk computed (DeepSeek-V3.2's ``min(index_topk, seq)``) is written
    again from the chunk's own input sizes; its nodes compute the same number at any size."""
    import torch
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from passes.pipeline import _rebuild_symint, _rebuildable, _sizes_symbols

    env = ShapeEnv()
    b, s = (env.create_unbacked_symint() for _ in range(2))
    with torch._subclasses.FakeTensorMode(shape_env=env):
        ids = torch.empty(b, s, dtype=torch.long)
    source = torch.fx.Graph()
    inp = source.placeholder("in_0")
    inp.meta["val"] = ids
    size = source.placeholder("size")
    expr = torch.sym_min(16, s) * 2 + b // 2
    size.meta["val"] = expr
    symbols = _sizes_symbols([inp])
    assert _rebuildable(size, symbols)
    other = source.placeholder("other")  # a size over a symbol no input holds: not rebuildable
    other.meta["val"] = env.create_unbacked_symint()
    assert not _rebuildable(other, symbols)

    g = torch.fx.Graph()
    chunk_inp = g.placeholder("in_0")
    out = _rebuild_symint(g, size, symbols=symbols, env={inp: chunk_inp})
    g.output(out)
    assert all(n.meta["autopar"].pass_name == "pipeline" for n in g.nodes if n.op == "call_function")
    fn = torch.fx.GraphModule(torch.nn.Module(), g)
    for batch, seq in [(2, 8), (3, 40)]:
        assert fn(torch.zeros(batch, seq, dtype=torch.long)) == min(16, seq) * 2 + batch // 2
