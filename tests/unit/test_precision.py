"""bf16 mixed precision on one process: the runtime's layout against the recipe written by hand.

The multi-rank plans are tests/dist/test_precision.py; here the plan is ``none`` (one rank),
so the program must reproduce tests/support/precision_jobs.py's single-device recipe step for step:
the same bf16 forward and backward, fp32 loss, fp32 masters.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.runtime.stepping.precision import MainGrads, mixed_precision_dtype
from tests.support.harness import OPTIMIZERS
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.precision_jobs import STEPS, reference_bf16
from tests.support.reference import make_batches


@pytest.mark.parametrize("model_name", ["example", "hf_llama"])
def test_one_rank_equals_the_recipe(model_name):
    model, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, BATCH, SEQ, STEPS, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], mixed_precision="bf16")
    losses = [pm.train_step(*b) for b in batches]
    ref = reference_bf16(model_name, "adamw", {})
    assert losses[0] == pytest.approx(ref["losses"][0], rel=1e-6)  # the same bf16 forward
    # The example model's program is the eager computation op for op; the HF model's exported
    # backward is not (its gradients differ in their last bf16 bits), so later steps agree to
    # bf16 tolerance only.
    exact = model_name == "example"
    assert losses == pytest.approx(ref["losses"], rel=1e-6 if exact else 2e-3)
    state = pm.state_dict()
    for key, value in ref["state"].items():
        assert state[key].dtype == torch.float32
        torch.testing.assert_close(state[key], value, atol=1e-6 if exact else 1e-2, rtol=0)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's model is untouched
    report = pm.memory_report()
    n = sum(p.numel() for p in model.parameters())
    assert (report["params"], report["grads"], report["optimizer"]) == (2 * n, 4 * n, 12 * n)


def test_main_grads_accumulate_in_fp32():
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    main = MainGrads({"w": param}, {"w": torch.full((4,), 0.1)})
    assert main.masters["w"].dtype == torch.float32 and main.masters["w"][0].item() == pytest.approx(0.1)
    tiny = torch.full((4,), 2.0 ** -10, dtype=torch.bfloat16)
    for big in (torch.ones(4, dtype=torch.bfloat16), tiny, tiny):
        param.grad = big.clone()
        main.accumulate()
        assert param.grad is None
    # bf16 would have lost both 2^-10 terms against 1.0 (8 bits of mantissa); fp32 keeps them.
    assert main.masters["w"].grad[0].item() == 1.0 + 2 * 2.0 ** -10
    main.copy_to_params()
    assert param.dtype == torch.bfloat16 and param[0].item() == pytest.approx(0.1, abs=1e-3)


def test_mode_names():
    assert mixed_precision_dtype(None) is None
    assert mixed_precision_dtype("bf16") is torch.bfloat16 and mixed_precision_dtype("BF16") is torch.bfloat16
