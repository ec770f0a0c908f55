"""Sequence parallelism where a model merges the sequence with other dims (one process, no ranks).

OPT's decoder layers flatten batch and sequence (``reshape(-1, hidden)``) before their MLP, so the
MLP region's entry and its row-parallel output meet the sequence merged into one dim.  The SP pass
splits the merged dim back out around each collective (a view to the merged dims, the collective
on the sequence's dim, a view back: ``passes/sequence_parallel.py``), and shard propagation checks
the layout in between: the merged dim holds the rank's share of every run of the sequence, which a
collective on another dim would contradict (refused, never wrong).  The multi-rank equality is
tests/dist/test_architectures.py (OPT under ``tp=2,sp`` and ``tp=2,sp,dp=2``).
"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.ops import collectives
from autopar.passes.block_layout import EVERY_KEY
from autopar.passes.context import META_KEY
from autopar.runtime import compile_program
from tests.support.models import MODELS, make_batch

pytest.importorskip("transformers")


def _compiled(name: str, plan: str):
    factory, loss_fn, kwargs = MODELS[name]
    ids, _ = make_batch(128, 4, 16, 0)
    traced, _ = compile_program(factory(), (ids,), kwargs, plan, loss_fn, world_size=2)
    return traced


def test_opt_collectives_split_the_merged_sequence_back_out():
    traced = _compiled("hf_opt", "tp=2,sp")
    seq = traced.seq_symbol
    views = [n for n in traced.gm.graph.nodes if n.meta.get(META_KEY) and n.meta[META_KEY].role == "sp_view"]
    assert len(views) == 2 * 2 * 2  # two layers, two collectives each (MLP entry and exit), a view on each side
    for view in views[::2]:  # the view into the collective: [batch, sequence, hidden], the collective on dim 1
        (collective,) = view.users
        assert collective.target in (collectives.all_gather, collectives.reduce_scatter)
        assert collective.args[1] == 1 and view.meta["val"].shape[1].node.expr == seq
    exits = [v for v in views[1::2] if v.args[0].target is collectives.reduce_scatter]
    assert len(exits) == 2 and all(v.meta[EVERY_KEY] == seq for v in exits)  # the rank's share of every run


def test_a_merged_dim_without_the_view_that_merged_it_is_refused():
    """A model whose MLP input is a merged token dim made by an op other than a view (here ``cat``
    of the batch's rows) gives SP no order to split back out: refused, naming the node."""
    class CatTokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.norm = torch.nn.Embedding(128, 32), torch.nn.LayerNorm(32)
            self.up, self.down, self.head = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Linear(32, 128)

        def forward(self, ids):
            h = self.emb(ids)
            flat = torch.cat(list(h.unbind(0)), dim=0)  # [batch * seq, hidden] without a view
            flat = flat + self.down(torch.relu(self.up(self.norm(flat))))
            return self.head(flat.reshape(h.shape))

    ids, _ = make_batch(128, 4, 16, 0)
    with pytest.raises(AutoparError, match="autopar: sequence parallelism needs the sequence dimension"):
        compile_program(CatTokens(), (ids,), None, "tp=2,sp", lambda out, t: out.float().mean(), world_size=2)
