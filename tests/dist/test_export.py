"""Full-weights export (autopar/runtime/checkpoint.py: export_safetensors) across processes.

Train one step under a plan, export, and load the file into a fresh, unmodified model
(other initial weights) with ``load_state_dict(safetensors.torch.load_file(path))``: every
entry equals ``pm.state_dict()``.  Tied weights (one tensor under two names) are written
once per name.  A Hugging Face directory (``config.json`` + ``model.safetensors``) loads
with ``from_pretrained``.  The last case is one process with plan ``none`` (no process
group).
"""
from __future__ import annotations

import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.export_jobs import export_job  # noqa: E402
from tests.jobs import build  # noqa: E402

CASES = [("example", "tp=2", {}), ("example_tied", "tp=2", {}), ("hf_llama", "tp=2", {}),
         ("hf_llama", "tp=2", {"tie": True}), ("example", "pp=2,mb=2", {})]


def _check_loads(model_name: str, overrides: dict, path: str, expected: dict) -> None:
    fresh, _, _ = build(model_name, overrides, seed=5)
    assert any(not torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    loaded = safetensors_torch.load_file(path)
    assert loaded.keys() == fresh.state_dict().keys()
    fresh.load_state_dict(loaded)  # strict: every key of the unmodified model, nothing else
    state = fresh.state_dict()
    for k, v in expected.items():
        assert torch.equal(state[k], v), k
        assert state[k].dtype == v.dtype


@pytest.mark.parametrize("model_name,plan,overrides", CASES,
                         ids=[f"{m}{'-tied' if o else ''}-{p}" for m, p, o in CASES])
def test_export_loads_into_the_unmodified_model(dist_pool, tmp_path, model_name, plan, overrides):
    path = str(tmp_path / "weights.safetensors")
    results = dist_pool(export_job, model_name, plan, overrides, path, world=2)
    assert all(r["exists"] and r["path"] == path for r in results)  # done on every rank when it returns
    for r in results[1:]:
        for k, v in r["state"].items():
            assert torch.equal(v, results[0]["state"][k])
    _check_loads(model_name, overrides, path, results[0]["state"])
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_export_to_a_hugging_face_directory(dist_pool, tmp_path):
    pytest.importorskip("transformers")
    import transformers

    directory = tmp_path / "hf"
    model, _, _ = build("hf_llama", {})
    model.config.save_pretrained(directory)
    results = dist_pool(export_job, "hf_llama", "tp=2", {}, str(directory), world=2)
    assert results[0]["path"] == str(directory / "model.safetensors")
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory)
    state = loaded.state_dict()
    for k, v in results[0]["state"].items():
        assert torch.equal(state[k], v), k


def test_export_in_one_process(tmp_path):
    results = export_job("example_tied", "none", {}, str(tmp_path / "out") + os.sep)
    assert results["path"] == str(tmp_path / "out" / "model.safetensors")
    _check_loads("example_tied", {}, results["path"], results["state"])
