"""``torch.no_grad()`` inside a model: torch.export traces it as a higher-order op that runs a graph
of its own (``wrap_with_set_grad_enabled``), which no aten rule covers.  Shard propagation places
that graph node by node from its operands' placements (passes/shard_propagation.py,
``_place_region``): a per-token region on this rank's sequence shard is kept as traced, and a
region that would need a collective (here a mean over the sharded sequence) is refused naming the
node inside it that needs one, its module and its source line.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.runtime import compile_program
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build


class NoGradGate(nn.Module):
    """The example decoder, its logits scaled by a gate computed without gradients."""

    def __init__(self, over: str):
        super().__init__()
        self.over = over
        self.inner = build("example", {})[0]

    def forward(self, ids):
        logits = self.inner(ids)
        with torch.no_grad():
            if self.over == "token":  # each position's own largest logit
                gate = (logits.amax(-1, keepdim=True) > -1e9).to(logits.dtype)
            else:  # the mean over every position: the whole sequence, which a cp rank does not hold
                gate = (logits.mean(1, keepdim=True) > -1e9).to(logits.dtype)
        return logits * gate


def _compile(over: str):
    _, loss_fn, _ = build("example", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return compile_program(NoGradGate(over), inputs, {}, "cp=2", loss_fn, world_size=2)


def test_a_per_token_no_grad_region_is_placed_on_the_ranks_tokens():
    traced, _ = _compile("token")
    regions = [n for n in traced.gm.graph.nodes if n.target is torch.ops.higher_order.wrap_with_set_grad_enabled]
    assert len(regions) == 1
    body = getattr(traced.gm, regions[0].args[1].target)
    assert any(n.target is torch.ops.aten.amax.default for n in body.graph.nodes)


def test_a_no_grad_region_over_the_sharded_dim_is_refused_inside_it():
    with pytest.raises(AutoparError) as info:
        _compile("sequence")
    message = str(info.value)
    assert message.startswith("autopar: cannot shard node 'mean"), message
    assert "needs a collective on cp" in message and "inside torch.no_grad()" in message, message
    assert "test_grad_mode_region.py" in message, message


class _AliasedOut(nn.Module):
    """``h.to(h.dtype)`` inside ``torch.no_grad()`` is ``h`` itself; export routes the later
    ``self.head(h)`` through the region's result (as Dots3's gate after its indexer)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        with torch.no_grad():
            h = h.to(h.dtype)
            scale = (h.abs().amax(-1, keepdim=True) > -1.0).to(h.dtype)
        return self.head(h) * scale


def test_a_no_grad_regions_result_that_is_its_operand_is_read_as_the_operand():
    """At run time the region hands ``h`` back itself, gradient history included: after cleanup the
    head reads the embedding's output, not the region's (gradient-free, to the passes) result."""
    from autopar.frontend.trace import trace_model
    from autopar.passes.cleanup import cleanup_pass

    _, loss_fn, _ = build("example", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    traced = trace_model(_AliasedOut(), inputs, {}, loss_fn)
    (linear,) = traced.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    assert linear.args[0].target is not torch.ops.aten.embedding.default  # export's routing (the premise)
    result = cleanup_pass(traced.gm, None)
    assert linear.args[0].target is torch.ops.aten.embedding.default
    assert "1 uses of a no-grad region's result that is its operand" in result.notes[-1]
