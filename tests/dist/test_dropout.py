"""Dropout streams on gloo ranks: the rule of Megatron's RNG tracker, checked on the masks.

The example decoder with dropout on the embedding output and residual branches, on the
attention probabilities and on the MLP's hidden activations trains two steps under a
plan; every dropout of the program records which elements it zeroed (tests/support/dropout_jobs.py).

* Replicated values (the residual stream under tp without SP) get the same mask on every
  tp rank, so the replicas stay identical (the state dicts of all ranks agree).
* Values sharded over tp (MLP hidden features, and every residual-stream dropout under SP,
  which runs on sequence shards) get a different mask on each tp rank.
* Ranks holding different data (dp, cp) draw different masks everywhere.
* Every call draws a fresh mask (the generators advance), and eval_step has no dropout.

A model without dropout compiles to the graph it always had (tests/unit/test_dropout.py),
so the equivalence tests of the other files cover p = 0.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.support.dropout_jobs import DROPOUT, mask_job, seed_job

_NO_ATTN = {**DROPOUT, "attention_dropout": 0.0}  # context parallelism refuses attention dropout


@functools.lru_cache(maxsize=None)
def _run(run, plan: str, world: int, overrides: tuple):
    return run(mask_job, plan, dict(overrides), world=world)


def _masks(run, plan, world, overrides=DROPOUT):
    results = _run(run, plan, world, tuple(sorted(overrides.items())))
    assert results[0]["masks"], "the program has no recorded dropout"
    return results


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


def _fresh_masks(result) -> None:
    """Every call of every dropout zeroes about p of its elements, and no two calls alike."""
    calls = [m for ms in result["masks"].values() for m in ms]
    for m in calls:
        assert 0.2 < m.float().mean().item() < 0.4
    for i, a in enumerate(calls):
        for b in calls[i + 1:]:
            assert a.shape != b.shape or not torch.equal(a, b)


def _replicas_agree(results) -> None:
    for r in results[1:]:
        assert r["state"].keys() == results[0]["state"].keys()
        for k, v in r["state"].items():
            assert torch.equal(v, results[0]["state"][k]), k


def test_tp_replicated_masks_agree_and_sharded_masks_differ(dist_pool):
    r0, r1 = _masks(dist_pool, "tp=2", 2)
    assert (r0["coords"]["tp"], r1["coords"]["tp"]) == (0, 1)
    streams = r0["streams"]
    assert set(streams.values()) == {"replicated", "tp"}
    for name, stream in streams.items():
        same = _same(r0["masks"][name], r1["masks"][name])
        assert same == (stream == "replicated"), (name, stream)
    # attention dropout (inside scaled_dot_product_attention) draws from the tp stream too
    assert r0["generator_streams"] == ["replicated", "tp"]
    for r in (r0, r1):
        _fresh_masks(r)
    _replicas_agree([r0, r1])
    assert r0["losses"] == r1["losses"]


def test_sp_sequence_shards_draw_their_own_masks(dist_pool):
    r0, r1 = _masks(dist_pool, "tp=2,sp", 2)
    assert set(r0["streams"].values()) == {"tp"}  # residual stream on sequence shards, MLP hidden on features
    for name in r0["streams"]:
        assert not _same(r0["masks"][name], r1["masks"][name]), name
    _replicas_agree([r0, r1])


@pytest.mark.parametrize("plan,overrides", [("dp=2", DROPOUT), ("cp=2:ring", _NO_ATTN)], ids=["dp=2", "cp=2"])
def test_data_parallel_ranks_draw_different_masks(dist_pool, plan, overrides):
    r0, r1 = _masks(dist_pool, plan, 2, overrides)
    axis = plan.split("=")[0]
    assert (r0["coords"][axis], r1["coords"][axis]) == (0, 1)
    assert set(r0["streams"].values()) == {"replicated"}
    for name in r0["streams"]:
        assert not _same(r0["masks"][name], r1["masks"][name]), name
    _fresh_masks(r0)
    _replicas_agree([r0, r1])  # gradients are averaged: parameters stay identical


def test_tp_and_dp_together(dist_pool):
    """tp=2 x dp=2: the replicated stream agrees within a tp group only; the tp stream nowhere."""
    results = _masks(dist_pool, "dp=2,tp=2", 4)
    by = {(r["coords"]["dp"], r["coords"]["tp"]): r for r in results}
    assert set(by) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for name, stream in results[0]["streams"].items():
        for dp in (0, 1):
            assert _same(by[dp, 0]["masks"][name], by[dp, 1]["masks"][name]) == (stream == "replicated"), name
        for tp in (0, 1):
            assert not _same(by[0, tp]["masks"][name], by[1, tp]["masks"][name]), name
    _replicas_agree(results)


def test_eval_step_has_no_dropout(dist_pool):
    for r in _masks(dist_pool, "tp=2", 2):
        assert r["eval_losses"][0] == r["eval_losses"][1]
        assert r["eval_masks"].keys() == r["masks"].keys()
        assert not any(m.any() for ms in r["eval_masks"].values() for m in ms)


def test_ranks_agree_on_the_base_seed(dist_pool):
    assert dist_pool(seed_job, world=2) == [100, 100]  # rank 0's torch.initial_seed()
