"""The flat, fused optimizer step (autopar/runtime/gradients/fused_step.py) on one process.

The step over flat buffers must equal the per-tensor step of the same optimizer for every
class on the element-wise allow-list (param groups with their own hyper-parameters
included); anything else keeps the per-tensor step; the state sliced per name and loaded
back is the same; and a one-rank program with ``fused_optimizer=True`` trains as one with
``False`` (fp32 and bf16: per tensor, fused), with the same checkpoint state and a working
lr scheduler.
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.runtime.gradients import fused_step
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import make_batches

FACTORIES = {
    "adam": functools.partial(torch.optim.Adam, lr=1e-2, weight_decay=0.05, amsgrad=True),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=0.1, lr_decay=0.01),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-2, momentum=0.5, centered=True),
}


def _tensors(seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}


def _grads(step: int, shapes):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _per_group(factory):
    """A factory giving "b" its own group with other hyper-parameters."""
    def make(params):
        params = list(params)
        return factory([{"params": [params[0], params[2]]}, {"params": [params[1]], "lr": 3e-3}])
    return make


@pytest.mark.parametrize("groups", [False, True], ids=["one_group", "two_groups"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_flat_step_equals_the_per_tensor_step(name, groups):
    factory = _per_group(FACTORIES[name]) if groups else FACTORIES[name]
    ref, mine = _tensors(0), _tensors(0)
    ref_opt = factory(list(ref.values()))
    probe = factory(list(mine.values()))
    name_of = {id(p): n for n, p in mine.items()}
    layout = [[name_of[id(p)] for p in g["params"]] for g in probe.param_groups]
    flat = fused_step.FlatParams(mine, layout)
    opt = fused_step.flat_optimizer(probe, [[t for t, gi in zip(flat.flats, flat.group_of) if gi == i]
                                            for i in range(len(layout))])
    assert type(opt) is type(probe) and len(opt.param_groups) == len(probe.param_groups)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in probe.param_groups]
    assert all(g.get("fused") is fused_step.ELEMENTWISE[type(probe)] or not fused_step.ELEMENTWISE[type(probe)]
               for g in opt.param_groups)
    for step in range(3):
        grads = _grads(step, {n: p.shape for n, p in ref.items()})
        for n in ref:
            ref[n].grad = grads[n].clone()
            mine[n].grad.copy_(grads[n])  # a view of the flat gradient
        ref_opt.step()
        flat.collect_grads()
        opt.step()
        flat.zero_grads()
    for n in ref:
        torch.testing.assert_close(mine[n].detach(), ref[n].detach(), atol=1e-6, rtol=1e-6)
    state = flat.state_by_name(opt)
    for n, p in ref.items():
        for key, value in ref_opt.state[p].items():
            torch.testing.assert_close(state[n][key].float(), value.float(), atol=1e-6, rtol=1e-6)
    # Loaded into a fresh flat optimizer: the same state, per name.
    again = _tensors(1)
    probe2 = factory(list(again.values()))
    flat2 = fused_step.FlatParams(again, layout)
    opt2 = fused_step.flat_optimizer(probe2, [[t for t, gi in zip(flat2.flats, flat2.group_of) if gi == i]
                                              for i in range(len(layout))])
    flat2.load_state(opt2, {n: {k: v.clone() for k, v in e.items()} for n, e in state.items()})
    state2 = flat2.state_by_name(opt2)
    for n in state:
        for key in state[n]:
            assert torch.equal(state2[n][key].cpu(), state[n][key].cpu()), (n, key)


def test_values_and_gradients_are_views_of_the_flat_buffer():
    named = _tensors(0)
    before = {n: p.detach().clone() for n, p in named.items()}
    flat = fused_step.FlatParams(named, [["c", "a", "b"]])
    assert len(flat.flats) == 1 and flat.flats[0].numel() == sum(p.numel() for p in before.values())
    for n, p in named.items():
        assert torch.equal(p.detach(), before[n])
        assert p.untyped_storage().data_ptr() == flat.flats[0].untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == flat.grads[0].untyped_storage().data_ptr()
    assert flat.grad_span(["a", "b"]) is not None and flat.grad_span(["b", "a"]) is None
    assert flat.grad_span(["c", "a"]).numel() == 8 + 12


def test_other_optimizers_keep_their_own_step():
    class Mine(torch.optim.SGD):  # a subclass may change the update: not flattened
        pass

    for factory in (functools.partial(Mine, lr=0.1), functools.partial(torch.optim.Adamax, lr=0.1)):
        make = fused_step.flat_factory(factory)
        params = list(_tensors(0).values())
        opt = make(params)
        assert type(opt) is not None and opt.param_groups[0]["params"] == params
        assert not opt.defaults.get("fused")


def test_flat_factory_fuses_flat_shards_and_keeps_explicit_choices():
    shards = [torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(4))]
    opt = fused_step.flat_factory(FACTORIES["adamw"])(shards)
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["weight_decay"] == 0.1
    assert opt.param_groups[0]["params"] == shards
    off = fused_step.flat_factory(FACTORIES["adamw"], enabled=False)(shards)
    assert not off.param_groups[0]["fused"]
    explicit = fused_step.flat_factory(functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True))(shards)
    assert explicit.param_groups[0]["foreach"] is True and not explicit.param_groups[0]["fused"]


# (loss rel, state atol) of the flat step against the per-tensor one.  torch's fused CPU AdamW orders
# its fp32 arithmetic differently from the per-tensor step (a few ulps of a master, by the CPU's
# vector width): in fp32 that stays within 1e-6.  Under bf16 a master an ulp apart can round to the
# neighbouring bf16 value, and Adam turns the gradients' resulting tiny differences into steps of
# +-lr: measured on an AVX-512 EPYC, 3.3e-5 of the third loss and 3.7e-3 (three steps of lr) on a few
# embedding entries; tests/dist/test_precision.py bounds the bf16 recipe the same way (1e-2).
_TOLERANCE = {None: (1e-6, 1e-6), "bf16": (1e-4, 1e-2)}


def _program(fused: bool, mixed_precision=None, scheduler=None):
    model, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="none",
                             loss_fn=loss_fn, optimizer=FACTORIES["adamw"], mixed_precision=mixed_precision,
                             lr_scheduler=scheduler, fused_optimizer=fused)
    return pm, batches


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_one_rank_program_equals_the_per_tensor_step(mixed_precision):
    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    runs = []
    for fused in (True, False):
        pm, batches = _program(fused, mixed_precision, scheduler)
        losses = [pm.train_step(*b) for b in batches]
        runs.append((pm, losses))
    (flat, flat_losses), (plain, plain_losses) = runs
    # One rank, no data-parallel buckets: the gradients are not kept between steps, so the
    # optimizer stays per tensor, fused (a flat gradient would live all step).
    assert flat.grad_sync.flat is None and plain.grad_sync.flat is None
    assert len(flat.optimizer.param_groups[0]["params"]) > 1 and flat.optimizer.param_groups[0]["fused"]
    assert not plain.optimizer.param_groups[0]["fused"]
    assert flat.optimizer.param_groups[0]["lr"] == plain.optimizer.param_groups[0]["lr"] == 1e-2 / 8
    loss_rel, state_atol = _TOLERANCE[mixed_precision]
    assert flat_losses == pytest.approx(plain_losses, rel=loss_rel)
    a, b = flat.state_dict(), plain.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=state_atol, rtol=0)
    ca, cb = flat.checkpoint_state(), plain.checkpoint_state()
    assert ca.keys() == cb.keys() and any(k.startswith("optim.") for k in ca)
    for key in ca:
        if key != "sched.state":
            torch.testing.assert_close(ca[key].float(), cb[key].float(), atol=state_atol, rtol=0)
    assert flat.memory_report() == plain.memory_report()


def _decay_groups(params):
    """AdamW with no weight decay on 1-D tensors (norms): two param groups of other hyper-parameters."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1]},
                              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
                             lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_flat_layout_with_param_groups_equals_the_per_tensor_step(monkeypatch, mixed_precision):
    """The flat layout a dp >= 2 rank uses, forced on one rank: per param group, with a scheduler;
    the same training, state dict and checkpoint state as the per-tensor step, and its checkpoint
    state loads back exactly (into a flat program and a per-tensor one)."""
    from autopar.runtime.weights import state as module_state
    from autopar.runtime.gradients.grad_sync import GradSync

    scheduler = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)
    _, loss_fn, kwargs = build("example", {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)

    def program(fused: bool, seed: int = 0):
        with monkeypatch.context() as m:
            m.setattr(GradSync, "_keeps_grads", lambda self: True)
            return autopar.parallelize(build("example", {}, seed)[0], example_inputs=batches[0][0],
                                       example_kwargs=kwargs, plan="none", loss_fn=loss_fn,
                                       optimizer=_decay_groups, mixed_precision=mixed_precision,
                                       lr_scheduler=scheduler, fused_optimizer=fused)

    flat, plain = program(True), program(False)
    assert flat.grad_sync.flat is not None and len(flat.optimizer.param_groups) == 2
    assert [len(g["params"]) for g in flat.optimizer.param_groups] == [1, 1]
    assert [g["weight_decay"] for g in flat.optimizer.param_groups] == [0.1, 0.0]
    loss_rel, state_atol = _TOLERANCE[mixed_precision]
    for b in batches:
        assert flat.train_step(*b) == pytest.approx(plain.train_step(*b), rel=loss_rel)
    a, b = flat.state_dict(), plain.state_dict()
    for key in b:
        torch.testing.assert_close(a[key], b[key], atol=state_atol, rtol=0)
    saved = flat.checkpoint_state()
    other = plain.checkpoint_state()
    assert saved.keys() == other.keys()
    for key in saved:
        if key != "sched.state":
            torch.testing.assert_close(saved[key].float(), other[key].float(), atol=state_atol, rtol=0)
    for fused in (True, False):
        fresh = program(fused, seed=5)
        module_state.load_checkpoint_state(fresh, saved)
        again = fresh.checkpoint_state()
        for key in saved:
            assert torch.equal(again[key], saved[key]), (fused, key)
        assert fresh.optimizer.param_groups[0]["lr"] == flat.optimizer.param_groups[0]["lr"]
        fresh.train_step(*batches[0])  # the loaded state steps (fused: its step counter on the device)
