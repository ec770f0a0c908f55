"""What the graph proves about the loss's reduction (autopar/frontend/loss.py), and the
runtime's refusal of a padded batch it cannot normalise (one process, ``mb=2``)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from tests.support.models import MODELS, make_batch


def _reduction(loss_fn):
    factory, _, kwargs = MODELS["example"]
    ids, target = make_batch(128, 2, 8, seed=0)
    return analyze(trace_model(factory(), (ids,), kwargs, loss_fn, target).gm).loss_reduction


def test_plain_mean_cross_entropy_is_a_token_mean():
    r = _reduction(lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
    assert r.token_mean and r.ignore_index == -100
    r = _reduction(lambda out, t: F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1), ignore_index=0))
    assert r.token_mean and r.ignore_index == 0


def test_summed_cross_entropy_is_a_token_sum():
    r = _reduction(lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum"))
    assert r.kind == "token_sum" and not r.token_mean


@pytest.mark.parametrize("loss_fn,why", [
    (lambda out, t: 2.0 * F.cross_entropy(out.flatten(0, 1), t.flatten()), "not a cross-entropy node"),
    (lambda out, t: F.cross_entropy(out.flatten(0, 1), (t + 1).flatten() % 128), "is computed"),
    (lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), weight=torch.ones(128)), "class weights"),
])
def test_other_losses_are_opaque(loss_fn, why):
    r = _reduction(loss_fn)
    assert not r.token_mean and why in r.reason
    assert r.cross_entropy_ignore == -100  # a cross-entropy with an ignore_index is in the graph


def test_a_padded_batch_an_opaque_loss_cannot_split_is_refused():
    factory, _, kwargs = MODELS["example"]
    ids, target = make_batch(128, 4, 8, seed=0)
    pm = autopar.parallelize(factory(), example_inputs=(ids,), example_kwargs=kwargs, plan="mb=2",
                             loss_fn=lambda out, t: 2.0 * F.cross_entropy(out.flatten(0, 1), t.flatten()))
    pm.train_step((ids,), target)  # no ignored targets: equal pieces, exact
    padded = target.clone()
    padded[0, 3:] = -100
    with pytest.raises(AutoparError, match=r"^autopar: the targets of this batch contain ignore_index=-100, and "
                                           r"the loss cannot be split over ranks exactly \(the loss is "):
        pm.train_step((ids,), padded)


def test_one_process_padded_microbatches_equal_the_whole_batch():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, target = make_batch(128, 4, 8, seed=0)
    target[0, 2:] = -100
    target[3, 7:] = -100
    model = factory()
    expected = float(loss_fn(model(ids), target))
    pm = autopar.parallelize(model, example_inputs=(ids,), example_kwargs=kwargs, plan="mb=4", loss_fn=loss_fn,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    assert pm.eval_step((ids,), target) == pytest.approx(expected, abs=1e-6)
    assert pm.train_step((ids,), target) == pytest.approx(expected, abs=1e-6)


def test_one_process_summed_loss_over_microbatches_is_the_sum():
    factory, _, kwargs = MODELS["example"]
    ids, target = make_batch(128, 4, 8, seed=0)
    target[1, 5:] = -100
    model = factory()
    summed = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum")  # noqa: E731
    expected = float(summed(model(ids), target))
    pm = autopar.parallelize(model, example_inputs=(ids,), example_kwargs=kwargs, plan="mb=2", loss_fn=summed,
                             optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    assert pm.train_step((ids,), target) == pytest.approx(expected, rel=1e-6)
