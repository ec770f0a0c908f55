"""A sliding-window model whose window is shorter than the sequence trains exactly under every plan
that runs it, or is refused before the first step (never with the window dropped).

The causal-mask pass used to decide that a mask "is causal" from two sizes shorter than any
window and replaced it with ``is_causal=True``; the window was gone at real lengths.  Mistral
with an 8-token window at sequence 16: the mask must stay (passes/causal_mask.py ``check_sizes``)
and the losses and state equal one device.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.support.harness import assert_equivalent  # noqa: E402
from tests.support.jobs import reference, train_cases_job  # noqa: E402

PLANS = [("dp=2", 2), ("tp=2,sp", 2), ("pp=2,mb=2", 2), ("dp=2,zero=3", 2)]


def test_window_shorter_than_the_sequence_is_exact(dist_pool):
    cases = [("hf_mistral_window", plan, {}) for plan, _ in PLANS]
    results = dist_pool(train_cases_job, cases, "adamw", world=2)
    ref = reference("hf_mistral_window", "adamw", ())
    for index, (plan, _) in enumerate(PLANS):
        got = results[0][index]
        assert_equivalent(ref, (got["losses"], got["state"])), plan
