"""Each private PyTorch API of autopar/compat.py, exercised so a torch upgrade that changes one fails here.

The mesh flattening and the recording stage need a process group: they are in
tests/dist/test_compat_pg.py.
"""
from __future__ import annotations

import sympy
import torch
from torch.export import Dim

from autopar import compat
from autopar.ops.schedules import rank_orders


def _exported():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.view(x.shape[0], -1).sum(dim=1)

    x = torch.randn(4, 3, 2)
    return torch.export.export(M(), (x,), dynamic_shapes=({0: Dim("batch", min=2)},), strict=False)


def test_sym_expr_and_hint_read_symbolic_sizes():
    ep = _exported()
    placeholder = next(n for n in ep.graph.nodes if n.op == "placeholder")
    size = placeholder.meta["val"].shape[0]
    assert isinstance(compat.sym_expr(size), sympy.Symbol)
    assert compat.sym_hint(size) == 4
    assert compat.sym_expr(3) is None and compat.sym_hint(3) == 3


def test_guards_and_metadata_asserts_are_recognised():
    gm = _exported().module()
    guards = [n for n in gm.graph.nodes if compat.is_guards_call(n)]
    assert guards, "torch.export no longer adds a _guards_fn call; passes/cleanup.py can drop its handling"
    assert all(isinstance(op, torch._ops.OpOverload) for op in compat.ASSERT_METADATA_OPS)


def test_rename_node_keeps_names_unique():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU()))
    first, second = [n for n in gm.graph.nodes if n.op == "call_module"]
    compat.rename_node(first, "activation")
    compat.rename_node(second, "activation")
    assert first.name == "activation" and second.name != "activation"
    gm.graph.lint()


def test_tensor_base_finds_the_viewed_tensor():
    t = torch.zeros(6)
    assert compat.tensor_base(t[2:]) is t and compat.tensor_base(t) is t


def test_set_buffer_keeps_persistence():
    m = torch.nn.Module()
    m.register_buffer("b", torch.zeros(2), persistent=False)
    compat.set_buffer(m, "b", torch.ones(2))
    assert torch.equal(m.b, torch.ones(2)) and "b" not in m.state_dict()


def test_pipeline_order_of_a_multi_stage_schedule():
    orders = rank_orders("interleaved", pp=2, num_microbatches=4, vpp=2)
    assert len(orders) == 2
    for rank, order in enumerate(orders):
        acts = [a for slot in order for a in slot]
        assert {a.kind for a in acts} == {"F", "B"}
        assert sorted({a.stage_index for a in acts}) == [rank, rank + 2]  # looped placement
        assert len(acts) == 2 * 2 * 4  # a forward and a backward per chunk and micro-batch
    assert {a.kind for order in rank_orders("zbv", 2, 4) for slot in order for a in slot} == {"F", "B", "W"}
    assert set(compat.compute_kinds().values()) == {"F", "B", "W"}


def test_top_saved_tensors_hooks_is_the_innermost_pair():
    assert compat.top_saved_tensors_hooks() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            assert compat.top_saved_tensors_hooks() == (pack, unpack)



def test_retained_compiled_backward_turns_buffer_donation_off():
    """The switch torch's split pipeline backward needs on compiled chunks (a retained backward,
    then another): exercised end to end under zbv / dualpipev in tests/dist/test_compile.py."""
    import torch._functorch.config as functorch_config

    before = functorch_config.donated_buffer
    with compat.retained_compiled_backward():
        assert functorch_config.donated_buffer is False
    assert functorch_config.donated_buffer == before


def test_set_default_group_timeout_is_what_new_groups_get():
    import datetime

    from torch.distributed import distributed_c10d as c10d

    saved = c10d.default_pg_timeout, c10d.default_pg_nccl_timeout
    try:
        compat.set_default_group_timeout(datetime.timedelta(seconds=7))
        assert c10d._get_default_timeout(c10d.Backend("gloo")) == datetime.timedelta(seconds=7)
        assert c10d.default_pg_nccl_timeout == datetime.timedelta(seconds=7)
    finally:
        c10d.default_pg_timeout, c10d.default_pg_nccl_timeout = saved
