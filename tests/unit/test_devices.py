"""Device-correct programs (autopar/runtime/devices.py, autopar/frontend/trace.py) on a CPU-only machine.

A program is traced wherever the model is and runs on the rank's device.  Without a GPU the
class of bug is caught with the meta device: a program traced on the CPU is made to run on meta
(``run_device`` patched), so any CPU tensor left in it (a constant the trace captured, an
``arange(device=cpu)`` node, a tensor a pass made) fails the step; and the reverse, a model
built on meta running on the CPU.  Example inputs on another device than the model are traced
as shapes and dtypes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import AutoparError
from autopar.runtime import devices, module as module_mod
from autopar.runtime.weights import parameters as parameters_mod
from tests.support.harness import OPTIMIZERS, assert_equivalent, reference_train
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import make_batches


def _batches(n: int = 3):
    return make_batches(VOCAB, BATCH, SEQ, n, seed=1)


def _parallelize(model, example, **options):
    _, loss_fn, kwargs = build("hf_llama", {})
    return autopar.parallelize(model, example_inputs=example, example_kwargs=kwargs, plan="none",
                               loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], **options)


def _on_meta(monkeypatch):
    monkeypatch.setattr(module_mod, "run_device", lambda traced: torch.device("meta"))


def test_a_program_traced_on_the_cpu_runs_on_another_device(monkeypatch):
    """Every tensor the program makes follows it: a step on meta with CPU inputs runs clean."""
    _on_meta(monkeypatch)
    model, _, _ = build("hf_llama", {})
    pm = _parallelize(model, _batches()[0][0])
    assert pm.device == torch.device("meta")
    assert all(p.is_meta for p in pm.gm.parameters()) and all(b.is_meta for b in pm.gm.buffers())
    creating = [n for n in pm.gm.graph.nodes if isinstance(n.kwargs.get("device"), torch.device)]
    assert creating and all(n.kwargs["device"] == torch.device("meta") for n in creating)
    pm.train_step(*_batches()[0])  # inputs on the CPU, moved to the program's device


def test_a_cpu_tensor_left_in_a_meta_program_fails(monkeypatch):
    """The check above can fail: without retargeting the graph's device arguments, the CPU
    tensors the graph creates meet meta parameters in the first step."""
    _on_meta(monkeypatch)
    monkeypatch.setattr(parameters_mod, "retarget_devices", lambda *args: 0)
    model, _, _ = build("hf_llama", {})
    pm = _parallelize(model, _batches()[0][0])
    with pytest.raises((RuntimeError, NotImplementedError), match="device|meta tensor"):
        pm.train_step(*_batches()[0])


class _WithConstant(nn.Module):
    """A model whose forward creates a tensor from Python data: torch.export lifts it into a constant."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        scale = torch.tensor([0.5] * 16)  # a CPU constant of the traced program
        return self.head(self.embed(ids) * scale)


def test_lifted_constants_move_with_the_program(monkeypatch):
    _on_meta(monkeypatch)
    ids = _batches()[0][0][0]
    pm = autopar.parallelize(_WithConstant(), example_inputs=(ids,), plan="none",
                             loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    constants = [v for m in pm.gm.modules() for k, v in vars(m).items()
                 if isinstance(v, torch.Tensor) and k not in m._parameters and k not in m._buffers]
    assert constants and all(c.is_meta for c in constants)
    pm.train_step((ids,), ids)


def test_a_meta_constant_has_no_values_and_is_refused():
    gm = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())
    gm.lifted = torch.empty(3, device="meta")
    with pytest.raises(AutoparError, match=r"^autopar: constant 'lifted' of the traced program is on the meta device"):
        devices.move_constants(gm, torch.device("cpu"))


@pytest.mark.parametrize("where", ["inputs_on_meta", "model_on_meta"])
def test_model_and_example_inputs_on_different_devices(where):
    """Model on the CPU with example inputs on meta, and the reverse; the program trains like one device."""
    batches = _batches()
    example = (batches[0][0][0].to("meta"),) if where == "inputs_on_meta" else batches[0][0]
    if where == "model_on_meta":
        with torch.device("meta"):
            model, _, _ = build("hf_llama", {})
        seed_model, _, _ = build("hf_llama", {})
        pm = _parallelize(model, example)
        pm.load_state_dict(seed_model.state_dict())  # the values of build's seed
    else:
        model, _, _ = build("hf_llama", {})
        pm = _parallelize(model, example)
    assert pm.device == torch.device("cpu") and all(not p.is_meta for p in pm.gm.parameters())
    losses = [pm.train_step(*b) for b in batches]
    _, loss_fn, kwargs = build("hf_llama", {})
    ref = reference_train(lambda: build("hf_llama", {})[0], batches, loss_fn, OPTIMIZERS["adamw"], kwargs)
    assert_equivalent(ref, (losses, pm.state_dict()))


def test_a_model_on_several_devices_is_refused():
    model, _, _ = build("hf_llama", {})
    model.lm_head.to("meta")
    with pytest.raises(AutoparError, match=r"^autopar: the model's parameters and buffers are on several devices"):
        _parallelize(model, _batches()[0][0])


def test_without_a_process_group_the_program_runs_where_the_model_is():
    from autopar.runtime.devices import run_device

    assert run_device(torch.device("cpu")) == torch.device("cpu")
    assert run_device(torch.device("cuda", 1)) == torch.device("cuda", 1)  # a model the user put on a GPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert run_device(torch.device("meta")).type == expected
