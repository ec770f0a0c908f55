"""Bad checkpoints are refused by name, and nothing is loaded (autopar/runtime/weights/checkpoint_files.py).

Each case damages a good checkpoint the way a failure would (a shard file cut short or gone, the
index gone or damaged, a half-written directory, a link whose data retention removed, a checkpoint
of another model, one without the data position asked for) and loads it into a program that has
trained: the error starts with ``autopar:``, names the file, and the program's weights, optimizer
state and step count are what they were.  The same refusal on every rank of a gloo group is
tests/dist/test_checkpoint_async.py.
"""
from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

import autopar
from tests.support.jobs import BATCH, SEQ, VOCAB
from tests.support.reference import make_batches
from tests.support.resume_jobs import _program


def _truncate(path: str) -> str:
    shard = sorted(glob.glob(os.path.join(os.path.realpath(path), "*.distcp")))[0]
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 3)
    return rf"has a truncated shard file {shard}: \d+ bytes, its index needs \d+"


def _remove_shard(path: str) -> str:
    shard = sorted(glob.glob(os.path.join(os.path.realpath(path), "*.distcp")))[0]
    os.remove(shard)
    return f"is missing its shard file {shard};"


def _remove_index(path: str) -> str:
    index = os.path.join(os.path.realpath(path), ".metadata")
    os.remove(index)
    return f"has no index file {index} \\(half-written, or not a checkpoint\\)"


def _damage_index(path: str) -> str:
    index = os.path.join(os.path.realpath(path), ".metadata")
    with open(index, "r+b") as f:
        f.truncate(10)
    return f"the index file {index} of checkpoint {path} does not read"


def _remove_data(path: str) -> str:
    data = os.path.realpath(path)
    shutil.rmtree(data)
    return f"checkpoint {path} points to {data}, which is missing"


def _half_written(path: str) -> str:
    """A save killed while writing leaves ``<path>.data-<token>.tmp``; here the caller loads that."""
    tmp = os.path.realpath(path) + ".tmp"
    shutil.copytree(os.path.realpath(path), tmp)
    os.remove(os.path.join(tmp, ".metadata"))  # DCP writes the index last
    return "is a half-written checkpoint directory"


DAMAGES = {"truncated": _truncate, "missing_shard": _remove_shard, "no_index": _remove_index,
           "damaged_index": _damage_index, "removed_data": _remove_data, "half_written": _half_written}


def _trained_pair(tmp_path):
    """A checkpoint after one step, and another program that has trained two steps of its own."""
    batches = make_batches(VOCAB, BATCH, SEQ, 2, seed=1)
    saver = _program("none", {}, seed=0)[0]
    saver.train_step(*batches[0])
    path = str(tmp_path / "ckpt")
    saver.save(path)
    pm = _program("none", {}, seed=3)[0]
    for b in batches:
        pm.train_step(*b)
    return path, pm


def _snapshot(pm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pm.checkpoint_state().items()}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_refused_by_name(tmp_path, damage):
    path, pm = _trained_pair(tmp_path)
    message = DAMAGES[damage](path)
    target = path if damage != "half_written" else os.path.realpath(path) + ".tmp"
    before = _snapshot(pm)
    with pytest.raises(autopar.AutoparError, match=rf"^autopar: .*{message}"):
        pm.load(target)
    after = _snapshot(pm)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert pm.num_steps_taken == 2
    if damage in ("truncated", "missing_shard", "no_index", "damaged_index", "removed_data"):
        with pytest.raises(autopar.AutoparError, match=rf"^autopar: .*{message}"):
            autopar.load_model_state_dict(path)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path, pm = _trained_pair(tmp_path)
    from tests.support.resume_jobs import _program as program

    wider = program("none", {"hidden_size": 32, "intermediate_size": 64}, seed=0)[0]
    other = str(tmp_path / "other")
    wider.save(other)
    before = _snapshot(pm)
    with pytest.raises(autopar.AutoparError, match=rf"^autopar: checkpoint {other} is not of this model: \d+ tensors "
                                                   r"of other shapes \(embed_tokens.weight: \(128, 32\) in the "
                                                   r"checkpoint, \(128, 64\) in the model"):
        pm.load(other)
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(pm).items())


def test_a_directory_of_checkpoints_and_a_missing_data_position(tmp_path):
    path, pm = _trained_pair(tmp_path)
    with pytest.raises(autopar.AutoparError, match=rf"^autopar: {tmp_path} is a directory of checkpoints, not one; "
                                                   rf"expected a checkpoint path; pass autopar.latest_checkpoint"):
        pm.load(tmp_path)
    sampler = autopar.DistributedBatchSampler(16, BATCH, pm)
    with pytest.raises(autopar.AutoparError, match=rf"^autopar: checkpoint {path} holds no data position"):
        pm.load(path, data=sampler)
    with pytest.raises(autopar.AutoparError, match=r"^autopar: no checkpoint at .*nowhere"):
        pm.load(tmp_path / "nowhere")
    assert autopar.latest_checkpoint(tmp_path / "nowhere") is None
    assert autopar.latest_checkpoint(tmp_path) == path
