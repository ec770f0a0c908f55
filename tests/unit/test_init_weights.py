"""``init_weights`` on one process: every write ``fn`` makes lands where ``model.apply(fn)`` puts it.

The walk (autopar/runtime/weights/initialize.py) runs ``fn`` on stand-ins; here a stand-in of the
program's tensors (:class:`WholeParams`, each tensor whole, as one rank of a one-rank world holds
it) receives what it writes, and is compared bit for bit with ``model.apply(fn)`` after the same
seed, random stream included: a parent that writes a child's parameter (GPT-2's ``c_proj``), the
tiny GPT-2, Llama and Mixtral, meta-built and real (the user's model left unwritten).  What cannot
be equal on a rank holding shards is refused by name.  The multi-rank equality under tp, pp and
ZeRO-3 is tests/dist/test_pretrained.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.runtime.weights.init_tracker import WriteTracker
from autopar.runtime.weights.initialize import StandIn, Walk, initialize
from tests.support.models import MODELS


class WholeParams:
    """What :func:`initialize` needs of ``RankParameters``, holding every tensor whole."""

    def __init__(self, model: nn.Module):
        first: dict[int, str] = {}
        named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        self.names = {name: first.setdefault(id(t), name) for name, t in named}
        self.values: dict[str, torch.Tensor] = {}

    def graph_name(self, orig: str) -> str | None:
        return self.names.get(orig)

    def holds(self, name: str) -> bool:
        return True

    def local(self, full: torch.Tensor, name: str) -> torch.Tensor:
        return full

    def write_local(self, name: str, local: torch.Tensor) -> None:
        self.values[name] = local.clone()

    def state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return {key: self.values.get(self.names[key], value) for key, value in model.state_dict().items()}


class Parent(nn.Module):
    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))


def child_writer(module: nn.Module) -> None:
    """Like GPT-2's ``_init_weights``: the parent re-initialises its child's weight after the child's call."""
    with torch.no_grad():
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, 0.02)
            module.bias.zero_()
        elif isinstance(module, Parent):
            module.scale.uniform_()
            module.child.weight.normal_(0.0, 5.0)
            module.child.weight[0].zero_()  # after the whole write: fine


def _applied(make, fn, seed: int = 3) -> tuple[dict, torch.Tensor]:
    model = make()
    torch.manual_seed(seed)
    model.apply(fn)
    return model.state_dict(), torch.get_rng_state()


def _initialised(model: nn.Module, fn, seed: int = 3) -> tuple[dict, torch.Tensor]:
    params = WholeParams(model)
    torch.manual_seed(seed)
    initialize(params, model, fn)
    return params.state(model), torch.get_rng_state()


def _assert_same(got: tuple, expected: tuple) -> None:
    assert got[0].keys() == expected[0].keys()
    for key, value in expected[0].items():
        assert torch.equal(got[0][key], value), (key, float((got[0][key] - value).abs().max()))
    assert torch.equal(got[1], expected[1])  # the random stream consumed alike


def test_the_tracker_sees_a_parent_write_its_childs_parameter():
    with torch.device("meta"):
        model = Parent()
    walk = Walk(WholeParams(model), model, None)
    stand_in = StandIn(model, walk, set())
    tracker = WriteTracker(walk.where(model), stand_in.tracked)
    with tracker:
        child_writer(stand_in.root)
    assert sorted(tracker.needed.values()) == ["child.weight"]  # to stand in, and run the call again
    assert stand_in.root.child.weight.is_meta  # the placeholder's write was set aside
    assert [stand_in.tracked.stand_ins[k] for k in tracker.written] == ["scale"]


@pytest.mark.parametrize("meta", [True, False])
def test_a_parent_writing_its_childs_parameter_equals_model_apply(meta):
    expected = _applied(Parent, child_writer)
    with torch.device("meta" if meta else "cpu"):
        model = Parent()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(_initialised(model, child_writer), expected)
    assert all(torch.equal(v, before[k]) if not meta else v.is_meta for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_llama", "hf_mixtral"])
@pytest.mark.parametrize("meta", [True, False])
def test_transformers_init_weights_equals_model_apply(name, meta):
    factory = MODELS[name][0]
    reference = factory(seed=1)
    expected = _applied(lambda: reference, reference._init_weights)
    if meta:
        with torch.device("meta"):
            model = factory()
    else:
        model = factory(seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(_initialised(model, model._init_weights), expected)
    assert all(v.is_meta if meta else torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_reading_a_childs_own_value_equals_model_apply():
    """A real model's child keeps its value (its call leaves it); the parent reads it: a copy stands in."""
    def fn(module):
        if isinstance(module, Parent):
            with torch.no_grad():
                module.scale.copy_(module.child.weight.sum(1) + torch.randn(3))

    def make():
        torch.manual_seed(0)
        return Parent()

    _assert_same(_initialised(make(), fn), _applied(make, fn))


def test_a_value_read_only_to_be_overwritten_whole_is_not_refused():
    """transformers' ``init.orthogonal_`` on bf16 reads the tensor into an fp32 copy that it overwrites whole."""
    def fn(module):
        if isinstance(module, Parent):
            with torch.no_grad():
                wide = module.child.weight.to(torch.float64)
                nn.init.orthogonal_(wide)
                module.child.weight.copy_(wide)

    expected = _applied(Parent, fn)
    with torch.device("meta"):
        model = Parent()
    got = _initialised(model, fn)
    assert torch.equal(got[0]["child.weight"], expected[0]["child.weight"]) and torch.equal(got[1], expected[1])


def _on_parent(action):
    def fn(module):
        if isinstance(module, Parent):
            with torch.no_grad():
                action(module)
    return fn


META_REFUSED = [  # the child's weight has no value on this rank until the parent's call writes it whole
    (lambda m: m.child.weight.mul_(2), r"wrote only part of child\.weight, or changed it in place \(aten\.mul_"),
    (lambda m: m.scale.copy_(m.child.weight.sum(1)), r"wrote scale from child\.weight \(aten\.sum"),
    (lambda m: m.child.weight[0].zero_(), r"wrote only part of child\.weight, or changed it in place \(aten\.zero_"),
    (lambda m: m.scale.fill_(float(m.child.weight.max())), r"read child\.weight into a Python value"),
    (lambda m: m.scale[0].zero_(), r"wrote only part of scale, or changed it in place \(aten\.zero_"),
]


@pytest.mark.parametrize("action,message", META_REFUSED)
def test_a_read_of_a_value_this_rank_does_not_hold_is_refused(action, message):
    with torch.device("meta"):
        model = Parent()
    with pytest.raises(AutoparError, match=r"^autopar: init_weights on the model \(Parent\) " + message):
        initialize(WholeParams(model), model, _on_parent(action))


def test_a_write_the_program_cannot_place_is_refused_before_it_runs():
    model = Parent()  # a real model: nothing of it may be written
    model.cache = torch.zeros(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    refused = [
        (lambda m: m.cache.normal_(), r"wrote cache \(aten\.normal_\.default\), a tensor attribute that is "
                                      r"neither a parameter nor a buffer"),
        (lambda m: model.child.weight.normal_(), r"wrote child\.weight \(aten\.normal_\.default\) through a "
                                                 r"reference to the user's model"),
        (lambda m: setattr(m, "child", nn.Linear(4, 3)),
         r"added, removed or replaced a parameter, buffer or submodule"),
    ]
    for action, message in refused:
        with pytest.raises(AutoparError, match=r"^autopar: init_weights on the model \(Parent\) " + message):
            initialize(WholeParams(model), model, _on_parent(action))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model.cache, torch.zeros(2)) and isinstance(model.child, nn.Linear)
