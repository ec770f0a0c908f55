"""The cost model's peak memory against the CPU allocator's peak (issue 29).

``Cost.memory_per_gpu`` is the step's peak from the timeline of cost/memory.py's
``peak_memory`` (what is always alive, plus the larger of the backward and the gradient-sync
phases), not the sum of every term.  The meter is torch's own accounting of the CPU allocator
(tests/support/peak_jobs.py), which sees every tensor the process allocates -- autograd's
temporaries, the collectives' buffers, the optimizer's, torch.distributed.pipelining's receive
buffers -- and nothing of autopar's own bookkeeping.  Bound, every pipeline stage: within 5% of
the peak of a step (ten measured on each of its ranks; on gloo a step's peak takes one of two or
three values, see tests/support/peak_jobs.py), and no step above the prediction by more than
20%; docs/cost-model.md has the table.
"""
from __future__ import annotations

import pytest

import autopar
from tests.support.comm_check import model_spec
from tests.support.peak_jobs import peak_job

SEQ = 16
# (model, plan, world, global batch): the plans of test_memory_report.py, recompute and tensor
# parallelism on Hugging Face Llama (the example model, Llama-shaped too, gives the same margins:
# docs/cost-model.md's table).
REPORT_PLANS = [("dp=2", 2, 4), ("dp=2,zero=1", 2, 4), ("dp=2,zero=2", 2, 4), ("dp=2,zero=3", 2, 4),
                ("dp=4,zero=3", 4, 4), ("tp=2,sp,dp=2,zero=3", 4, 4), ("dp=2,mb=4", 2, 8)]
PLANS = ([("hf_llama", *p) for p in REPORT_PLANS]
         + [("hf_llama", p, 2, 4) for p in ("dp=2,recompute=full", "dp=2,recompute=selective", "tp=2,sp")])
# Pipelines: 1F1B with every micro-batch in flight at once (m = pp) and in steady state (m > pp),
# with data parallelism beside.
PIPELINE = [("hf_llama", "pp=2,mb=2", 2, 4), ("hf_llama", "pp=2,mb=4", 2, 8), ("hf_llama", "pp=2,dp=2,mb=2", 4, 8)]


def _predicted(model_name: str, plan: str, world: int, batch: int, **options) -> autopar.Cost:
    return autopar.estimate(model_spec(model_name, {}, batch),
                            autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world), plan,
                            seq_len=SEQ, global_batch=batch, dtype_bytes=4, **options)


@pytest.mark.parametrize("model_name,plan,world,batch", PLANS + PIPELINE,
                         ids=[f"{m}-{p}" for m, p, _, _ in PLANS + PIPELINE])
def test_peak_within_5_percent_of_allocator(dist_pool, model_name, plan, world, batch):
    measured = dist_pool(peak_job, model_name, plan, batch, SEQ, world=world)
    cost = _predicted(model_name, plan, world, batch)
    # The ranks of one pipeline stage run the same program: their steps pool (ten each).
    stages: dict[int, list[int]] = {}
    for m in measured:
        stages.setdefault(m["pp_rank"], []).extend(m["peaks"])
    for pp_rank, peaks in stages.items():
        predicted = cost.peak_memory(pp_rank)
        # Within 5% of a step's peak; gloo frees a collective's working copy on its own thread, at
        # times after the next allocation, which lifts some steps' peak by up to a ZeRO unit or two
        # (peak_jobs.py): no step beyond 20% of the prediction.
        assert min(abs(predicted - p) / p for p in peaks) <= 0.05, (pp_rank, predicted, sorted(set(peaks)))
        assert max(peaks) <= 1.2 * predicted, (pp_rank, predicted, sorted(set(peaks)))


@pytest.mark.parametrize("plan", ["dp=2,zero=1", "dp=2,zero=2"])
def test_peak_with_many_zero_units(dist_pool, plan):
    """Small buckets, a dozen ZeRO units per rank: every unit's reduce-scatter is in flight when
    backward ends (cost/memory.py's ``zero_sync_buffer``: (2 + 1/n) P + u, not one unit's buffers)."""
    bucket_bytes = 20_000
    measured = dist_pool(peak_job, "hf_llama", plan, 4, SEQ, bucket_bytes=bucket_bytes, world=2)
    predicted = _predicted("hf_llama", plan, 2, 4, bucket_bytes=bucket_bytes).peak_memory(0)
    peaks = [p for m in measured for p in m["peaks"]]
    assert min(abs(predicted - p) / p for p in peaks) <= 0.05, (predicted, sorted(set(peaks)))
    assert max(peaks) <= 1.2 * predicted, (predicted, sorted(set(peaks)))
