"""``parallelize(..., compile=...)`` trains like the eager program, in one process.

With ``aot_eager`` bitwise (the same aten ops; recomputed regions compiled and recomputed as the eager
ones), and with torch.compile's default backend, Inductor, which generates C++ on this CPU (Triton
kernels on GPUs), within floating-point reassociation, recomputed regions included (each body
compiled on its own).  Multi-rank checks with ``aot_eager`` (pipelines under every schedule too):
tests/dist/test_compile.py; the argument's checks: tests/unit/test_compile.py."""
from __future__ import annotations

import pytest
import torch

import autopar
from tests.support.harness import OPTIMIZERS, assert_equivalent
from tests.support.jobs import build
from tests.support.reference import make_batches


def train(compile, model_name: str = "hf_llama", mixed_precision: str | None = None, plan: str = "none",
          overrides: dict | None = None):
    """3 AdamW steps of ``model_name`` under ``plan``: the program and its losses."""
    model, loss_fn, kwargs = build(model_name, overrides or {})
    batches = make_batches(128, 4, 16, 3, seed=1)
    torch.manual_seed(7)  # the dropout streams' base seed, the same for every run
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], compile=compile,
                             mixed_precision=mixed_precision)
    return pm, [pm.train_step(*b) for b in batches]


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_aot_eager_runs_the_eager_programs_ops(mixed_precision):
    """AOTAutograd without a code generator: the same aten ops, so bitwise the same training
    (under bf16 too: fp32 masters and main gradients around the compiled bf16 program)."""
    eager, eager_losses = train(False, mixed_precision=mixed_precision)
    compiled, losses = train({"backend": "aot_eager"}, mixed_precision=mixed_precision)
    assert losses == eager_losses
    want, got = eager.state_dict(), compiled.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert compiled.code() == eager.code()  # the printed program is the rewritten graph, untouched


@pytest.mark.parametrize("plan", ["recompute=selective", "recompute=full"])
def test_recomputed_regions_compile_and_recompute_like_the_eager_program(plan):
    """Each region's body compiled on its own under an eager checkpoint: the eager training with
    dropout on (the recomputation draws the forward's masks), as many regions recomputed, and
    the recompute working set still metered."""
    dropout = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "mlp_dropout": 0.1}
    eager, eager_losses = train(False, "example", plan=plan, overrides=dropout)
    compiled, losses = train({"backend": "aot_eager"}, "example", plan=plan, overrides=dropout)
    assert losses == eager_losses  # another mask would show at once
    want, got = eager.state_dict(), compiled.state_dict()
    # The dropout calls and the regions run eagerly: their graph breaks can change the order in
    # which a tensor's gradients add up (autopar/runtime/stepping/inductor.py, Numerics).
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
    counters = [pm.step_context.counters["recomputed_regions"] for pm in (eager, compiled)]
    assert counters[0] == counters[1] > 0
    assert compiled.memory._working_peak > 0  # the recomputations' working set, metered inside the checkpoint
    assert compiled.code() == eager.code()




def test_inductor_trains_like_eager():
    """The suite's bounds (loss 1e-5, parameters 1e-4 after 3 AdamW steps, fp32)."""
    eager, want = train(False, "example")
    compiled, got = train(True, "example")
    assert_equivalent((want, eager.state_dict()), (got, compiled.state_dict()))


def test_inductor_compiles_recomputed_regions():
    """``recompute=full``: each layer's body compiled by Inductor on its own, run again in backward."""
    one_layer = {"num_layers": 1}  # one body to compile
    eager, want = train(False, "example", plan="recompute=full", overrides=one_layer)
    compiled, got = train(True, "example", plan="recompute=full", overrides=one_layer)
    assert_equivalent((want, eager.state_dict()), (got, compiled.state_dict()))
    assert compiled.step_context.counters["recomputed_regions"] == eager.step_context.counters["recomputed_regions"]
