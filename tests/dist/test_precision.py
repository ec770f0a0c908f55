"""bf16 mixed precision under parallel plans against the single-device bf16 recipe.

Each case trains 3 AdamW steps with ``mixed_precision="bf16"`` (tests/support/precision_jobs.py) and
the recipe written out by hand on one device: bf16 forward and backward, fp32 logits for the
loss, fp32 masters stepped by the optimizer.  Checked: every step's loss within bf16
tolerance of the recipe's (the plans sum bf16 partial products in other orders, so the
numbers differ in the last bf16 bits, never by more); the program's parameters bf16 and
the optimizer's fp32; ``state_dict()`` the fp32 masters (values no bf16 tensor can hold,
close to the recipe's masters); the user's model untouched; and parameters, gradients and
optimizer state per rank exactly the cost model's ``dtype_bytes=2`` terms (2 B bf16
parameters, 4 B fp32 main gradients, 12 B masters + Adam state; ZeRO-3 holds only the fp32
master shard), for every rank (pipeline stages too), and every collective's bytes equal to
the cost model's (bf16 activations and gathers, fp32 gradient reductions).
"""
from __future__ import annotations

import pytest
import torch

from tests.support.checkpoint_jobs import reshard_job
from tests.support.comm_check import assert_comm_equal, predicted_cost
from tests.support.precision_jobs import bf16_job, reference_bf16

LOSS_RTOL = 2e-3   # half a bf16 ulp relative (2^-9): the recipe's loss to within its own rounding
STATE_ATOL = 1e-2  # AdamW moves each weight by ~lr=1e-3 per step; bf16 gradient noise flips near-zero ones

CASES = [
    # (model, plan, world, batch, overrides)
    ("example", "tp=2,sp,dp=2", 4, 4, {}),
    ("hf_llama", "pp=2,mb=2", 2, 4, {"num_hidden_layers": 2}),
    ("example_tied", "pp=2,mb=2", 2, 4, {}),            # the LM head's copy of the embedding, summed in fp32
    ("example", "pp=2:zbv,mb=2", 2, 4, {"num_layers": 4}),  # torch's split weight backward: still fp32 accumulation
    ("example", "dp=2,zero=3", 2, 4, {}),
    ("example", "dp=2,zero=2,tp=2,sp,mb=2", 4, 8, {}),
]


@pytest.mark.parametrize("model_name,plan,world,batch,overrides", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_bf16_matches_the_single_device_recipe(dist_pool, model_name, plan, world, batch, overrides):
    results = dist_pool(bf16_job, model_name, plan, "adamw", overrides, batch, world=world)
    ref = reference_bf16(model_name, "adamw", overrides, batch)
    pp = int(plan.split("pp=")[1].split(",")[0].split(":")[0]) if "pp=" in plan else 1
    cost = predicted_cost(model_name, overrides, plan, world, batch, dtype_bytes=2)
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
        assert r["eval"] == pytest.approx(ref["eval"], rel=LOSS_RTOL) and r["eval_kept_state"]
        assert r["param_dtypes"] == ["torch.bfloat16"] and r["optimizer_dtypes"] == ["torch.float32"]
        assert r["state_dtypes"] == ["torch.float32"] and r["untouched"] and not r["load"], r["load"]
        stage = rank // (world // pp)  # pp is the outermost mesh axis
        predicted = cost.memory(stage)
        for key in ("params", "grads", "optimizer"):
            assert r["memory"][key] == predicted[key], (key, r["memory"][key], predicted[key])
        # bf16 activations and parameter gathers, fp32 gradient reductions (w_gc = 4 B)
        assert_comm_equal(r["comm"], cost.comm_table(stage), rank)
    state = results[0]["state"]
    assert state.keys() == ref["state"].keys()
    for key, value in ref["state"].items():
        assert torch.allclose(state[key], value, atol=STATE_ATOL, rtol=0), key
    # The masters hold fp32 values, not bf16 ones: the updates accumulate below bf16's resolution.
    weights = [v for k, v in state.items() if v.dim() == 2]
    assert any(not torch.equal(w, w.to(torch.bfloat16).float()) for w in weights)


def test_bf16_clipping_norm_matches_the_recipe(dist_pool):
    clip = 0.05
    results = dist_pool(bf16_job, "example", "tp=2,sp,dp=2", "sgd", {}, 4, clip, world=4)
    ref = reference_bf16("example", "sgd", {}, 4, clip)
    assert ref["norm"] > clip
    for r in results:
        assert r["norm"] == pytest.approx(ref["norm"], rel=LOSS_RTOL)
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)


def test_bf16_checkpoint_continues_across_plans(dist_pool, tmp_path):
    """Saved under pp, loaded under ZeRO-3: the fp32 masters and AdamW state come back bit for
    bit (nothing passes through bf16), and the run continues as the uninterrupted recipe."""
    results = dist_pool(reshard_job, "example", "pp=2,mb=2", "dp=2,zero=3", str(tmp_path / "ckpt"),
                        mixed_precision="bf16", world=2)
    ref = reference_bf16("example", "adamw", {})
    for r in results:
        assert not r["differences"], "\n".join(r["differences"])
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
    for key, value in ref["state"].items():
        assert torch.allclose(results[0]["state"][key], value, atol=STATE_ATOL, rtol=0), key
