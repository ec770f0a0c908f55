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
    _check_tensors_cross([[hidden]])
    with pytest.raises(AutoparError, match=r"^autopar: a value that is not a tensor \(int\) crosses pipeline boundary 0"):
        _check_tensors_cross([[hidden, size]])
