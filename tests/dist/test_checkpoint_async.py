"""Checkpoints on gloo ranks: background saves, resuming on another dp size, damaged files.

* A save with ``blocking=False`` under ZeRO-1 (whose reads are collectives, staged in the
  training thread) equals a blocking save of the same state bit for bit, although two more steps
  changed every tensor while it was written.
* Saved under ``tp=2,dp=2,zero=1`` with the sampler's position and resumed under ``dp=4`` in a
  program of other weights: the samples after the resume are the uninterrupted run's, and the
  losses equal it within the equivalence bounds (another plan: the same arithmetic up to
  reduction order).
* A shard file cut short is refused on every rank alike, before anything is loaded: no rank
  waits in a collective the others never reach.
"""
from __future__ import annotations

from tests.support.reference import LOSS_ATOL
from tests.support.resume_jobs import async_job, damaged_job, resume_job


def test_background_save_equals_the_blocking_one(dist_pool, tmp_path):
    results = dist_pool(async_job, "dp=2,zero=1", str(tmp_path), world=2)
    for r in results:
        assert r["moved"], "the steps during the write changed the weights"
        assert r["entries"] > 20 and r["differ"] == [], r["differ"]
        assert r["latest"] == str(tmp_path / "background")


def test_resume_on_another_dp_size_sees_the_same_samples(dist_pool, tmp_path):
    results = dist_pool(resume_job, "tp=2,dp=2,zero=1", "dp=4", str(tmp_path / "ckpt"), {}, 2, 2, False, world=4)
    for r in results:
        ref = r["uninterrupted"]
        assert r["steps_loaded"] == 2 and r["steps"] == 4
        assert r["seen"] == ref["seen"] and len(r["seen"][3]) == 4
        assert all(abs(a - b) <= LOSS_ATOL for a, b in zip(r["losses"], ref["losses"])), (r["losses"], ref["losses"])
        assert r["lr"] == ref["lr"]


def test_a_damaged_shard_is_refused_on_every_rank(dist_pool, tmp_path):
    results = dist_pool(damaged_job, "dp=2", str(tmp_path / "ckpt"), world=2)
    shard = results[0]["shard"]
    for r in results:
        assert r["error"] is not None and r["error"].startswith(f"autopar: checkpoint {tmp_path / 'ckpt'} has a "
                                                                f"truncated shard file {shard}"), r["error"]
        assert r["unchanged"] and r["steps"] == 2
