"""ZeRO-1/2 overlapped as Megatron's distributed optimizer: the order of events on gloo ranks, and
equality with one device.

Each case trains 3 AdamW steps with small buckets (several ZeRO units) and records the strategy's
events (``DistributedOptimizer.events``, autopar/runtime/gradients/zero_optimizer.py) beside the job's own marks
(tests/support/zero_jobs.py ``zero_overlap_job``): when a call first reads a decoder layer's
parameters and when backward reaches a layer's gradients.  Checked on the steps after the first:

* the last micro-batch's backward starts reduce-scatters before it ends -- some before backward
  reaches the first layer's gradients (ZeRO-1 and ZeRO-2; ZeRO-2 in every micro-batch; flat
  plans: under pp they start after a chunk's last backward action, runtime/gradients/zero.py);
* the previous step's all-gathers are all in flight when the next forward begins, each is waited
  for in that forward, some after the forward has begun computing (not all at its start), and
  every unit of layer ``k`` before layer ``k + 1`` is first read;
* after a step the gathers are in flight; ``state_dict()`` (a reader outside the forward) waits
  for all of them;
* losses and the final state equal single-device training (fp32), or the single-device bf16
  recipe (mixed precision), including a pipelined ZeRO-1 plan.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.support.jobs import build
from tests.support.precision_jobs import reference_bf16
from tests.support.zero_jobs import SEQ, VOCAB, zero_overlap_job

BUCKET_BYTES = 20_000  # the example decoder in 12-15 units per rank
# (plan, world, global batch, mixed precision)
CASES = [("dp=2,zero=1", 2, 4, False), ("dp=2,zero=2,mb=2", 2, 4, False), ("dp=2,zero=1", 2, 4, True),
         ("dp=2,zero=1,mb=2", 2, 4, True),  # bf16 micro-batches folded into fp32 before the last one's hooks
         ("pp=2,dp=2,zero=1,mb=2", 4, 4, False), ("pp=2,dp=2,zero=1,mb=2", 4, 4, True),
         ("pp=2,dp=2,zero=2,mb=2", 4, 4, False)]
IDS = [f"{p}{':bf16' if m else ''}" for p, _, _, m in CASES]


@functools.lru_cache(maxsize=None)
def _reference(batch: int):
    _, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, batch, SEQ, 3, seed=1)
    return reference_train(lambda: build("example", {})[0], batches, loss_fn, OPTIMIZERS["adamw"], kwargs)


@pytest.fixture(scope="module")
def runs(dist_pool):
    """Each case's per-rank results, run once for the module's tests."""
    cache: dict = {}

    def get(plan, world, batch, mixed):
        key = (plan, world, batch, mixed)
        if key not in cache:
            cache[key] = dist_pool(zero_overlap_job, "example", plan, batch, BUCKET_BYTES, mixed, world=world)
        return cache[key]
    return get


def _steps(events: list) -> list[list]:
    """The events of each step (from its ``("step", i)`` mark to the next)."""
    marks = [i for i, e in enumerate(events) if e[0] == "step"] + [len(events)]
    return [events[a + 1:b] for a, b in zip(marks, marks[1:])]


def _at(events: list, event) -> int:
    return events.index(event)


@pytest.mark.parametrize("plan,world,batch,mixed", CASES, ids=IDS)
def test_overlapped_zero_matches_one_device(runs, plan, world, batch, mixed):
    results = runs(plan, world, batch, mixed)
    for r in results:
        assert r["losses"] == results[0]["losses"]
    if not mixed:
        assert_equivalent(_reference(batch), (results[0]["losses"], results[0]["state"]))
        return
    ref = reference_bf16("example", "adamw", {}, batch)
    assert results[0]["losses"] == pytest.approx(ref["losses"], rel=2e-3)
    for key, value in ref["state"].items():
        assert torch.allclose(results[0]["state"][key], value, atol=1e-2, rtol=0), key


@pytest.mark.parametrize("plan,world,batch,mixed", CASES, ids=IDS)
def test_after_step_gathers_are_waited_at_first_use(runs, plan, world, batch, mixed):
    for r in runs(plan, world, batch, mixed):
        units = len(r["unit_layers"])
        assert units > 3 and r["in_flight_after_step"] == units and r["in_flight_after_state_dict"] == 0
        for step in _steps(r["events"])[1:]:
            assert step[0] == ("forward_begin", units)  # every unit's gather still in flight
            first_grad = next(i for i, e in enumerate(step) if e[0] in ("grad", "backward_end", "reduce_scatter"))
            waits = {e[1]: i for i, e in enumerate(step[:first_grad]) if e[0] == "all_gather_wait"}
            assert sorted(waits) == list(range(units)), "each unit waited for once, in the forward"
            reads = {e[1]: i for i, e in enumerate(step) if e[0] == "reads_layer"}
            assert any(i > min(reads.values()) for i in waits.values()), "waits spread over the forward"
            for unit, layers in enumerate(r["unit_layers"]):
                for k in layers:
                    if k >= 0 and k + 1 in reads:
                        assert waits[unit] < reads[k + 1], (unit, k)


@pytest.mark.parametrize("plan,world,batch,mixed", [c for c in CASES if "pp" not in c[0]],
                         ids=[i for c, i in zip(CASES, IDS) if "pp" not in c[0]])
def test_reduce_scatters_start_in_backward(runs, plan, world, batch, mixed):
    mb = int(plan.split("mb=")[1]) if "mb=" in plan else 1
    for r in runs(plan, world, batch, mixed):
        units = len(r["unit_layers"])
        assert r["early"] == list(range(units))  # no gradient summed over another axis first
        for step in _steps(r["events"]):
            ends = [i for i, e in enumerate(step) if e == ("backward_end", None)]
            assert len(ends) == mb
            # ZeRO-2: every micro-batch's backward; ZeRO-1: the last one's only.
            starts = [0] + [i + 1 for i in ends[:-1]]
            for n, (a, b) in enumerate(zip(starts, ends)):
                part = step[a:b]
                scattered = sorted(e[1] for e in part if e[0] == "reduce_scatter")
                if "zero=1" in plan and n < mb - 1:
                    assert scattered == []
                    continue
                assert scattered == list(range(units))
                # Started while backward still had the first layer's gradients to compute.
                assert any(e[0] == "reduce_scatter" for e in part[:_at(part, ("grad", 0))])
