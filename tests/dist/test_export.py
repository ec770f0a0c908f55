"""Full-weights export (autopar/runtime/weights/export.py: ``pm.export_weights``) across processes.

One file (a path ending in ``.safetensors``): train one step under a plan, export, and load the
file into a fresh, unmodified model (other initial weights) with
``load_state_dict(safetensors.torch.load_file(path))``: every entry equals ``pm.state_dict()``;
tied weights (one tensor under two names) are written once per name.

A Hugging Face directory (the default): ``config.json``, shards of at most ``max_shard_size``
and their index, tied weights once (the LM head dropped, as ``save_pretrained`` does); it loads
with ``from_pretrained``.  Models built on the meta device under ``tp=2``, ``dp=2,zero=3``,
``pp=2,mb=2`` (tied head across stages) and ``ep=2,dp=2`` (Mixtral, stacked experts) load a
``save_pretrained`` directory with ``pm.load_pretrained`` and export it at once: every tensor
equals the original bit for bit; after one step the export (at least 3 shards) loads with
``from_pretrained`` equal to ``pm.state_dict()``.  The single-process cases run with plan
``none`` (no process group).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from tests.support.export_jobs import export_job, meta_export_cases_job  # noqa: E402
from tests.support.jobs import build  # noqa: E402

CASES = [("example", "tp=2", {}), ("example_tied", "tp=2", {}), ("hf_llama", "tp=2", {}),
         ("hf_llama", "tp=2", {"tie": True}), ("example", "pp=2,mb=2", {})]


def _check_loads(model_name: str, overrides: dict, loaded: dict, expected: dict, tied_once: bool = False) -> None:
    fresh, _, _ = build(model_name, overrides, seed=5)
    assert any(not torch.equal(v, expected[k]) for k, v in fresh.state_dict().items())
    keys = fresh.state_dict().keys()
    assert loaded.keys() == (_first_names(fresh) if tied_once else keys)
    missing, unexpected = fresh.load_state_dict(loaded, strict=not tied_once)
    assert not unexpected and set(missing) == set(keys) - set(loaded)  # tied_once: the tied names only
    state = fresh.state_dict()
    for k, v in expected.items():
        assert torch.equal(state[k], v), k
        assert state[k].dtype == v.dtype


def _first_names(model) -> set[str]:
    """The state-dict names but the later names of a tied tensor."""
    seen, out = set(), set()
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen or not v.numel():
            out.add(k)
        seen.add(v.data_ptr())
    return out


def _read_directory(path) -> dict[str, torch.Tensor]:
    """Every tensor of an exported directory, checking the index against the shards."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out = {}
    for file in files:
        for k, v in safetensors_torch.load_file(os.path.join(path, file)).items():
            out[k] = v
            if len(files) > 1:
                assert json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"][k] == file
    return out


@pytest.mark.parametrize("model_name,plan,overrides", CASES,
                         ids=[f"{m}{'-tied' if o else ''}-{p}" for m, p, o in CASES])
def test_export_loads_into_the_unmodified_model(dist_pool, tmp_path, model_name, plan, overrides):
    path = str(tmp_path / "weights.safetensors")
    results = dist_pool(export_job, model_name, plan, overrides, path, world=2)
    assert all(r["exists"] and r["path"] == path for r in results)  # done on every rank when it returns
    for r in results[1:]:
        for k, v in r["state"].items():
            assert torch.equal(v, results[0]["state"][k])
    _check_loads(model_name, overrides, safetensors_torch.load_file(path), results[0]["state"])
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_export_into_an_existing_hugging_face_directory(dist_pool, tmp_path):
    transformers = pytest.importorskip("transformers")

    directory = tmp_path / "hf"
    model, _, _ = build("hf_llama", {})
    model.save_pretrained(directory, max_shard_size="20KB")  # an earlier export's shards are replaced
    (directory / "tokenizer.json").write_text("{}")  # and files beside them kept
    results = dist_pool(export_job, "hf_llama", "tp=2", {}, str(directory), world=2)
    assert results[0]["path"] == str(directory)
    assert sorted(os.listdir(directory)) == ["config.json", "generation_config.json", "model.safetensors",
                                             "tokenizer.json"]
    loaded = transformers.LlamaForCausalLM.from_pretrained(directory).state_dict()
    for k, v in results[0]["state"].items():
        assert torch.equal(loaded[k], v), k
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_export_in_one_process(tmp_path):
    results = export_job("example_tied", "none", {}, str(tmp_path / "out") + os.sep, max_shard_size="8KB")
    assert results["path"] == str(tmp_path / "out")
    assert len(os.listdir(results["path"])) >= 4  # >= 3 shards and the index; no config (not transformers)
    _check_loads("example_tied", {}, _read_directory(results["path"]), results["state"], tied_once=True)


META_CASES = [("hf_llama", {"num_hidden_layers": 4}, "tp=2"), ("hf_llama", {"num_hidden_layers": 4}, "dp=2,zero=3"),
              ("hf_llama", {"num_hidden_layers": 4, "tie": True}, "pp=2,mb=2"), ("hf_mixtral", {}, "ep=2,dp=2")]


def test_load_then_export_is_exact_and_trained_exports_load(dist_pool, tmp_path):
    transformers = pytest.importorskip("transformers")

    cases, originals = [], []
    for index, (name, overrides, plan) in enumerate(META_CASES):
        model, _, _ = build(name, overrides, seed=7)
        source = tmp_path / f"source{index}"
        model.save_pretrained(source, max_shard_size="40KB")
        cases.append((name, overrides, plan, str(source), str(tmp_path / f"out{index}")))
        originals.append(model)
    results = dist_pool(meta_export_cases_job, cases, world=2)
    for (name, overrides, plan), original, got in zip(META_CASES, originals, results[0]):
        loaded_path, trained_path = got["paths"]
        exported, state = _read_directory(loaded_path), original.state_dict()
        assert exported.keys() == _first_names(original), plan
        for k, v in exported.items():  # bit for bit, in the original dtype
            assert v.dtype == state[k].dtype and torch.equal(v, state[k]), (plan, k)
        files = os.listdir(trained_path)
        assert len([f for f in files if f.endswith(".safetensors")]) >= 3 and "config.json" in files, plan
        reloaded = getattr(transformers, type(original).__name__).from_pretrained(trained_path).state_dict()
        assert reloaded.keys() == got["state"].keys()
        assert any(not torch.equal(v, state[k]) for k, v in got["state"].items())  # trained
        for k, v in got["state"].items():
            assert torch.equal(reloaded[k], v), (plan, k)
