"""load_pretrained on one process: the slice reader, and checkpoints that do not match the model.

The multi-rank equality with ``from_pretrained`` is tests/dist/test_pretrained.py; here: the
safetensors slice reads against the tensors safetensors itself loads (a fused projection's
several ranges of one dim, a column slice, bf16), and every kind of mismatch refused by name
before anything is written.
"""
from __future__ import annotations

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

import autopar  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.runtime.weights import safetensors_io  # noqa: E402
from autopar.runtime.weights.layout import local_index, shard_local  # noqa: E402
from autopar.passes.context import ParamShard  # noqa: E402
from tests.support.harness import OPTIMIZERS  # noqa: E402
from tests.support.jobs import BATCH, SEQ, VOCAB, build  # noqa: E402
from tests.support.reference import make_batches  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_read_equal_the_slices_cut(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(safetensors_io, "BLOCK_BYTES", 64)  # many small blocks
    full = torch.randn(12, 10).to(dtype)
    path = tmp_path / "t.safetensors"
    safetensors_torch.save_file({"w": full, "s": torch.tensor(3.0)}, str(path))
    reader = safetensors_io.SafetensorsFile(path)
    assert reader.shape("w") == (12, 10) and reader.dtype("w") == dtype
    assert torch.equal(reader.read("s"), torch.tensor(3.0))
    fused = {"tp": ParamShard(dim=0, blocks=(4, 4, 4))}  # q, k, v: each rank its part of every block
    column = {"tp": ParamShard(dim=1)}
    for shards in (fused, column, {**fused, "ep": ParamShard(dim=1)}):
        for rank in range(2):
            coords = {"tp": (rank, 2), "ep": (1 - rank, 2)}
            got = reader.read("w", local_index((12, 10), shards, coords))
            assert torch.equal(got, shard_local(full, shards, coords))


def _meta_llama():
    with torch.device("meta"):
        model, loss_fn, kwargs = build("hf_llama", {})
    batches = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    return pm, batches


def _checkpoint(tmp_path, edit) -> str:
    state = {k: v.clone() for k, v in build("hf_llama", {})[0].state_dict().items()}
    edit(state)
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(state, path)
    return path


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"),
     r"missing 1 tensor\(s\) of the model: model.layers.1.mlp.up_proj.weight"),
    (lambda s: s.update({"model.layers.9.extra.weight": torch.zeros(2)}),
     r"1 tensor\(s\) the model does not have: model.layers.9.extra.weight"),
    (lambda s: s.update({"model.norm.weight": torch.zeros(65)}),
     r"shape differs from the model's: model.norm.weight \(65,\) \(model: \(64,\)\)"),
])
def test_a_checkpoint_that_does_not_match_is_refused_by_name(tmp_path, edit, message):
    pm, batches = _meta_llama()
    path = _checkpoint(tmp_path, edit)
    with pytest.raises(AutoparError, match=r"^autopar: the checkpoint at .* " + message):
        pm.load_pretrained(path)
    assert len(pm.unset_names()) == len(pm.checkpoint_names.shapes)  # nothing was written
    with pytest.raises(AutoparError, match=r"^autopar: the model was built on the meta device"):
        pm.train_step(*batches[0])


def test_nothing_at_the_path_is_refused(tmp_path):
    pm, _ = _meta_llama()
    with pytest.raises(AutoparError, match=r"^autopar: .* holds no model.safetensors and no model.safetensors.index.json"):
        pm.load_pretrained(tmp_path)
    with pytest.raises(AutoparError, match=r"^autopar: load_pretrained found nothing at"):
        pm.load_pretrained(tmp_path / "absent")


def test_tied_weights_load_once_and_untied_names_are_all_needed(tmp_path):
    """A tied head's checkpoint holds the embedding alone (as save_pretrained writes it)."""
    model, loss_fn, kwargs = build("hf_llama", {"tie": True}, seed=3)
    model.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta, _, _ = build("hf_llama", {"tie": True})
    batches = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    pm = autopar.parallelize(meta, example_inputs=batches[0][0], example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    pm.load_pretrained(tmp_path)
    state = pm.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(state[key], value), key
