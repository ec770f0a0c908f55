"""Hash routing (DeepSeek-V4's first layers): experts chosen by a table lookup of the token ids, in one process.

The tiny model (tests/support/models.py ``HashMoE``) routes token ``t`` to the experts in row
``input_ids[t]`` of a ``[vocab, k]`` buffer and weights them by a router's scores gathered there;
its experts are transformers' grouped matmul over the (token, slot) rows sorted by expert, counted
by a histogram.  The analysis finds the block from the lookup (autopar/frontend/moe_table_routing.py)
and the ep rewrite dispatches by the looked-up ids.  The graph cannot bound a table's values, and
under dp the experts' row counts are the rank's share only for ids at least 0: the experts pass
(passes/expert_parallel.py) checks the ids at run time, so a table holding an id outside the
experts is refused with an ``autopar:`` error, never run.
"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.ops import moe as M
from autopar.runtime import compile_program

pytest.importorskip("transformers")
from tests.support.models import hash_moe, lm_loss  # noqa: E402

EXPERTS, TOP_K = 4, 2


def _batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g)


def test_a_table_lookup_of_the_token_ids_is_a_routing():
    model = hash_moe()
    ids, _ = _batch()
    block, = analyze(trace_model(model, (ids,), {}, lm_loss).gm).moe
    assert (block.style, block.num_experts, block.top_k) == ("stacked", EXPERTS, TOP_K)
    lookup = block.index.args[0]  # the ids: the table's rows (cast to int64)
    assert lookup.target is torch.ops.aten.index.Tensor and lookup.args[0].target == "model.tid2eid"
    assert block.router is not None and block.router.args[1].target == "model.router.weight"
    assert block.weights.target is torch.ops.aten.div.Tensor  # the scores gathered at the ids, normalised
    assert sorted(block.param_names) == ["model.down", "model.gate_up"]


def _checks(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is M.checked_expert_ids]


@pytest.mark.parametrize("plan,world", [("dp=2", 2), ("none", 1)])
def test_experts_run_as_traced_check_the_looked_up_ids(plan, world):
    """Under dp the experts' histogram of looked-up ids is the rank's share once the ids are checked;
    the checked program computes the module's loss (one process: the rank's share is the batch)."""
    model = hash_moe()
    ids, target = _batch()
    traced, _ = compile_program(model, (ids,), {}, plan, lm_loss, world_size=world)
    check, = _checks(traced.gm)
    assert check.args[1] == EXPERTS and check.args[0].args[0].target is torch.ops.aten.index.Tensor
    assert {u.target for u in check.users} == {torch.ops.aten.gather.default, torch.ops.aten.reshape.default}
    torch.testing.assert_close(traced.gm(ids, target), lm_loss(model(ids), target))


@pytest.mark.parametrize("bad", [-1, EXPERTS])
def test_a_table_with_an_id_past_the_experts_is_refused_at_run_time(bad):
    """The table is a buffer loaded with the checkpoint, maybe after compiling: its values are checked
    by every forward, not trusted from the example."""
    model = hash_moe()
    ids, target = _batch()
    traced, _ = compile_program(model, (ids,), {}, "dp=2", lm_loss, world_size=2)
    table = dict(traced.gm.named_buffers())["model.tid2eid"]
    with torch.no_grad():
        table[int(ids[1, 3]), 1] = bad
    with pytest.raises(AutoparError, match=rf"^autopar: MoE routing met expert id {bad} but the block has "
                                           rf"{EXPERTS} experts; .* must lie in \[0, {EXPERTS - 1}\]"):
        traced.gm(ids, target)


def test_ep_dispatches_by_the_looked_up_ids():
    """dp=2,ep=2 rewrites the block; dispatch / experts / combine with the cut-out body (no ep group,
    one process) give the module's experts' output and gradients."""
    model = hash_moe()
    ids, _ = _batch()
    traced, _ = compile_program(model, (ids,), {}, "dp=2,ep=2", lm_loss, world_size=2)
    assert not _checks(traced.gm)  # the dispatch checks the ids itself
    dispatch, = [n for n in traced.gm.graph.nodes if n.target is M.moe_dispatch]
    assert dispatch.args[1].args[0].target is torch.ops.aten.index.Tensor  # the table's rows
    x = torch.randn(ids.numel(), 32)
    index = model.tid2eid[ids.reshape(-1)]
    weights = torch.rand(ids.numel(), TOP_K)
    params = [model.gate_up, model.down]
    rows, routing = M.moe_dispatch(x, index, EXPERTS, "ep")
    got = M.moe_combine(M.moe_experts(rows, routing, traced.gm.moe_experts_0, params, "stacked", "ep"), weights,
                        routing, "ep")
    want = model.experts(x, index, weights)
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(g, w)


def test_dispatch_refuses_ids_below_the_experts():
    x, index = torch.randn(3, 8), torch.tensor([[0, 1], [2, -1], [1, 3]])
    with pytest.raises(AutoparError, match=r"^autopar: MoE dispatch met expert id -1 but the block has 4"):
        M.moe_dispatch(x, index, EXPERTS, "ep")


def test_checked_ids_pass_through_on_the_meta_device():
    ids = torch.empty(3, 2, dtype=torch.long, device="meta")
    assert M.checked_expert_ids(ids, EXPERTS) is ids
