"""``parallelize(..., compile=...)`` on gloo ranks: the compiled program trains like one device.

Each plan trains 3 SGD steps with ``compile={"backend": "aot_eager"}`` (TorchDynamo and
AOTAutograd, forward and backward, then the aten ops as they are: the numerics of the eager
program) and is compared with single-process training (tests/support/reference.py bounds).  The same
job trains the eager program too: both must run the same collectives with the same bytes (the
eager program's equal the cost model's: tests/dist/test_bytes.py) and print the same program.
The saved-tensor hooks still see the compiled forward's saves: SP's backward re-gathers and
ZeRO-3's backward gathers are among those collectives.  Inductor: tests/e2e/test_compile_inductor.py.
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.jobs import compile_cases_job, reference

CASES = [("hf_llama", "tp=2,sp"), ("hf_llama", "tp=2"), ("hf_llama", "dp=2,zero=3"), ("hf_llama", "dp=2,zero=1"),
         ("hf_llama", "dp=2,zero=2,mb=2"), ("hf_llama", "cp=2:ring"), ("hf_llama", "cp=2:ulysses"),
         ("example_moe", "ep=2,dp=2"), ("hf_llama", "dp=2,mb=2")]


@pytest.fixture(scope="module")
def trained(dist_pool):
    results = dist_pool(compile_cases_job, [(m, p, {}) for m, p in CASES], "sgd", "aot_eager", world=2)
    return {case: [rank[i] for rank in results] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("model_name,plan", CASES, ids=[p for _, p in CASES])
def test_compiled_program_matches_one_device(trained, model_name, plan):
    ranks = trained[(model_name, plan)]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
        assert r["same_comm"], "the compiled program ran other collectives than the eager one"
        assert r["same_code"]
    assert_equivalent(reference(model_name, "sgd", ()), (ranks[0]["losses"], ranks[0]["state"]))
