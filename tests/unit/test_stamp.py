"""Layer stamping (autopar/frontend/stamp.py): the stamped graph is the full export's, or the
model is exported in full with the reason logged.

The expected values come from ``torch.export`` of every layer (``stamp_layers=False``), never
from the stamping code: the two graphs are compared node for node (op, target, dataflow,
parameter and module names), and their losses and gradients must be bitwise equal.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from autopar.frontend.stamp import layer_kinds, plan_stamping
from autopar.frontend.trace import trace_model
from tests.support.models import hf_llama, hf_loss, lm_loss

_LIFTED = re.compile(r"lifted_tensor_\d+")


def canonical(gm: torch.fx.GraphModule) -> list:
    """Every call of the graph with its arguments as positions, parameters by name.

    Export numbers the constants a forward makes (``lifted_tensor_N``) in trace order, so
    those names are compared without the number (their values are compared by the losses)."""
    out, index = [], {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            index[n] = ("attr", _LIFTED.sub("lifted_tensor", str(n.target)))
            continue
        if n.op == "placeholder":
            index[n] = ("input", n.name)
            continue
        index[n] = len(out)
        stack = n.meta.get("nn_module_stack") or {}
        paths = tuple(path for path, _ in stack.values())
        args = pytree.tree_map(lambda v: index[v] if isinstance(v, torch.fx.Node) else v, (n.args, n.kwargs))
        out.append((n.op, str(n.target), args, paths))
    return out


def assert_same_program(model, inputs: tuple, target, kwargs: dict, loss=hf_loss) -> tuple:
    stamped = trace_model(model, inputs, kwargs, loss, target)
    full = trace_model(model, inputs, kwargs, loss, target, stamp_layers=False)
    assert canonical(stamped.gm) == canonical(full.gm)
    params = [p for p in model.parameters()]
    got, want = stamped.gm(*inputs, target), full.gm(*inputs, target)
    assert torch.equal(got, want)
    for g, w in zip(torch.autograd.grad(got, params, allow_unused=True),
                    torch.autograd.grad(want, params, allow_unused=True)):
        assert (g is None and w is None) or torch.equal(g, w)
    return stamped.log


def test_llama_stamped_equals_full_export():
    torch.manual_seed(0)
    model = hf_llama(num_hidden_layers=6)
    ids, target = torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))
    log = assert_same_program(model, (ids,), target, {"use_cache": False})
    assert "trace: exported 3 of 6 layers of model.layers (1 kind), stamped 3" in log[0], log


class _Block(nn.Module):
    def __init__(self, layer_idx: int, width: int, special: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.special = special
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        x = x + torch.tanh(self.proj(x))
        if self.special is not None and self.layer_idx >= self.special:  # reads its position
            x = x * 2
        return x


class _ConstantBlock(_Block):
    def forward(self, x):  # a constant made from the position: the same ops, other values
        return x + torch.tanh(self.proj(x)) * torch.tensor([float(self.layer_idx >= 3)])


class _Net(nn.Module):
    def __init__(self, num_layers: int = 5, block=_Block, collect: bool = False, **kw):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(block(i, 16, **kw) for i in range(num_layers))
        self.head = nn.Linear(16, 32)
        self.collect = collect

    def forward(self, ids):
        h = self.embed(ids)
        outputs = []
        for layer in self.layers:
            h = layer(h)
            outputs.append(h)
        if self.collect:  # every layer's output reaches the head
            h = torch.stack(outputs).sum(0)
        return self.head(h)


def _batch():
    torch.manual_seed(1)
    return torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))


def test_plain_custom_model_is_stamped():
    ids, target = _batch()
    log = assert_same_program(_Net(), (ids,), target, {}, loss=lm_loss)
    assert "exported 3 of 5 layers of layers (1 kind), stamped 2" in log[0]


@pytest.mark.parametrize("model, reason", [
    (_Net(special=3), "layer 3 runs differently from layer 2"),
    (_Net(block=_ConstantBlock), "layer 3 runs differently from layer 2"),
    (_Net(collect=True), "output is used beyond the next layer"),
], ids=["reads-its-position", "constant-from-position", "every-output-used"])
def test_layers_that_differ_are_exported_in_full(model, reason):
    """Condition 2 (behaviour) and 3 (wiring) of the stamping module: refused, so the
    graph is the full export's, and the log says why."""
    ids, target = _batch()
    log = assert_same_program(model, (ids,), target, {}, loss=lm_loss)
    assert "exporting all 5 layers of layers (not stamped:" in log[0] and reason in log[0], log


def test_kinds_ignore_the_position_but_not_other_attributes():
    layers = [_Block(i, 4, special=None if i % 2 else 7) for i in range(6)]
    assert layer_kinds(layers) == (0, 1, 0, 1, 0, 1)
    assert plan_stamping(_Net(num_layers=3)) is None  # nothing left to stamp after 3 traced layers
    plan = plan_stamping(_Net(num_layers=4))
    assert plan is not None and plan.num_traced == 3 and plan.twin(3) == 2
    shared = _Net(num_layers=4)
    shared.layers[3].proj = shared.layers[1].proj  # one parameter, two names: never copied
    assert plan_stamping(shared) is None
    table = torch.ones(4)
    buffered = _Net(num_layers=4)
    for layer in buffered.layers:  # one buffer under four names
        layer.register_buffer("table", table)
    assert plan_stamping(buffered) is None


class _Wrapper(nn.Module):
    """A module a layer holds as a plain attribute, not a child (transformers >= 5.25 gives
    each attention its own wrapper of ``apply_rotary_pos_emb`` in ``_kernel_funcs``)."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale


def _with_wrappers(scales, tensor_in: int | None = None) -> list[_Block]:
    layers = []
    for i, scale in enumerate(scales):
        layer = _Block(i, 4)
        wrapper = _Wrapper(scale)
        if i == tensor_in:
            wrapper.register_buffer("table", torch.zeros(2))
        layer.__dict__["_kernel_funcs"] = {"rotary": wrapper}  # bypasses Module.__setattr__, as kernels does
        layers.append(layer)
    return layers


def test_plain_attribute_modules_are_compared_by_their_contents():
    """One wrapper object per layer, equal in all but identity: one kind.  A wrapper whose
    attributes differ, or that holds a tensor (a constant the graph would bake in), is not."""
    assert layer_kinds(_with_wrappers([1.0] * 4)) == (0, 0, 0, 0)
    assert layer_kinds(_with_wrappers([1.0, 1.0, 2.0, 1.0])) == (0, 0, 1, 0)
    assert layer_kinds(_with_wrappers([1.0] * 4, tensor_in=2)) == (0, 0, 1, 0)


def test_the_users_model_is_not_modified():
    model = _Net()
    ids, target = _batch()
    modules = dict(model._modules)
    layers = list(model.layers)
    trace_model(model, (ids,), {}, lm_loss, target)
    assert dict(model._modules) == modules and list(model.layers) == layers and len(model.layers) == 5
    assert all(not m._forward_pre_hooks for m in model.modules())
