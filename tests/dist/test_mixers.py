"""Linear-attention and convolution mixers under tensor parallelism on gloo ranks (issue 40, item 2: never silently wrong).

A tiny dense Qwen3-Next (tests/support/models.py ``hf_qwen3_next``: a gated delta net, then full
attention) trains 3 SGD steps under ``tp=2`` and ``tp=2,sp`` and is compared with single-process
training on the same global batches (loss per step <= 1e-5, full state dict <= 1e-4, fp32): the
in-projections column-parallel by key-head groups, ``cat((q, k, v))`` laid out by blocks through
the depthwise convolution (its weight cut block by block, its gradient summed over tp), the
recurrence per head, the gated norm per head and the row-parallel out-projection
(docs/soundness.md, "tensors laid out by blocks").  A tiny LFM3 (``hf_lfm3``: a short
convolution, then full attention) the same way: its ``in_proj`` fused B|C|x, transposed to channels
first before its ``chunk`` (the parts found where the features went), column-parallel part by part,
the depthwise convolution over the rank's channels, ``out_proj`` row-parallel.  A tiny DeepSeek-V3.2
(``hf_deepseek_v32``): its sparse-attention indexer runs under ``torch.no_grad()`` and scores every
key, so under SP its sequence shards are gathered before the region (passes/grad_mode_regions.py)
and every rank picks the same keys, as one device does.  The shrunk zoo model (full-size heads, mixture
of experts) is tests/e2e/test_zoo.py; the rules alone, tests/unit/test_mixer_rules.py.

State-space mixers the same way: a tiny Mamba (``hf_mamba``) under ``tp=2,sp``, traced at a fixed
length (its scan loops over the positions), its channels split over tp, ``x_proj`` a row read again
inside the mixer (summed whole, and its input gradient summed in backward), ``out_proj`` the
region's reduce-scatter; and a tiny Mamba-2 (``hf_mamba2``) under ``tp=2`` and ``tp=2,sp``: z|x|B|C|dt
split part by part with B and C whole on every rank, the convolution over x|B|C laid out by blocks.

Under ``cp=2`` the same Mamba-2, Qwen3-Next and LFM3 run their mixers whole (passes/cp_cores.py): the
convolution and the chunked scan read the sequence all-gathered into global order, with the sizes
built again at the global length (Mamba-2's 16 tokens span 4 chunks of 4 on every rank), and each
rank keeps its rows of the result; the projections, norms and MLPs stay on the rank's positions.
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.jobs import reference, train_cases_job

pytest.importorskip("transformers")

CASES = [("hf_qwen3_next", "tp=2"), ("hf_qwen3_next", "tp=2,sp"), ("hf_lfm3", "tp=2"), ("hf_lfm3", "tp=2,sp"),
         ("hf_deepseek_v32", "tp=2,sp"), ("hf_mamba", "tp=2,sp"), ("hf_mamba2", "tp=2"), ("hf_mamba2", "tp=2,sp"),
         ("hf_mamba2", "cp=2"), ("hf_qwen3_next", "cp=2"), ("hf_lfm3", "cp=2")]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(train_cases_job, [(m, p, {}) for m, p in CASES], "sgd", world=2)
    return {case: [rank[i] for rank in results] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("model_name,plan", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_mixer_matches_single_process(trained, model_name, plan):
    ranks = trained[(model_name, plan)]
    for r in ranks:  # every rank reports the same global loss
        assert r["losses"] == ranks[0]["losses"]
    assert_equivalent(reference(model_name, "sgd", ()), (ranks[0]["losses"], ranks[0]["state"]))
