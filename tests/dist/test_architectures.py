"""Architectures beyond Llama, Qwen2, GPT-2 and Mixtral on gloo ranks (issue 15: never silently wrong).

Each plan trains 3 SGD steps and is compared with single-process training on the same global
batches (loss per step <= 1e-5, full state dict <= 1e-4, fp32):

- Gemma 2 under ``tp=2`` and ``tp=2,sp``: four norms per layer (the attention and MLP outputs
  are normalised again after the row-parallel projection's reduction), ``(1 + w)`` norm weights,
  soft-capped attention and final logits.  The soft-capped logits are gathered for the loss;
  every rank then computes the same loss, so the gather's gradient is replicated and its
  backward keeps this rank's slice (a reduce-scatter would double every gradient);
- Phi-3 under ``tp=2,sp`` (its fused qkv is cut by slices, which take one whole part of the
  projection the TP pass shards part by part) and ``pp=2,mb=2``;
- OLMo 2 under ``tp=2`` and ``tp=2,sp``: q and k are RMS-normalised over the whole projection
  width, which tp shards; the norms' statistics are summed across ranks (and, in backward,
  their gradient);
- OPT under ``cp=2:allgather`` and ``cp=2:ring``: learned positions from the cumulative sum of
  the attention mask, which on sequence chunks is rewritten to the global cumulative sum
  (and under ``tp=2``: biased projections, LayerNorm with bias, a tied head).

All plans run in one pool job.  The single-process half (the gradient placements, the cp
refusals) is tests/unit/test_soundness.py; the argument is docs/soundness.md.
"""
from __future__ import annotations

import functools

import pytest

from tests.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train
from tests.jobs import BATCH, SEQ, VOCAB, build, train_cases_job

CASES = [("hf_gemma2", "tp=2"), ("hf_gemma2", "tp=2,sp"), ("hf_opt", "cp=2:allgather"), ("hf_opt", "cp=2:ring"),
         ("hf_opt", "tp=2"), ("hf_phi3", "tp=2,sp"), ("hf_phi3", "pp=2,mb=2"), ("hf_olmo2", "tp=2"),
         ("hf_olmo2", "tp=2,sp")]


@functools.lru_cache(maxsize=None)
def _reference(model_name: str):
    _, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, {})[0], batches, loss_fn, OPTIMIZERS["sgd"], kwargs)


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(m, p, {}) for m, p in CASES], "sgd", world=2)
    return {case: [rank[i] for rank in results] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("model_name,plan", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_architecture_matches_single_process(trained, model_name, plan):
    ranks = trained[(model_name, plan)]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(_reference(model_name), (ranks[0]["losses"], ranks[0]["state"]))
