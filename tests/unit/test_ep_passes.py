"""Expert parallelism in one process: MoE recognition, the EP pass, ``autopar inspect``, errors."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ops import collectives as C
from autopar.ops import moe as M
from autopar.frontend.analyze import analyze
from autopar.cli import main
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.runtime import compile_program
from autopar.frontend.trace import trace_model
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build


def _compile(model_name: str, plan: str, world: int, loss_fn=None, **overrides):
    model, default_loss, kwargs = build(model_name, overrides)
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return compile_program(model, inputs, kwargs, plan, loss_fn or default_loss, world_size=world)


def _structure(model_name: str, **overrides):
    model, loss_fn, kwargs = build(model_name, overrides)
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return analyze(trace_model(model, inputs, kwargs, loss_fn).gm), model, inputs, kwargs


@pytest.mark.parametrize("model_name,style,num_params", [("example_moe", "modulelist", 3),
                                                         ("hf_mixtral", "stacked", 2)])
def test_moe_blocks_recognised_in_both_styles(model_name, style, num_params):
    s, model, inputs, kwargs = _structure(model_name)
    assert [b.style for b in s.moe] == [style, style]
    assert all(b.num_experts == 4 and b.top_k == 2 and b.hidden == 64 for b in s.moe)
    # one ModuleList expert = gate, up, down; stacked = gate_up [E, 2f, h] and down [E, h, f]
    assert len(s.moe[0].expert_params[0]) == num_params
    assert len(s.moe[0].expert_params) == (4 if style == "modulelist" else 1)
    # the experts and routers are not mistaken for dense MLP regions, nor for decoder layers
    assert [r.kind for r in s.regions] == ["attention", "attention"] and s.num_layers == 2
    spec = autopar.ModelSpec.from_module(model, inputs, kwargs)
    assert (spec.num_experts, spec.top_k, spec.moe_ffn, spec.gated_mlp) == (4, 2, 64, True)


def test_routing_variants_recognised():
    after, *_ = _structure("example_moe", softmax_before_topk=False)
    plain, *_ = _structure("example_moe", normalize_topk=False)
    assert len(after.moe) == len(plain.moe) == 2


@pytest.mark.parametrize("model_name", ["example_moe", "hf_mixtral"])
def test_ep_pass_replaces_the_routing_glue(model_name):
    traced, ctx = _compile(model_name, "ep=2,dp=2", 2)
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert not {aten.sort.default, aten.histc.default, aten.index_add.default, aten.where.default} & set(targets)
    for op in (M.moe_dispatch, M.moe_experts, M.moe_combine):
        assert targets.count(op) == 2
    for n in traced.gm.graph.nodes:
        if n.target in (M.moe_dispatch, M.moe_combine):
            meta = n.meta["autopar"]
            assert meta["pass"] == "expert_parallel_pass" and meta["axis"] == "ep" and meta["reason"]
            assert set(meta["bytes"]) == {"fwd", "bwd"}
    # layouts: experts split over ep, reduced over edp; the router stays data-parallel
    experts = set(ctx.expert_params)
    assert len(experts) == (24 if model_name == "example_moe" else 4)
    assert all(set(ctx.param_shards[p]) == {"ep"} for p in experts)
    buckets = {b.axis: b for b in ctx.grad_buckets}
    assert set(buckets["edp"].params) == experts and buckets["edp"].divisor == 2
    assert not experts & set(buckets["dp"].params)


def test_inspect_shows_dispatch_and_combine_on_ep(capsys):
    assert main(["inspect", "examples/model.py:build_tiny_moe", "--plan", "ep=2,dp=2,tp=2,sp", "--world", "4"]) == 0
    out = capsys.readouterr().out
    dispatch = [ln for ln in out.splitlines() if "= moe_dispatch(" in ln]
    combine = [ln for ln in out.splitlines() if "= moe_combine(" in ln]
    assert len(dispatch) == len(combine) == 2
    assert all("<<ep>>" in ln and "all_to_all" in ln for ln in dispatch + combine)
    assert "all_to_all on ep (fwd): 6 in total, 3 per decoder layer" in out  # counts, tokens, outputs
    assert "all_to_all on ep (bwd): 4 in total, 2 per decoder layer" in out
    assert "whole on ep rank 1 (empty elsewhere)" in out and "all_reduce over edp" in out
    assert "aten.silu" in out.split("# moe_experts_0[e]")[1]  # the expert's own code is printed


BAD_PLANS = [
    ("example_moe", "ep=3,dp=3", 3, r"^autopar: ep=3 leaves a rank without any of the 4 experts \(2 per rank\)"),
    ("example", "ep=2,dp=2", 2, r"^autopar: ep=2 applies to mixture-of-experts layers"),
    ("example_moe", "ep=2,dp=2,tp=2", 4, r"^autopar: plan 'tp=2,dp=2,ep=2' uses tp=2 without sp.*'tp=2,sp,dp=2,ep=2'"),
]


@pytest.mark.parametrize("model_name,plan,world,message", BAD_PLANS, ids=[b[1] for b in BAD_PLANS])
def test_plans_ep_cannot_run_are_refused(model_name, plan, world, message):
    with pytest.raises(AutoparError, match=message):
        _compile(model_name, plan, world)


def test_ep_must_divide_dp_cp():
    with pytest.raises(AutoparError, match=r"^autopar: ep=4 does not divide dp\*cp=2"):
        Plan.parse("ep=4,dp=2")


def test_load_balancing_loss_statistics_are_all_reduced_over_the_token_axes():
    """The load-balancing loss multiplies two statistics over every token of the batch; on a
    rank holding a share of the tokens each is all-reduced over the axes that split them before
    the product (tests/dist/test_architectures.py proves the training equal), and refused where
    micro-batches split them, which no all-reduce joins."""
    from tests.support.models import aux_loss

    def reduced(plan, world):
        traced, _ = _compile("hf_mixtral", plan, world, loss_fn=aux_loss, output_router_logits=True)
        return sorted((n.args[1], n.args[2]) for n in traced.gm.graph.nodes if n.target is C.token_all_reduce)

    # token fractions and mean probabilities, each averaged over every axis holding other tokens
    assert reduced("ep=2,dp=2", 2) == [("dp", "avg")] * 2
    assert reduced("dp=2,cp=2,ep=2", 4) == [("cp", "avg")] * 2 + [("dp", "avg")] * 2
    assert reduced("tp=1", 1) == []  # one rank holds every token: the loss is the original's
    with pytest.raises(AutoparError, match=r"^autopar: node 'div' .* statistic over the whole batch's tokens"
                                           r".* micro-batches"):
        _compile("hf_mixtral", "dp=2,mb=2", 2, loss_fn=aux_loss, output_router_logits=True)

