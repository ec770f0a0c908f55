"""Invalid plans and inputs give `autopar:` errors that say what was found and what works."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.runtime import compile_program
from tests.support.models import MODELS, HalfGradient, make_batch


def _compile(name, plan, world, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    model = factory(**overrides)
    ids, _ = make_batch(overrides.get("vocab_size", 128), 4, 16, 0)
    return compile_program(model, (ids,), kwargs, plan, loss_fn, world_size=world)


def test_tp_not_dividing_heads():
    with pytest.raises(AutoparError, match=r"^autopar: tp=3 does not divide the 4 attention heads.*one of 1, 2"):
        _compile("example", "tp=3", 3)


def test_tp_not_dividing_kv_heads_with_cp():
    # tp=4 over 2 KV heads replicates them on every tp rank (docs/plan-syntax.md); context
    # parallelism does not run on replicated KV heads.
    with pytest.raises(AutoparError, match=r"^autopar: tp=4 does not divide the 2 KV heads.*KV-head replication.*"
                                           r"use cp=1 with tp=4, or a tp that divides the KV heads \(2\)"):
        _compile("example", "tp=4,cp=2", 8)


def test_tp_not_dividing_kv_heads_with_cp_hf():
    with pytest.raises(AutoparError, match=r"KV-head replication"):
        _compile("hf_llama", "tp=4,cp=2", 8)


def test_vocab_not_divisible_by_tp_is_padded():
    """A vocabulary tp does not divide is padded to ceil(V/tp) rows per rank (no longer refused);
    the user's names and shapes stay unpadded (tests/dist/test_vocab_padding.py trains it)."""
    _, ctx = _compile("example", "tp=4", 4, vocab_size=130, num_kv_heads=4)
    sizes = {name: shards["tp"].size for name, shards in ctx.param_shards.items() if "tp" in shards}
    assert {s for s in sizes.values() if s is not None} == {130}, sizes
    Plan.parse("tp=4").validate(world_size=4, vocab=130)  # the plan's rules admit it too


def test_world_size_mismatch():
    with pytest.raises(AutoparError, match=r"^autopar: .*world.*4.*2"):
        _compile("example", "tp=2", 4)


def test_unknown_option():
    with pytest.raises(AutoparError, match=r"^autopar: unknown plan option 'foo'"):
        Plan.parse("tp=2,foo")


@pytest.mark.parametrize("plan,world,what,overrides", [
    ("pp=2,dp=2,zero=2,mb=2", 4, "zero=2 with pp on a model whose LM head is tied", {"tie_embeddings": True}),
    ("pp=2:zbv,cp=2,zero=3,mb=2", 4, r"zero=3 with the zbv schedule together with tp, cp or ep", {}),
    ("pp=2:zbv,mb=2,recompute=full", 2, "recompute=full with the zbv schedule", {}),
])
def test_dimensions_not_supported_yet(plan, world, what, overrides):
    with pytest.raises(AutoparError, match=rf"^autopar: plan .* uses .*{what}.*not support yet"):
        _compile("example", plan, world, **overrides)


def test_parallelize_needs_a_loss():
    factory, _, kwargs = MODELS["example"]
    ids, _ = make_batch(128, 4, 16, 0)
    with pytest.raises(AutoparError, match="needs loss_fn"):
        autopar.parallelize(factory(), (ids,), example_kwargs=kwargs, plan="none")


def test_auto_plan_on_one_process_is_the_trivial_plan():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, _ = make_batch(128, 4, 16, 0)
    pm = autopar.parallelize(factory(), (ids,), example_kwargs=kwargs, plan="auto", loss_fn=loss_fn)
    assert str(pm.plan) == "none"


def test_batch_not_splitting_into_dp_mb():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, target = make_batch(128, 3, 16, 0)
    pm = autopar.parallelize(factory(), (ids,), example_kwargs=kwargs, plan="mb=2", loss_fn=loss_fn)
    with pytest.raises(AutoparError, match=r"global batch of 3 does not split into dp\*mb = 1\*2"):
        pm.train_step((ids,), target)


def test_single_process_plan_trains():
    """plan 'none' needs no process group and matches plain PyTorch."""
    import torch

    factory, loss_fn, kwargs = MODELS["example"]
    ids, target = make_batch(128, 4, 16, 0)
    pm = autopar.parallelize(factory(), (ids,), example_kwargs=kwargs, plan="none", loss_fn=loss_fn,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    model = factory()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        expected = loss_fn(model(ids), target)
        opt.zero_grad()
        expected.backward()
        opt.step()
        assert abs(pm.train_step((ids,), target) - expected.item()) < 1e-6
    assert pm.comm_stats() == []


def test_unknown_mixed_precision_is_refused_clearly():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, _ = make_batch(128, 2, 8, seed=0)
    with pytest.raises(AutoparError, match=r"^autopar: mixed_precision='fp8' is not a mixed-precision mode; "
                                           r"expected 'bf16'"):
        autopar.parallelize(factory(), example_inputs=(ids,), example_kwargs=kwargs, loss_fn=loss_fn,
                            mixed_precision="fp8")
    with torch.device("meta"):
        meta = factory()
    # A meta-built model is accepted under bf16 (its fp32 masters come from the checkpoint or
    # init_weights), and refused at the first step while it has no values.
    pm = autopar.parallelize(meta, example_inputs=(ids,), example_kwargs=kwargs, loss_fn=loss_fn,
                             mixed_precision="bf16")
    with pytest.raises(AutoparError, match=r"^autopar: the model was built on the meta device .*load_pretrained"):
        pm.train_step((ids,), ids)


class _ThroughModule(torch.autograd.Function):
    """Handed a module whose parameters it reads (as Reformer's reversible layers are)."""

    @staticmethod
    def forward(ctx, x, layer):
        return layer(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReadsWeight(torch.autograd.Function):
    """Reads a tensor it is not handed (a parameter through a closure)."""

    weight = None

    @staticmethod
    def forward(ctx, x):
        return x * _ReadsWeight.weight

    @staticmethod
    def backward(ctx, grad):
        return grad


class _WithFunction(torch.nn.Module):
    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, ids):
        h = self.embed(ids)
        if self.where == "module":
            return self.head(_ThroughModule.apply(h, self.head)[..., :8])
        if self.where == "closure":
            _ReadsWeight.weight = self.scale
            return self.head(_ReadsWeight.apply(h))
        return self.head(HalfGradient.apply(h))


def _ce(logits, target):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def test_a_custom_autograd_function_is_kept_whole_or_refused_at_the_trace():
    """A Function is one node that runs its own apply (tests/dist/test_custom_functions.py trains
    it); one handed a module, or reading a tensor it is not handed, would read the user's
    parameters instead of the rank's: refused naming the Function."""
    ids = torch.randint(0, 16, (2, 4))
    apply = torch.autograd.Function.__dict__["apply"]
    traced, _ = compile_program(_WithFunction("kept"), (ids,), {}, "dp=2", _ce, world_size=2)
    kept = [n for n in traced.gm.graph.nodes if n.op == "call_function" and "autograd_function" in str(n.target)]
    assert len(kept) == 1 and kept[0].meta["autopar_function"].name == "HalfGradient"
    with pytest.raises(AutoparError, match=r"^autopar: _WithFunction applies the custom torch.autograd.Function "
                                           r"'_ThroughModule' \(called at .*test_errors.py:\d+; its backward at .*"
                                           r"handed the module Linear"):
        compile_program(_WithFunction("module"), (ids,), {}, "dp=2", _ce, world_size=2)
    with pytest.raises(AutoparError, match=r"^autopar: the custom torch.autograd.Function '_ReadsWeight' .* reads 1 "
                                           r"tensor\(s\) it is not handed"):
        compile_program(_WithFunction("closure"), (ids,), {}, "dp=2", _ce, world_size=2)
    assert torch.autograd.Function.__dict__["apply"] is apply  # restored after each export
