"""Sliding-window models whose windows are shorter than the sequence train exactly under every plan
that runs them, or are refused before the first step (never with the window dropped).

The causal-mask pass used to decide that a mask "is causal" from two sizes shorter than any
window and replaced it with ``is_causal=True``; the window was gone at real lengths.  Now the
mask is checked past every threshold its subgraph holds (passes/causal_mask.py ``check_sizes``;
the small-size decision re-checked at larger sizes: tests/unit/test_passes.py), so a window
stays a mask.  Each model has an 8-token window at sequence 16:

- Mistral (``sliding_window`` on every layer) and Qwen2 (``use_sliding_window``: layer 0 full,
  layer 1 windowed) through SDPA: equal under ``dp=2``, ``tp=2,sp``, ``pp=2,mb=2``,
  ``dp=2,zero=3`` and every CP variant: the window is proven a causal sliding window of 8 keys
  (passes/causal_mask.py ``mask_window``) and CP attention applies it from global positions,
  ring attention skipping the blocks out of every query's window (autopar/ops/cp_attention.py);
- Gemma 2 (local and global layers alternating): transformers 5.25 refuses SDPA for it (its
  soft-capped scores), so it runs its eager attention, which keeps its mask: equal under the
  same plans, CP included: the attention runs whole over the sequence gathered in global order,
  the mask built again at the global length (passes/cp_cores.py);
- GPT-OSS (alternating 8-token-window and full layers, attention sinks, eager attention, 4
  experts): equal under ``dp=2``, ``pp=2,mb=2`` and ``dp=2,zero=3``, its routing (the ``cumsum``
  of routing counts, the expert biases gathered by sorted expert ids) proven per token on data
  axes (passes/token_order.py); under ``tp=2,sp`` equal too, its experts rewritten with the
  biases read at each sorted row's expert id; under CP its eager attention (sinks concatenated to
  the scores) runs whole, and its experts are rewritten.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.support.harness import assert_equivalent  # noqa: E402
from tests.support.jobs import reference  # noqa: E402
from tests.support.window_jobs import train_or_refuse_job  # noqa: E402

RUNS = ("dp=2", "tp=2,sp", "pp=2,mb=2", "dp=2,zero=3")
CP = ("cp=2:ring", "cp=2:allgather", "cp=2:ulysses")
# model -> {plan: None (equal to one device) or a phrase of its refusal}
EXPECTED = {
    "hf_mistral_window": dict.fromkeys(RUNS + CP),
    "hf_qwen2_window": dict.fromkeys(RUNS + CP),
    "hf_gemma2_window": dict.fromkeys(RUNS + CP),
    "hf_gpt_oss_window": dict.fromkeys(RUNS + CP),
}
CASES = [(model, plan) for model, plans in EXPECTED.items() for plan in plans]


@pytest.fixture(scope="module")
def outcomes(dist_pool):
    results = []
    for start in range(0, len(CASES), 14):  # pool jobs of a few models each keep within the job timeout
        results += dist_pool(train_or_refuse_job, CASES[start:start + 14], "adamw", world=2)[0]
    return dict(zip(CASES, results))


@pytest.mark.parametrize("model_name,plan", CASES, ids=[f"{m}-{p}" for m, p in CASES])
def test_window_shorter_than_the_sequence_is_exact_or_refused(outcomes, model_name, plan):
    got, phrase = outcomes[(model_name, plan)], EXPECTED[model_name][plan]
    if phrase is None:
        assert "refused" not in got, got.get("refused")
        assert_equivalent(reference(model_name, "adamw", ()), (got["losses"], got["state"]))
    else:
        assert "losses" not in got, f"{model_name} under {plan} trained; expected a refusal ({phrase})"
        assert got["refused"].startswith("autopar:") and phrase in got["refused"], got["refused"]
