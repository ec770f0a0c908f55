"""The flat fused optimizer step (autopar/runtime/gradients/fused_step.py) under parallel plans.

Each case trains 3 steps of the example model twice in one pool job
(tests/support/fused_jobs.py): with ``fused_optimizer=True`` (the default: under dp the masters or
parameters and their gradients are views of flat buffers, one fused AdamW/SGD update steps
them; under tp alone the per-tensor step with ``fused=True``; ZeRO's flat shards get
``fused=True``) and with ``fused_optimizer=False`` (the per-tensor
step).  Checked: the two agree to float rounding (losses, full state dict, and the checkpoint's
per-parameter optimizer state under the original names), both match one-device training
(fp32: the project's equivalence bounds; bf16: the hand-written recipe's), the memory report is
unchanged, and the optimizer really is flat and fused.  Checkpoints saved under the fused step
load exactly into a per-tensor program of another plan, and the other way round.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.fused_jobs import FUSED_OPTIMIZERS, STEPS, cross_checkpoint_job, fused_pairs_job
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.precision_jobs import bf16_recipe
from tests.support.reference import assert_equivalent, make_batches, reference_train

PAIR_ATOL = 1e-6     # fused kernel against foreach: float rounding of the same update
BF16_LOSS_RTOL = 2e-3  # as tests/dist/test_precision.py: a master one ulp apart may round to another bf16
BF16_STATE_ATOL = 1e-2

CASES = {
    "grad_sync": [
        ("dp=2", "adamw", None), ("dp=2", "sgd_momentum", None),
        ("tp=2", "adamw", None), ("tp=2", "sgd_momentum", None),
        ("dp=2", "adamw", "bf16"), ("dp=2", "sgd_momentum", "bf16"), ("tp=2,sp", "adamw", "bf16"),
    ],
    "zero": [
        ("dp=2,zero=1", "adamw", None), ("dp=2,zero=1", "sgd_momentum", None),
        ("dp=2,zero=3", "adamw", None), ("dp=2,zero=3", "sgd_momentum", None),
        ("dp=2,zero=3", "adamw", "bf16"),
    ],
}


def _reference(opt_name: str, mixed_precision):
    _, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, BATCH, SEQ, STEPS, seed=1)
    if mixed_precision:
        ref = bf16_recipe(build("example", {})[0], batches, loss_fn, kwargs, FUSED_OPTIMIZERS[opt_name])
        return ref["losses"], ref["state"]
    return reference_train(lambda: build("example", {})[0], batches, loss_fn, FUSED_OPTIMIZERS[opt_name], kwargs)


def _close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert a[key].dtype == b[key].dtype, (what, key)
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=atol, rtol=0, msg=f"{what}: {key}")


@pytest.mark.parametrize("kind", sorted(CASES))
def test_fused_step_equals_the_per_tensor_step(dist_pool, kind):
    cases = CASES[kind]
    results = dist_pool(fused_pairs_job, cases, world=2)
    for i, (plan, opt_name, mixed_precision) in enumerate(cases):
        what = f"{plan} {opt_name} {mixed_precision or 'fp32'}"
        for rank in results:
            fused, plain = rank[i][True], rank[i][False]
            assert fused["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-6), what
            assert fused["memory"] == plain["memory"], what
            assert fused["layout"]["fused"] and not plain["layout"]["fused"], (what, fused["layout"])
            if kind == "grad_sync" and "dp=" in plan:  # one flat tensor per rank (one dtype, one group)
                assert fused["layout"] == {"tensors": 1, "fused": True, "flat": True}, what
            elif kind == "grad_sync":  # no dp buckets keep the gradients: per tensor, fused
                assert not fused["layout"]["flat"] and fused["layout"]["tensors"] > 1, what
            assert not plain["layout"]["flat"], what
        fused, plain = results[0][i][True], results[0][i][False]
        _close(fused["state"], plain["state"], PAIR_ATOL, what)
        _close(fused["ckpt"], plain["ckpt"], PAIR_ATOL, what)
        assert any(k.startswith("optim.") for k in fused["ckpt"]), what
        ref_losses, ref_state = _reference(opt_name, mixed_precision)
        if mixed_precision:
            assert fused["losses"] == pytest.approx(ref_losses, rel=BF16_LOSS_RTOL), what
            _close(fused["state"], ref_state, BF16_STATE_ATOL, what)
        else:
            assert_equivalent((ref_losses, ref_state), (fused["losses"], fused["state"]))


@pytest.mark.parametrize("plan_a,fused_a,plan_b,fused_b", [
    ("dp=2", True, "tp=2", False),
    ("tp=2", False, "dp=2", True),
    ("dp=2,zero=1", True, "dp=2", True),
])
def test_checkpoints_cross_between_fused_and_per_tensor(dist_pool, tmp_path, plan_a, fused_a, plan_b, fused_b):
    results = dist_pool(cross_checkpoint_job, plan_a, fused_a, plan_b, fused_b, str(tmp_path / "ckpt"), world=2)
    ref = _reference("adamw", None)
    for r in results:
        assert not r["differences"], "\n".join(r["differences"])
        assert r["num_optim"] > 0 and r["layout"]["fused"] == fused_b
    assert_equivalent(ref, (results[0]["losses"], results[0]["state"]))
