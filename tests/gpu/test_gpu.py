"""The GPU tier: autopar's program on one CUDA device, at world 1 on a real NCCL process group.

Skipped as a whole where ``torch.cuda.is_available()`` is False (CI, the CPU development
machines); ``benchmarks/device_check.sh`` runs it on a lent GPU.  Every case trains a tiny
``LlamaForCausalLM`` (tests/support/models.py ``hf_llama``, hidden 128) for 3 AdamW steps with
``mixed_precision="bf16"`` and compares it with the bf16 recipe written out by hand on the same
GPU (:func:`bf16_recipe`: the one of tests/support/precision_jobs.py ``reference_bf16``, given a device
and a model): every loss within ``LOSS_RTOL`` relative and the fp32 masters within
``STATE_ATOL``, the bounds of tests/dist/test_precision.py.  The cases:

1-3. where the model and the example inputs are (the three crashes first seen on an H200): the
     model on the CPU and the example inputs on ``cuda:0``; both on the CPU, then ``train_step``
     given ``cuda:0`` inputs; both on ``cuda:0``.  In each, the program runs on ``pm.device``,
     ``cuda:0``, and ``eval_step`` moves CPU inputs there.
4.   the large-model path: a ``save_pretrained`` directory in at least 3 safetensors files, the
     model rebuilt under ``torch.device("meta")``, ``parallelize(...)`` then
     ``pm.load_pretrained(dir)``: the loaded masters equal ``from_pretrained``'s weights
     exactly, and training follows the recipe on ``from_pretrained``'s model.
5.   ``compile=True`` (Inductor, Triton kernels) against the same eager recipe.

The process group is this test process's own (``init_process_group("nccl")`` on a ``file://``
store, world 1, rank 0), made once for the module and destroyed after it.  Only torch APIs of
2.11 or older are used: the GPU machine has torch 2.11.  Neighbours: tests/dist/test_precision.py
(the same recipe under multi-rank CPU plans), tests/dist/test_pretrained.py (load_pretrained on
gloo), benchmarks/gpu_check.py (speed and memory on the GPU).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autopar
from tests.dist.test_precision import LOSS_RTOL, STATE_ATOL
from tests.support.models import hf_llama, hf_loss
from tests.support.precision_jobs import bf16_recipe as precision_bf16_recipe
from tests.support.reference import OPTIMIZERS, make_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="tests/gpu needs a CUDA GPU (torch.cuda.is_available() is False)")

DEVICE = torch.device("cuda", 0)  # the rank's device under NCCL at world 1
BACKEND = "nccl"
CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
KWARGS = {"use_cache": False}
BATCH, SEQ, STEPS = 4, 32, 3


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A real process group of one rank in this process, for the whole module."""
    if dist.is_initialized():
        pytest.fail("autopar: tests/gpu needs to create its own process group, but one is already initialised")
    store = tmp_path_factory.mktemp("process_group") / "store"
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND, init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _batches():
    return make_batches(CONFIG["vocab_size"], BATCH, SEQ, STEPS, seed=1)


def _on(batch, device):
    (ids,), target = batch
    return (ids.to(device),), target.to(device)


def _model(seed: int = 0):
    return hf_llama(seed, **CONFIG)


def bf16_recipe(model, batches, device) -> dict:
    """tests/support/precision_jobs.py's recipe on ``device`` for a copy of ``model``."""
    return precision_bf16_recipe(copy.deepcopy(model), batches, hf_loss, KWARGS, OPTIMIZERS["adamw"], device=device)


def _parallelize(model, example_inputs, **options):
    return autopar.parallelize(model, example_inputs=example_inputs, example_kwargs=KWARGS, plan="dp=1",
                               loss_fn=hf_loss, optimizer=OPTIMIZERS["adamw"], mixed_precision="bf16", **options)


def _train(pm, batches, device) -> dict:
    """3 steps with inputs on ``device``, then ``eval_step`` given the first batch on the CPU."""
    losses = [pm.train_step(*_on(b, device)) for b in batches]
    evaluated = pm.eval_step(*_on(batches[0], torch.device("cpu")))
    state = {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()}
    return {"losses": losses, "eval": evaluated, "state": state}


def _assert_matches(got: dict, want: dict) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=LOSS_RTOL)
    assert got["eval"] == pytest.approx(want["eval"], rel=LOSS_RTOL)
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        assert got["state"][key].dtype == torch.float32, key
        assert torch.allclose(got["state"][key], value, atol=STATE_ATOL, rtol=0), key


def _assert_on_device(pm) -> None:
    assert pm.device == DEVICE
    assert {p.device for p in pm.gm.parameters()} == {DEVICE}
    assert {str(p.dtype) for p in pm.gm.parameters()} == {"torch.bfloat16"}


# (model's device, example inputs' device, train_step inputs' device): the three H200 crashes
PLACEMENTS = {
    "model_cpu-example_cuda": ("cpu", "cuda", "cuda"),
    "model_cpu-example_cpu-train_cuda": ("cpu", "cpu", "cuda"),
    "model_cuda-example_cuda": ("cuda", "cuda", "cuda"),
}


def _device(kind: str) -> torch.device:
    return DEVICE if kind == "cuda" else torch.device("cpu")


@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_program_runs_on_the_rank_device(process_group, placement):
    model_at, example_at, train_at = (_device(k) for k in PLACEMENTS[placement])
    batches = _batches()
    model = _model()
    want = bf16_recipe(model, batches, DEVICE)
    user = copy.deepcopy(model).to(model_at)
    pm = _parallelize(user, _on(batches[0], example_at)[0])
    _assert_on_device(pm)
    got = _train(pm, batches, train_at)
    _assert_matches(got, want)
    # the user's model is never mutated: still where and what it was
    assert {p.device for p in user.parameters()} == {model_at}
    assert all(p.dtype == torch.float32 for p in user.parameters())


def test_meta_model_loads_a_sharded_checkpoint(process_group, tmp_path):
    from transformers import LlamaForCausalLM

    saved = _model(seed=3)
    saved.save_pretrained(tmp_path, max_shard_size="200KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) >= 3 and (tmp_path / "model.safetensors.index.json").exists(), files

    with torch.device("meta"):
        model = LlamaForCausalLM(copy.deepcopy(saved.config))
    model.train()
    batches = _batches()
    pm = _parallelize(model, _on(batches[0], DEVICE)[0])
    pm.load_pretrained(tmp_path)
    _assert_on_device(pm)
    pretrained = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    pretrained.train()
    loaded = pm.state_dict()
    for key, value in pretrained.state_dict().items():  # the fp32 masters, read exactly
        assert torch.equal(loaded[key].cpu(), value), key
    want = bf16_recipe(pretrained, batches, DEVICE)
    _assert_matches(_train(pm, batches, DEVICE), want)
    assert all(t.is_meta for t in model.state_dict().values())  # the user's meta model stays meta


def test_compiled_program_matches_eager(process_group):
    batches = _batches()
    model = _model()
    want = bf16_recipe(model, batches, DEVICE)
    pm = _parallelize(copy.deepcopy(model), _on(batches[0], DEVICE)[0], compile=True)
    _assert_on_device(pm)
    _assert_matches(_train(pm, batches, DEVICE), want)
