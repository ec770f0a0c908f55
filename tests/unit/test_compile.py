"""``parallelize(..., compile=...)`` in one process (autopar/runtime/stepping/inductor.py): the argument's
checks, and a compiled program that computes what the eager one does.  Multi-rank plans:
tests/dist/test_compile.py."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.compat import storage_key
from autopar.errors import AutoparError
from tests.support.harness import OPTIMIZERS
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


@pytest.mark.parametrize("value, plan, message", [
    ("yes", "none", "compile='yes'; expected False, True or a dict"),
    ({"backend": "aot_eager", "fullgraf": True}, "none", "has 'fullgraf', which torch.compile does not take"),
])
def test_bad_compile_arguments_are_refused_before_tracing(value, plan, message):
    model, loss_fn, kwargs = build("example", {})
    ids = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(AutoparError) as info:
        autopar.parallelize(model, example_inputs=(ids,), plan=plan, loss_fn=loss_fn, compile=value)
    assert str(info.value).startswith("autopar: ") and message in str(info.value)


def test_storage_key_names_every_alias_of_a_buffer():
    """The saved-tensor hooks find a gathered buffer from what autograd saves: a view of it, or
    (a compiled forward) a fresh alias of its storage; another tensor, even equal, is not it."""
    buffer = torch.arange(12.0)
    key = storage_key(buffer)
    assert storage_key(buffer.view(3, 4)[1:]) == key and storage_key(buffer.detach()) == key
    assert storage_key(buffer.clone()) != key
    meta = torch.empty(4, device="meta")
    assert storage_key(meta.view(2, 2)) == storage_key(meta) != storage_key(torch.empty(4, device="meta"))
