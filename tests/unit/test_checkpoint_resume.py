"""Resuming from a checkpoint in one process (plan ``none``): everything a run needs is in it.

A run saved after 2 steps and resumed into a program of other weights continues exactly like
the uninterrupted run: the same losses under dropout (its RNG streams are in the checkpoint),
the same samples (the sampler's position), the same learning rate (the schedule) and step
count; a background save (``blocking=False``) gives the same.  Retention (``keep``) and
``latest_checkpoint``; a save that fails in the background leaves the previous checkpoint and
raises at ``wait_checkpoint``.  Across plans and world sizes: tests/dist/test_checkpoint_async.py;
under torchrun with killed ranks: tests/e2e/test_fault_tolerance.py.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import autopar
from autopar.runtime.weights.checkpoint_files import list_checkpoints
from tests.support.dropout_jobs import DROPOUT
from tests.support.reference import LOSS_ATOL
from tests.support.resume_jobs import read_checkpoint, resume_job


@pytest.mark.parametrize("blocking", [True, False])
def test_a_resumed_run_continues_the_uninterrupted_one(tmp_path, blocking):
    r = resume_job("none", "none", str(tmp_path / "ckpt"), DROPOUT, before=2, after=3, blocking=blocking)
    ref = r["uninterrupted"]
    assert r["steps_loaded"] == 2 and r["steps"] == 5
    assert r["seen"] == ref["seen"]  # the samples the uninterrupted run saw, in its order
    assert len({i for batch in ref["seen"] for i in batch}) == 5 * 4  # no sample twice: positions advance
    # Same plan, same process: the same arithmetic, dropout masks included.
    assert all(abs(a - b) <= LOSS_ATOL for a, b in zip(r["losses"], ref["losses"])), (r["losses"], ref["losses"])
    assert r["losses"][2:] == ref["losses"][2:]
    assert r["lr"] == ref["lr"] and r["lr"] != 1e-3  # the schedule moved the rate, and it was restored


def test_a_resume_without_the_rng_state_differs(tmp_path, monkeypatch):
    """The check above can fail: with dropout's streams not restored, the losses after the resume differ."""
    from autopar.ops import rng

    monkeypatch.setattr(rng, "restore_streams", lambda step, seed, states, device: None)
    r = resume_job("none", "none", str(tmp_path / "ckpt"), DROPOUT, before=2, after=2)
    assert r["losses"][:2] == r["uninterrupted"]["losses"][:2]
    assert r["losses"][2:] != r["uninterrupted"]["losses"][2:]


def _program():
    from tests.support.resume_jobs import _program as program

    return program("none", {}, seed=0)[0]


def test_retention_keeps_the_newest_and_removes_only_after_a_newer_is_complete(tmp_path, monkeypatch):
    pm = _program()
    (inputs, target), = [((torch.randint(0, 128, (4, 16)),), torch.randint(0, 128, (4, 16)))]
    states = []
    for n in range(3):
        pm.train_step(inputs, target)
        pm.save(tmp_path / f"step-{n + 1}", blocking=False, keep=2)  # each stages into the last one's buffers
        states.append(pm.state_dict())
    pm.wait_checkpoint()
    assert [os.path.basename(c.path) for c in list_checkpoints(tmp_path)] == ["step-2", "step-3"]
    for n in (2, 3):  # each holds its own step's weights, though they were staged in the same memory
        saved = read_checkpoint(str(tmp_path / f"step-{n}"))
        assert all(torch.equal(saved["model." + k], v) for k, v in states[n - 1].items())
    assert not torch.equal(states[1]["embed_tokens.weight"], states[2]["embed_tokens.weight"])
    assert sorted(p.name for p in tmp_path.iterdir() if ".data-" in p.name and p.name.startswith("step-1")) == []
    assert autopar.latest_checkpoint(tmp_path) == str(tmp_path / "step-3")
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    # A save that fails while writing: the checkpoints stay as they were, and wait_checkpoint says so.
    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(dcp_fs.FileSystemWriter, "write_data", broken)
    pm.train_step(inputs, target)
    pm.save(tmp_path / "step-4", blocking=False, keep=1)
    with pytest.raises(autopar.AutoparError, match=r"^autopar: checkpoint .*step-4 was not written \(.*disk full"):
        pm.wait_checkpoint()
    assert [os.path.basename(c.path) for c in list_checkpoints(tmp_path)] == ["step-2", "step-3"]
    monkeypatch.undo()
    pm.save(tmp_path / "step-4", keep=1)  # the leftover of the failed save does not stand in the way
    assert [os.path.basename(c.path) for c in list_checkpoints(tmp_path)] == ["step-4"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert read_checkpoint(str(tmp_path / "step-4"))["train.step"].item() == 4


def test_overlap_steps_makes_the_save_durable_before_that_steps_update(tmp_path, monkeypatch):
    """``overlap_steps=1``: the next step's update waits for the write (the steps a failure loses are
    bounded as with blocking saves); without it, training runs ahead of a slow write."""
    pm = _program()
    inputs, target = (torch.randint(0, 128, (4, 16)),), torch.randint(0, 128, (4, 16))
    finish = dcp_fs.FileSystemWriter.finish

    def slow_finish(self, metadata, results):
        time.sleep(1.0)
        return finish(self, metadata, results)

    monkeypatch.setattr(dcp_fs.FileSystemWriter, "finish", slow_finish)
    for overlap, durable in ((1, True), (None, False)):
        path = tmp_path / f"overlap-{overlap}"
        pm.save(path, blocking=False, overlap_steps=overlap)
        pm.train_step(inputs, target)
        assert (autopar.latest_checkpoint(tmp_path) == str(path)) == durable
        pm.wait_checkpoint()
        assert autopar.latest_checkpoint(tmp_path) == str(path)


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    pm = _program()
    order = []
    finish = dcp_fs.FileSystemWriter.finish

    def slow_finish(self, metadata, results):
        name = os.path.basename(str(self.path))
        if name.startswith("a."):
            time.sleep(0.5)  # without the wait, b would finish first
        order.append(("finish", name))
        return finish(self, metadata, results)

    monkeypatch.setattr(dcp_fs.FileSystemWriter, "finish", slow_finish)
    pm.save(tmp_path / "a", blocking=False)
    pm.num_steps_taken = 7  # stands for training between the saves
    pm.save(tmp_path / "b", blocking=False)
    pm.wait_checkpoint()
    assert [name.split(".data-")[0] for _, name in order] == ["a", "b"]
    assert read_checkpoint(str(tmp_path / "a"))["train.step"].item() == 0
    assert read_checkpoint(str(tmp_path / "b"))["train.step"].item() == 7
