"""Vocabulary padding on gloo ranks: tp that does not divide the vocabulary (issue 28).

Each tp rank holds ceil(V/tp) rows of the embedding and LM head, the last rows zero padding
(``ParamShard.size``; autopar/runtime/weights/layout.py pads when cutting and drops the padding when
gathering, so ``state_dict()`` has the user's shapes); the vocabulary-parallel cross-entropy
leaves the padding columns out of its softmax (passes/op_rules.py sets its ``vocab``), so they
get no gradient and never change.  The tiny models with vocab 131 train 3 AdamW steps under
``tp=4`` and ``tp=2,sp`` (tied heads too; also with ZeRO-3 over dp=2, and a tied head across
two pipeline stages) and equal one process (loss per step and the full state
dict after, fp32, tight tolerance); the last step's collectives equal the cost model's (wire
too), parameters / gradients / AdamW state per rank equal its memory (ceil(V/tp) rows), and a
state dict round-trips.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, assert_memory_report_equals_cost_model, predicted_cost
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, reference, roundtrip_job, train_cases_job
from tests.support.zero_jobs import SEQ

V = 131  # prime: neither tp=2 nor tp=4 divides it
CASES = [("example", "tp=4", {}, 4), ("example", "tp=2,sp", {}, 2), ("example_tied", "tp=4", {}, 4),
         ("hf_llama", "tp=2,sp", {}, 2), ("hf_llama", "tp=2,sp", {"tie": True}, 2),
         ("example", "tp=2,sp,dp=2,zero=3", {}, 4), ("example_tied", "tp=2,pp=2,mb=2", {}, 4)]
IDS = [f"{m}{'-tied' if o else ''}-{p}" for m, p, o, _ in CASES]


def _overrides(model, extra):
    return {"vocab_size": V, **extra}


@pytest.fixture(scope="module")
def trained(dist_pool):
    out = {}
    for world in sorted({w for *_, w in CASES}):
        cases = [(m, p, o) for m, p, o, w in CASES if w == world]
        results = dist_pool(train_cases_job, [(m, p, _overrides(m, o)) for m, p, o in cases], "adamw", world=world)
        out.update({(m, p, tuple(o)): [rank[i] for rank in results] for i, (m, p, o) in enumerate(cases)})
    return out


@pytest.mark.parametrize("model,plan,extra,world", CASES, ids=IDS)
def test_vocab_padding_matches_single_process(trained, model, plan, extra, world):
    ranks = trained[(model, plan, tuple(extra))]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
    ref = reference(model, "adamw", tuple(sorted(_overrides(model, extra).items())))
    state = ranks[0]["state"]
    assert all(v.shape == ref[1][k].shape for k, v in state.items())  # the user's (unpadded) shapes
    assert_equivalent(ref, (ranks[0]["losses"], state))


@pytest.mark.parametrize("model,plan,extra,world", CASES, ids=IDS)
def test_vocab_padding_bytes_equal_cost_model(trained, model, plan, extra, world):
    cost = predicted_cost(model, _overrides(model, extra), plan, world, BATCH)
    assert cost.spec.vocab == V and V % cost.plan.tp
    for rank, r in enumerate(trained[(model, plan, tuple(extra))]):
        pp_rank = rank // (world // cost.plan.pp)  # pp is the outermost mesh axis
        assert_comm_equal(r["comm"], cost.comm_table(pp_rank), rank, wire=True)


def test_vocab_padding_state_dict_roundtrip(dist_pool):
    for problems in dist_pool(roundtrip_job, "example", "tp=4", {"vocab_size": V}, world=4):
        assert problems == []


@pytest.mark.parametrize("model,plan,world", [("example", "tp=4", 4), ("hf_llama", "tp=2,sp", 2)],
                         ids=["example-tp=4", "hf_llama-tp=2,sp"])
def test_vocab_padding_memory_equals_cost_model(dist_pool, model, plan, world):
    """Parameters, gradients and AdamW state per rank (the padded ceil(V/tp) vocabulary rows
    included) equal the cost model's; activations within its 10%."""
    assert_memory_report_equals_cost_model(dist_pool, model, plan, {"vocab_size": V}, world, BATCH, SEQ)


def test_vocab_padding_export_and_load_pretrained(dist_pool, tmp_path):
    """Exported weights and ``load_pretrained`` use the unpadded shapes: ``example`` trained one step
    under ``tp=2`` exports a file that loads into the unmodified model equal to ``state_dict()``;
    a meta-built ``hf_llama`` under ``tp=2`` loads a ``save_pretrained`` directory and exports it
    bit for bit (both vocab 131)."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    pytest.importorskip("transformers")
    import os

    import torch

    from tests.support.export_jobs import export_job, meta_export_cases_job
    from tests.support.jobs import build

    path = str(tmp_path / "weights.safetensors")
    results = dist_pool(export_job, "example", "tp=2", {"vocab_size": V}, path, world=2)
    loaded, state = safetensors_torch.load_file(path), results[0]["state"]
    assert loaded.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k
    fresh, _, _ = build("example", {"vocab_size": V}, seed=5)
    fresh.load_state_dict(loaded)  # the user's shapes

    overrides = {"vocab_size": V}
    original, _, _ = build("hf_llama", overrides, seed=7)
    source = tmp_path / "source"
    original.save_pretrained(source, max_shard_size="40KB")
    results = dist_pool(meta_export_cases_job, [("hf_llama", overrides, "tp=2", str(source), str(tmp_path / "out"))],
                        world=2)
    loaded_path, _ = results[0][0]["paths"]
    exported = {}
    for file in sorted(f for f in os.listdir(loaded_path) if f.endswith(".safetensors")):
        exported.update(safetensors_torch.load_file(os.path.join(loaded_path, file)))
    want = original.state_dict()
    assert exported and all(torch.equal(v, want[k]) for k, v in exported.items())
