"""Expert parallelism: numerical equivalence with the unparallelized MoE model (gloo ranks).

Both MoE styles: the example decoder's ModuleList experts and Hugging Face Mixtral's
stacked [E, ...] expert weights run by a grouped matmul (JetMoE's: a slice per chunk of rows).  Each plan trains 3 optimizer
steps and is compared with single-process training on the same global batches (loss per
step <= 1e-5, full state dict <= 1e-4, fp32), as every other dimension is.
"""
from __future__ import annotations

import pytest

from tests.dist.test_equivalence import _check

PLANS = [("dp=2", 2), ("ep=2,dp=2", 2), ("ep=4,dp=4", 4), ("ep=2,dp=2,tp=2,sp", 4), ("ep=4,dp=4,tp=2,sp", 8)]


@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
@pytest.mark.parametrize("model_name", ["example_moe", "hf_mixtral"])
def test_ep_matches_single_process(dist_pool, model_name, plan, world):
    _check(dist_pool, model_name, plan, world, "sgd", overrides={})


# Expert 0 gets a +6 logit offset and expert 1 +3: nearly every token picks both, so the two
# experts of ep rank 0 receive almost all rows and rank 1's experts next to none.
_SKEW = {"router_bias": (6.0, 3.0, 0.0, 0.0)}


@pytest.mark.parametrize("plan,world", [("ep=2,dp=2", 2), ("ep=2,dp=2,tp=2,sp", 4)])
def test_skewed_routing_stays_equivalent(dist_pool, plan, world):
    results = _check(dist_pool, "example_moe", plan, world, "sgd", overrides=_SKEW)
    for r in results:
        counts = [x["counts"][0] for x in r["comm"] if x["tag"] == "MoE dispatch: tokens to expert owners"
                  and x["phase"] == "fwd"]
        for sent in counts:
            num_tokens = sum(sent) // 2
            assert sent[0] >= 0.9 * num_tokens  # the routing really is skewed
            assert sent[2] + sent[3] <= 0.1 * num_tokens


@pytest.mark.parametrize("variant", [{"softmax_before_topk": False}, {"normalize_topk": False}],
                         ids=["softmax_after_topk", "unnormalised"])
def test_routing_variants_stay_equivalent(dist_pool, variant):
    _check(dist_pool, "example_moe", "ep=2,dp=2", 2, "adamw", overrides=variant)


@pytest.mark.parametrize("model_name,plan_a,plan_b", [("example_moe", "ep=2,dp=2,tp=2,sp", "ep=4,dp=4"),
                                                      ("hf_mixtral", "ep=4,dp=4", "ep=2,dp=2,tp=2,sp")],
                         ids=["modulelist", "stacked"])
def test_checkpoint_reshards_experts(dist_pool, tmp_path, model_name, plan_a, plan_b):
    """Save under one EP layout, load under another and keep training (tests/dist/test_checkpoint.py)."""
    from tests.dist.test_checkpoint import test_save_under_one_plan_load_under_another as check

    check(dist_pool, tmp_path, model_name, plan_a, plan_b)


def test_auto_plan_on_a_moe_model(dist_pool):
    """plan='auto' scores EP plans for MoE models (experts from the traced graph) and trains equivalently."""
    from tests.support.harness import assert_equivalent
    from tests.support.jobs import auto_job, reference

    results = dist_pool(auto_job, "example_moe", world=2)
    assert all(r["plan"] == results[0]["plan"] for r in results) and results[0]["plan"] != "none"
    assert_equivalent(reference("example_moe", "sgd", ()), (results[0]["losses"], results[0]["state"]))


@pytest.mark.parametrize("plan,world", [("ep=2,dp=2", 2), ("ep=2,dp=2,tp=2,sp", 4)])
def test_shared_experts_stay_data_parallel(dist_pool, plan, world):
    """Qwen2-MoE: a gated shared expert next to the routed ones runs on the rank's tokens, unsplit."""
    _check(dist_pool, "hf_qwen_moe", plan, world, "sgd", overrides={})


def test_experts_split_by_counts_and_experts_around_attention(dist_pool):
    """JetMoE: the MLP experts (rows split by per-expert counts, a slice of the stacked weights per
    chunk) are split over ep; the attention experts, whose halves run around attention, stay whole on
    every rank, run on its own tokens."""
    _check(dist_pool, "hf_jetmoe", "ep=2,dp=2", 2, "sgd", overrides={})


@pytest.mark.parametrize("model_name,plan,world", [("example_moe", "ep=4,dp=2,cp=2", 4),
                                                   ("hf_mixtral", "ep=2,cp=2,tp=2,sp", 4)])
def test_ep_folds_over_context_parallel_ranks(dist_pool, model_name, plan, world):
    """ep is carved from dp*cp: ranks holding different sequence chunks exchange tokens too."""
    _check(dist_pool, model_name, plan, world, "sgd", overrides={})


@pytest.mark.parametrize("model_name,overrides", [("example_moe", {"num_experts": 3}),
                                                  ("hf_mixtral", {"num_local_experts": 3})],
                         ids=["modulelist", "stacked"])
def test_an_ep_that_does_not_divide_the_experts_pads_them(dist_pool, model_name, overrides):
    """3 experts over ep=2 (FlexOlmo's 7): rank 0 holds 2, rank 1 one and, for stacked experts, a
    zero padding expert no token reaches; the full state dict comes back without the padding."""
    _check(dist_pool, model_name, "ep=2,dp=2", 2, "adamw", overrides=overrides)


@pytest.mark.parametrize("plan,world", [("ep=2,dp=2", 2), ("ep=2,dp=2,tp=2,sp", 4)])
def test_dense_experts_match_single_process(dist_pool, plan, world):
    """Llama 4: every expert runs on every token; each rank sums its 2 experts over the ep group's
    tokens and the partial sums are reduce-scattered back (passes/dense_expert_parallel.py)."""
    from autopar.plan import Plan
    from tests.support.jobs import BATCH, SEQ

    results = _check(dist_pool, "hf_llama4", plan, world, "sgd", overrides={})
    p = Plan.parse(plan)
    tokens = BATCH // p.dp * SEQ // p.tp  # a rank's tokens (its sequence shard under sp)
    for r in results:  # per layer and step: the tokens [T, 64] and scores [T, 4] gathered, the sum scattered
        fwd = [x for x in r["comm"] if x["phase"] == "fwd" and x["tag"].startswith("dense MoE")]
        gathers = [x["bytes_sent"] for x in fwd if x["op"] == "all_gather"]
        scatters = [x["bytes_sent"] for x in fwd if x["op"] == "reduce_scatter"]
        assert gathers and len(gathers) == 2 * len(scatters)
        assert set(gathers) == {tokens * 64 * 4, tokens * 4 * 4} and set(scatters) == {tokens * 64 * 4}
