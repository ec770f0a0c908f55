"""Experts that all run on every token (Llama 4), in one process.

Llama 4's MoE block repeats its tokens once per expert, scales each copy by the router's score for
that expert (zero off the top-k: the sigmoid of a -inf fill), runs one batched matmul over all ``E``
experts and sums the experts' outputs.  Nothing is routed, so nothing is rewritten: the analysis
records the block as dense experts (``analyze_moe.DenseExperts``) instead of failing to find routed
rows, keeps its linears off the TP regions, and without ep the block runs as traced on token shards,
placed op by op.  The op that needs a rule is the repeat of the sharded token dim: the rank's part repeated,
its share of every run of the input's size (``autopar_every``), which only a view back to
``(E, tokens)`` makes an even shard.  Under ep each rank sums its own experts over its ep group's
tokens (passes/dense_expert_parallel.py; tests/unit/test_dense_experts_ep.py).  A capacity routes
no rows here: refused by name.  The multi-rank half (trained against one device under tp=2,sp and
cp=2:ring) is tests/e2e/test_zoo.py, and tests/dist/test_ep.py for dp=2,ep=2.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Shard
from torch.fx import Graph, GraphModule

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.passes.rules import R, RuleContext
from autopar.passes.shard_propagation import propagate
from autopar.runtime import compile_program

transformers = pytest.importorskip("transformers")
from benchmarks.models import hf_loss, hf_model  # noqa: E402

aten = torch.ops.aten


def _llama4(seed: int = 0):
    """A tiny ``transformers.Llama4ForCausalLM``: 4 experts, top-1, a shared expert, 2 layers."""
    return hf_model("Llama4TextConfig", "Llama4ForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
        max_position_embeddings=64, attn_implementation="sdpa"), {})


def _ids():
    torch.manual_seed(1)
    return torch.randint(0, 128, (2, 16))


def _repeated(view_shape):
    """x [t, 4] (t tokens, symbolic, 8 when traced) sharded on its tokens, repeated 3 times along them,
    viewed as ``view_shape`` (-1 for the tokens)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    root, graph = nn.Module(), Graph()
    x = graph.placeholder("x")
    x.meta["val"] = mode.from_tensor(torch.zeros(8, 4), symbolic_context=context)
    rep = graph.call_function(aten.repeat.default, (x, [3, 1]))
    with mode:
        rep.meta["val"] = x.meta["val"].repeat(3, 1)
        view_val = rep.meta["val"].view(view_shape)
    view = graph.call_function(aten.view.default, (rep, list(view_shape)))
    view.meta["val"] = view_val
    graph.output(())
    gm = GraphModule(root, graph)
    placements = propagate(gm, RuleContext(gm, "tp", 2, {}), lambda n: Shard(0) if n is x else R)
    return placements, rep, view


def test_a_repeated_token_shard_viewed_back_per_copy_is_an_even_shard():
    placements, rep, view = _repeated((3, -1, 4))
    assert placements[rep] == Shard(0) and str(rep.meta["autopar_every"]) == str(x_size(rep))
    assert placements[view] == Shard(1)


def x_size(rep):
    """The tokens' symbol: the size of the repeated input's dim 0."""
    return rep.args[0].meta["val"].shape[0]


def test_a_repeated_token_shard_viewed_otherwise_is_refused():
    with pytest.raises(AutoparError) as info:
        _repeated((-1, 2, 4))
    message = str(info.value)
    assert message.startswith("autopar: cannot shard node 'view_default'") and "every" in message, message


def test_llama4_experts_are_dense_and_stay_off_the_tp_regions():
    model = _llama4()
    s = analyze(trace_model(model, (_ids(),), {"use_cache": False}, hf_loss).gm)
    assert s.moe == [] and s.moe_error is None
    assert [d.module for d in s.dense_moe] == [f"model.model.layers.{i}.feed_forward" for i in range(2)]
    assert all(d.num_experts == 4 and d.width == 32 for d in s.dense_moe)
    assert all(r.kind == "attention" for r in s.regions)  # the router and shared expert run on token shards


def test_llama4_under_tp_sp_runs_its_experts_on_sequence_shards():
    traced, _ = compile_program(_llama4(), (_ids(),), {"use_cache": False}, "tp=2,sp", hf_loss, world_size=2)
    repeats = [n for n in traced.gm.graph.nodes if n.target is aten.repeat.default]
    assert len(repeats) == 2 and all(n.meta.get("autopar_every") is not None for n in repeats)


def test_llama4_refuses_a_capacity_by_name():
    with pytest.raises(AutoparError) as info:
        compile_program(_llama4(), (_ids(),), {"use_cache": False}, "dp=2,capacity=1.0", hf_loss, world_size=2)
    message = str(info.value)
    assert message.startswith("autopar: capacity=1.0") and "all run on every token (dense routing" in message, message
    assert "(Llama4TextExperts)" in message and "modeling_llama4.py" in message, message


def test_llama4_under_ep_each_rank_sums_its_experts():
    """dp=2,ep=2: the cut-out experts run per simulated rank on its experts' parameter rows and score
    columns; their sum plus the shared expert is ``Llama4TextMoe``'s output (tests/unit/test_dense_experts_ep.py
    has the hand-written block and the gradients)."""
    model = _llama4()
    traced, _ = compile_program(model, (_ids(),), {"use_cache": False}, "dp=2,ep=2", hf_loss, world_size=2)
    block = model.model.layers[0].feed_forward
    torch.manual_seed(2)
    x = torch.randn(6, 64)
    with torch.no_grad():
        want, _ = block(x)
        scores, _ = block.router(x)
        params = [block.experts.gate_up_proj, block.experts.down_proj]
        got = block.shared_expert(x) + sum(
            traced.gm.dense_experts_0(x, scores[:, 2 * r:2 * r + 2], *(p[2 * r:2 * r + 2] for p in params))
            for r in range(2))
    torch.testing.assert_close(got, want)


def test_llama4_recomputes_its_layers_without_ep_and_refuses_recompute_under_ep():
    """Only ep rewrites dense experts: without it they are any dense layer's work (recompute included);
    with it the experts' collectives are not cut into recomputed regions, refused as for routed experts."""
    compile_program(_llama4(), (_ids(),), {"use_cache": False}, "dp=2,recompute=full", hf_loss, world_size=2)
    with pytest.raises(AutoparError, match=r"^autopar: plan 'dp=2,ep=2,recompute=full' uses recompute=full on a "
                                           "mixture-of-experts model"):
        compile_program(_llama4(), (_ids(),), {"use_cache": False}, "dp=2,ep=2,recompute=full", hf_loss,
                        world_size=2)
