"""The recompute pass (passes/recompute.py) and its runtime (autopar/ops/recompute.py), in one process.

The regions each mode cuts (a decoder layer without its trailing collective; the attention
core through o_proj, the MLP activation through down_proj), the provenance of every node it
inserts, the errors for models it cannot recompute, the plans autopar/support.py refuses,
and one-process training: exact against plain PyTorch, with the working set metered.
Multi-rank equivalence, bytes and memory are tests/dist/test_recompute.py.
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import AutoparError
from autopar.ops import collectives as C
from autopar.ops.recompute import Recompute
from autopar.passes.context import META_KEY
from autopar.plan import Plan
from autopar.runtime import compile_program
from autopar.support import unsupported
from tests.support.harness import OPTIMIZERS, make_batches, reference_train
from tests.support.models import MODELS, make_batch

aten = torch.ops.aten


def _compile(name, plan, world, model=None):
    factory, loss_fn, kwargs = MODELS[name]
    ids, _ = make_batch(128, 4, 16, 0)
    return compile_program(model if model is not None else factory(), (ids,), kwargs, plan, loss_fn,
                           world_size=world)


def _regions(gm) -> dict[str, Recompute]:
    return {name: m for name, m in gm.named_children() if isinstance(m, Recompute)}


def _ops(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def test_full_recompute_cuts_one_region_per_layer_without_its_trailing_collective():
    traced, _ = _compile("example", "tp=2,sp,recompute=full", 2)
    gm = traced.gm
    regions = _regions(gm)
    assert sorted(regions) == ["recompute_model_layers_0", "recompute_model_layers_1"]
    for name, region in regions.items():
        assert (region.kind, region.module) == ("layer", name.replace("recompute_", "").replace("_", "."))
        body = _ops(region.body)
        assert body[aten.linear.default] == 7  # q, k, v, o, gate, up, down
        assert body[C.all_gather] == 2 and body[C.reduce_scatter] == 1  # after o_proj; not after down_proj
    outer = _ops(gm)
    assert outer[aten.linear.default] == 1  # the LM head
    # Outside the bodies: the embedding's and each layer's trailing reduce-scatter, the head's all-gather.
    assert outer[C.reduce_scatter] == 1 + 2 and outer[C.all_gather] == 1
    trailing = [n for n in gm.graph.nodes if n.target is C.reduce_scatter and "down_proj" in n.args[3]]
    assert len(trailing) == 2
    for n in trailing:  # reads the down_proj output the region returns
        assert n.args[0].args[0].op == "call_module" and n.args[0].args[0].target in regions


def test_selective_recompute_cuts_the_attention_core_and_the_mlp_activation():
    traced, _ = _compile("example", "tp=2,recompute=selective", 2)
    regions = _regions(traced.gm)
    assert sorted(regions) == ["recompute_model_layers_0_attn", "recompute_model_layers_0_mlp",
                               "recompute_model_layers_1_attn", "recompute_model_layers_1_mlp"]
    for region in regions.values():
        body = _ops(region.body)
        assert body[aten.linear.default] == 1  # o_proj or down_proj, which reads the recomputed output
        assert not any(t in body for t in (C.all_gather, C.reduce_scatter, C.all_reduce, C.region_entry))
        if region.kind == "attention":
            assert body[aten.scaled_dot_product_attention.default] == 1
            assert region.body.graph.find_nodes(op="placeholder")  # q, k, v and o_proj's weight
        else:
            assert region.kind == "mlp" and body[aten.silu.default] == 1 and body[aten.mul.Tensor] == 1
    outer = _ops(traced.gm)
    assert outer[aten.scaled_dot_product_attention.default] == 0 and outer[aten.silu.default] == 0
    assert outer[aten.linear.default] == 2 * 5 + 1  # q, k, v, gate, up per layer and the head


def test_gpt2_conv1d_layer_regions():
    """Conv1D projections (addmm, the row ones turned into mm + a bias behind the reduction by TP):
    the moved bias add joins the layer's region, the trailing reduce-scatter stays outside."""
    traced, _ = _compile("hf_gpt2", "tp=2,sp,recompute=full", 2)
    found = _regions(traced.gm)
    assert len(found) == 2
    for region in found.values():
        body = _ops(region.body)
        assert body[aten.addmm.default] + body[aten.mm.default] == 4  # c_attn, c_proj, c_fc, c_proj
        assert body[C.all_gather] == 2 and body[C.reduce_scatter] == 1


def test_every_inserted_node_records_provenance():
    traced, _ = _compile("example", "recompute=full", 1)
    gm = traced.gm
    inserted = [n for n in gm.graph.nodes if (n.meta.get(META_KEY) or {}) and n.meta[META_KEY]["pass"] == "recompute_pass"]
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), Recompute)]
    assert calls and set(calls) <= set(inserted)
    for call in calls:
        assert "recompute=full" in call.meta[META_KEY]["reason"] and call.meta[META_KEY]["role"] == "recompute"
        for user in call.users:
            assert user.meta[META_KEY]["pass"] == "recompute_pass" and "val" in user.meta
        for ph in gm.get_submodule(call.target).body.graph.find_nodes(op="placeholder"):
            assert ph.meta[META_KEY]["pass"] == "recompute_pass"
        # the pipeline pass finds the layer of the call
        assert any(path.endswith(f"layers.{calls.index(call)}") for path, _ in call.meta["nn_module_stack"].values())


class _NoLayers(nn.Module):
    """An embedding and an LM head: no decoder layers, no attention or MLP region."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.head = nn.Linear(32, 128, bias=False)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.mark.parametrize("mode,what", [("full", "found no decoder layers"),
                                       ("selective", "found no attention or MLP region")])
def test_a_model_without_recognisable_layers_is_refused(mode, what):
    with pytest.raises(AutoparError, match=rf"^autopar: recompute={mode} {what}"):
        _compile("example", f"recompute={mode}", 1, model=_NoLayers())


def test_mixture_of_experts_layers_are_refused():
    with pytest.raises(AutoparError, match=r"recompute=full on a mixture-of-experts model .*not support"):
        _compile("example_moe", "dp=2,recompute=full", 2)


@pytest.mark.parametrize("plan,moe,what", [
    ("pp=2:zbv,mb=2,recompute=selective", False, "zbv schedule"),
    ("pp=2:dualpipev,mb=4,recompute=full", False, "dualpipev schedule"),
    ("dp=2,ep=2,recompute=full", True, "mixture-of-experts"),
])
def test_support_refuses_what_recompute_cannot_make_exact(plan, moe, what):
    missing = unsupported(Plan.parse(plan), moe=moe)
    assert any(what in m for m in missing), missing


@pytest.mark.parametrize("plan", ["recompute=full", "tp=2,sp,dp=2,zero=3,recompute=full", "cp=2:ulysses,recompute=selective",
                                  "pp=2:interleaved,vpp=2,tp=2,sp,mb=4,recompute=selective"])
def test_support_runs_recompute_with_dp_tp_sp_zero_and_pp(plan):
    assert unsupported(Plan.parse(plan)) == []


def test_one_process_recompute_trains_exactly_and_meters_the_working_set():
    factory, loss_fn, kwargs = MODELS["example"]
    batches = make_batches(128, 4, 16, 2, seed=1)
    ref = reference_train(factory, batches, loss_fn, OPTIMIZERS["sgd"], kwargs)
    activations = {}
    for plan in ("recompute=selective", "recompute=full"):
        pm = autopar.parallelize(factory(), batches[0][0], example_kwargs=kwargs, plan=plan, loss_fn=loss_fn,
                                 optimizer=OPTIMIZERS["sgd"])
        losses = [pm.train_step(inputs, target) for inputs, target in batches]
        assert losses == pytest.approx(ref[0], abs=1e-5), plan
        state = pm.state_dict()
        assert max(float((state[k] - v).abs().max()) for k, v in ref[1].items()) <= 1e-5, plan
        activations[plan] = pm.memory_report()["activations"]
        regions = len(_regions(pm.gm))
        assert pm.step_context.counters["recomputed_regions"] == regions  # each runs again once (mb=1)
        assert pm.eval_step(*batches[0]) == pytest.approx(pm.eval_step(*batches[0]))  # no grad: runs plainly
    assert 0 < activations["recompute=full"] < activations["recompute=selective"]
