"""Dimensions combined: each plan equal to one device, every collective's bytes equal to the cost model.

The plans of one world size run in one pool job (tests/support/composition_jobs.py).  Each plan
trains 3 steps; the losses and the final state dict must equal single-process training
(tests/support/reference.py bounds) and each rank's last-step collectives must equal
``autopar.estimate(...).comm_table(stage)`` call for call and byte for byte.
"""
from __future__ import annotations

import pytest

from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.composition_jobs import plans_job
from tests.support.harness import assert_equivalent
from tests.support.jobs import BATCH, reference

CASES = [
    # (model, plans run in one pool job, world, optimizer, overrides)
    ("example", ["cp=2,zero=1", "cp=2:ring,zero=3"], 2, "adamw", {}),
    # An LM head tied to the embedding under each schedule: the last pp rank's copy, summed gradients.
    ("example", ["pp=2:gpipe,mb=4", "pp=2:1f1b,mb=4", "pp=2:interleaved,vpp=2,mb=4", "pp=2:zbv,mb=4",
                 "pp=2:dualpipev,mb=4"], 2, "sgd", {"num_layers": 4, "tie_embeddings": True}),
    ("hf_llama", ["cp=2:ulysses,dp=2,zero=3", "pp=2,dp=2,zero=1,mb=2", "pp=2:dualpipev,cp=2:ulysses,mb=4"], 4,
     "sgd", {"num_hidden_layers": 4}),
    ("example", ["pp=2:zbv,dp=2,zero=1,mb=2", "pp=2,cp=2,mb=2", "pp=2:interleaved,vpp=2,cp=2:allgather,mb=4"], 4,
     "adamw", {"num_layers": 4}),
    # ZeRO-2 / 3 inside pipeline stages: per-chunk reduce-scatters, per-chunk gather units.
    ("example", ["pp=2,dp=2,zero=2,mb=2", "pp=2:zbv,dp=2,zero=2,mb=2", "pp=2:interleaved,vpp=2,dp=2,zero=3,mb=2",
                 "pp=2:zbv,dp=2,zero=3,mb=2"], 4, "adamw", {"num_layers": 4}),
    # MoE: experts split over ep inside pipeline stages, with ZeRO-2/3 (expert units over edp), with cp.
    ("example_moe", ["pp=2,ep=2,dp=2,zero=3,mb=2", "ep=2,dp=2,tp=2,sp,zero=2,mb=2", "ep=2,dp=2,tp=2,sp,zero=3",
                     "ep=2,cp=2,tp=2,sp,zero=1"], 4, "sgd",
     {"num_layers": 4}),
    # The reference's full configuration (§6) at 8 ranks: TP+SP+PP+CP+EP+ZeRO-1, one variant on a
    # Mixtral-style model, the other (interleaved, ring) on a Qwen2-MoE-style one (shared expert).
    ("hf_mixtral", ["tp=2,sp,pp=2,cp=2:ulysses,ep=2,zero=1,mb=4"], 8, "sgd",
     {"num_hidden_layers": 4, "num_key_value_heads": 4}),
    ("hf_qwen_moe", ["tp=2,sp,pp=2:interleaved,vpp=2,cp=2:ring,ep=2,zero=1,mb=4"], 8, "sgd",
     {"num_hidden_layers": 4, "num_key_value_heads": 4}),
]


@pytest.mark.parametrize("model_name,plans,world,opt,overrides", CASES,
                         ids=[f"{c[0]}:{'|'.join(c[1])}" for c in CASES])
def test_combined_plans_equal_one_device(dist_pool, model_name, plans, world, opt, overrides):
    results = dist_pool(plans_job, model_name, plans, opt, overrides, world=world)
    ref = reference(model_name, opt, tuple(sorted(overrides.items())))
    for plan in plans:
        cost = predicted_cost(model_name, overrides, plan, world, BATCH)
        p = cost.plan
        for rank, r in enumerate(results):
            assert r[plan]["losses"] == results[0][plan]["losses"], plan
            # MoE token all-to-alls at the routing this rank realised (tests/dist/test_ep_bytes.py)
            counts = [x["counts"] for x in r[plan]["comm"] if x["phase"] == "fwd" and x["counts"] is not None
                      and x["tag"].startswith("MoE dispatch")]
            rows = cost.comm_table(r[plan]["pp_rank"], expert_counts=counts or None,
                                   ep_rank=(rank // p.tp) % (p.dp * p.cp) % p.ep)
            assert_comm_equal(r[plan]["comm"], rows, (plan, rank))
        assert_equivalent(ref, (results[0][plan]["losses"], results[0][plan]["state"]))
