"""``parallelize(..., compile=...)`` on gloo ranks: the compiled program trains like one device.

Each plan trains 3 SGD steps with ``compile={"backend": "aot_eager"}`` (TorchDynamo and
AOTAutograd, forward and backward, then the aten ops as they are: the numerics of the eager
program) and is compared with single-process training (tests/support/reference.py bounds).  The same
job trains the eager program too: both must compute the same losses and weights (within 1e-6:
a graph break at a collective or dropout can change the order in which a tensor's gradients add
up), run the same collectives with the same bytes (the eager program's equal the cost model's:
tests/dist/test_bytes.py), recompute as many regions and print the same program.
The saved-tensor hooks still see the compiled forward's saves: SP's backward re-gathers and
ZeRO-3's backward gathers are among those collectives.  Pipelines: each chunk's program is
compiled under every schedule, the split input / weight backward of zbv and dualpipev included;
activation recompute: each region's body is compiled on its own, under an eager checkpoint (with
dropout on, the recomputation must draw the forward's masks).  Inductor: tests/e2e/test_compile_inductor.py.
"""
from __future__ import annotations

import pytest

from tests.support.harness import assert_equivalent
from tests.support.jobs import compile_cases_job, reference

_LAYERS4 = {"num_hidden_layers": 4}  # two chunks per rank: interleaved and the V schedules
_DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "mlp_dropout": 0.1}  # no one-device reference

# (model, plan, overrides, world)
CASES = [("hf_llama", "tp=2,sp", {}, 2), ("hf_llama", "tp=2", {}, 2), ("hf_llama", "dp=2,zero=3", {}, 2),
         ("hf_llama", "dp=2,zero=1", {}, 2), ("hf_llama", "dp=2,zero=2,mb=2", {}, 2), ("hf_llama", "cp=2:ring", {}, 2),
         ("hf_llama", "cp=2:ulysses", {}, 2), ("example_moe", "ep=2,dp=2", {}, 2), ("hf_llama", "dp=2,mb=2", {}, 2)]
# Every pipeline schedule, activation recompute (with dropout: the recomputation's masks), both.
PP_RECOMPUTE_CASES = [
    ("hf_llama", "pp=2:gpipe,mb=4", {}, 2), ("hf_llama", "pp=2:1f1b,mb=4", {}, 2),
    ("hf_llama", "pp=2:interleaved,vpp=2,mb=4", _LAYERS4, 2), ("hf_llama", "pp=2:zbv,mb=4", _LAYERS4, 2),
    ("hf_llama", "pp=2:dualpipev,mb=4", _LAYERS4, 2),
    ("hf_llama", "tp=2,sp,recompute=selective", {}, 2), ("example", "tp=2,sp,recompute=full", _DROPOUT, 2),
    ("hf_llama", "pp=2:1f1b,mb=4,recompute=selective", {}, 2), ("example", "pp=2,mb=2,recompute=full", _DROPOUT, 2),
    ("example_moe", "pp=2,ep=2,dp=2,mb=2", {}, 4), ("hf_llama", "pp=2:zbv,tp=2,sp,mb=4", _LAYERS4, 4),
    ("hf_llama", "pp=2,tp=2,sp,dp=2,mb=2", {}, 8)]


def _id(case) -> str:
    model, plan, overrides, _ = case
    return f"{model}-{plan}" + ("-dropout" if overrides is _DROPOUT else "")


@pytest.fixture(scope="module")
def trained(dist_pool):
    out = {}
    for group in (CASES, PP_RECOMPUTE_CASES):  # one pool job per group and world size
        for world in sorted({w for *_, w in group}):
            cases = [c for c in group if c[3] == world]
            results = dist_pool(compile_cases_job, [(m, p, o) for m, p, o, _ in cases], "sgd", "aot_eager",
                                world=world)
            out.update({_id(case): [rank[i] for rank in results] for i, case in enumerate(cases)})
    return out


@pytest.mark.parametrize("case", CASES + PP_RECOMPUTE_CASES, ids=[_id(c) for c in CASES + PP_RECOMPUTE_CASES])
def test_compiled_program_matches_one_device(trained, case):
    model_name, plan, overrides, _ = case
    ranks = trained[_id(case)]
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]
        # Within reassociation of the eager program (bitwise where no graph break splits a sum
        # of gradients: the graph breaks at collectives and dropout change its order).
        assert r["losses"] == pytest.approx(r["eager_losses"], rel=0, abs=1e-6), "other losses than the eager program"
        assert r["state_diff"] <= 1e-6, f"other weights than the eager program: {r['state_diff']}"
        assert r["same_comm"], "the compiled program ran other collectives than the eager one"
        assert r["same_recomputed"], "the compiled program recomputed other regions than the eager one"
        assert r["same_code"]
    if overrides is not _DROPOUT:  # dropout draws other masks on one device
        ref = reference(model_name, "sgd", tuple(sorted(overrides.items())))
        assert_equivalent(ref, (ranks[0]["losses"], ranks[0]["state"]))
