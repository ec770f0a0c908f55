"""Checkpoints written before issue 39's ZeRO rewrite load under today's runtime.

tests/fixtures/zero_checkpoints/ holds checkpoints that autopar at commit 4ee387b (the ZeRO runtime
of ``zero_units`` / ``zero_grads`` / ``zero_params``) wrote after two AdamW steps of the example
decoder on 2 gloo ranks, with the checkpoint state it held and the loss of its next step
(tests/fixtures/make_zero_checkpoints.py says how).  Loaded under the same plan today, each gives
back exactly the state that was saved, and the next step's loss equals the old runtime's (fp32
within the equivalence bound; bf16 within the bf16 recipe's).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopar.verification.compare import LOSS_ATOL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zero_checkpoints"
CASES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def load_job(case: str) -> dict:
    """Load the case's checkpoint into a fresh program of its plan; the state and the next step's loss."""
    import autopar
    from tests.fixtures.make_zero_checkpoints import SIZES
    from tests.support.harness import OPTIMIZERS, make_batches
    from tests.support.jobs import VOCAB, build

    expected = torch.load(FIXTURES / case / "expected.pt")
    model, loss_fn, kwargs = build("example", SIZES, seed=3)  # other weights: the load must replace them
    batches = make_batches(VOCAB, 4, 16, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=expected["plan"],
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], mixed_precision=expected["mixed"])
    pm.load(FIXTURES / case / "checkpoint")
    state = {k: v.detach().cpu().clone() for k, v in pm.checkpoint_state().items()}
    return {"state": state, "next_loss": pm.train_step(*batches[2])}


def test_fixtures_exist():
    assert CASES == ["dp2_zero1", "dp2_zero2", "dp2_zero3_bf16"]


@pytest.mark.parametrize("case", CASES)
def test_old_zero_checkpoint_loads(dist_pool, case):
    expected = torch.load(FIXTURES / case / "expected.pt")
    results = dist_pool(load_job, case, world=2)
    # Each rank writes its share of the checkpoint (``writes``): the union is the checkpoint.
    state = {k: v for r in results for k, v in r["state"].items()}
    # A checkpoint written before the resume entries existed (``train.*``, ``rng.*``) loads as a
    # fresh run's: step 0; the weights and the optimizer state are the saved ones, bit for bit.
    extra = state.keys() - expected["state"].keys()
    assert extra and all(k.startswith(("train.", "rng.")) for k in extra), sorted(extra)
    assert int(state["train.step"]) == 0
    assert expected["state"].keys() <= state.keys(), sorted(expected["state"].keys() - state.keys())
    for key, value in expected["state"].items():
        assert torch.equal(state[key], value), key
    for r in results:
        if expected["mixed"]:
            assert r["next_loss"] == pytest.approx(expected["next_loss"], rel=2e-3)
        else:
            assert abs(r["next_loss"] - expected["next_loss"]) <= LOSS_ATOL
