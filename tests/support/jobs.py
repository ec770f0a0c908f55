"""Per-rank jobs for the multi-rank tests (run on every rank by tests/support/harness.py).

Not a test module: each function here builds a model on every rank from the same seed,
compiles it with ``autopar.parallelize`` for a plan, trains on the harness's batches and
returns picklable results (losses, the full state dict from rank 0, comm records).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches, reference_train
from tests.support.models import MODELS
from tests.support.reference import state_differences
from tests.support.wire import guard_program

__all__ = ["build", "reference", "fresh_program", "load_problems", "train_job", "train_cases_job", "compile_cases_job",
           "roundtrip_job", "load_original_job", "untouched_job", "auto_job", "BATCH", "SEQ", "VOCAB"]

BATCH, SEQ, VOCAB = 4, 16, 128


def build(model_name: str, overrides: dict, seed: int = 0):
    factory, loss_fn, kwargs = MODELS[model_name]
    return factory(seed=seed, **overrides), loss_fn, kwargs


@functools.lru_cache(maxsize=None)
def reference(model_name: str, opt_name: str, overrides: tuple):
    """Single-process training on the batches every job uses: (losses, state dict); cached
    per (model, optimizer, sorted override items)."""
    _, loss_fn, kwargs = build(model_name, dict(overrides))
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, dict(overrides))[0], batches, loss_fn,
                           OPTIMIZERS[opt_name], kwargs)


def _parallelize(model_name: str, plan: str, opt_name: str, overrides: dict, seed: int = 0, wire: bool = True,
                 **options):
    """The program and the batches; ``wire``: its steps counted by the wire-level guard, so that
    ``comm_stats()`` carries the last step's wire calls (tests/support/wire.py; never under
    ``compile``, whose tracing the counting mode would enter)."""
    model, loss_fn, kwargs = build(model_name, overrides, seed)
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name], **options)
    return (guard_program(pm) if wire and "compile" not in options else pm), batches


def fresh_program(model_name: str, plan: str, opt_name: str, overrides: dict, batch: int = BATCH, **options):
    """``model_name`` compiled for ``plan`` from weights that no trained state holds: seed 5, then 1 added
    to every parameter (the norms' weights too, which every seed starts at 1)."""
    model, loss_fn, kwargs = build(model_name, overrides, seed=5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    (inputs, _), = make_batches(VOCAB, batch, SEQ, 1, seed=1)
    return autopar.parallelize(model, inputs, example_kwargs=kwargs, plan=plan, loss_fn=loss_fn,
                               optimizer=OPTIMIZERS[opt_name], **options)


def load_problems(saved: dict, program) -> list[str]:
    """``program.load_state_dict(saved)`` into a program that holds other weights (:func:`fresh_program`):
    what of its ``state_dict()`` then differs from ``saved`` bit for bit (names, max |diff|:
    :func:`~tests.support.reference.state_differences`); empty when the load is exact.  A program that
    already held ``saved`` is reported too: a load that does nothing would pass there."""
    if not state_differences(saved, program.state_dict()):
        return ["the program already held the saved state before loading: a load that does nothing would pass"]
    program.load_state_dict(saved)
    return [f"after load_state_dict: {line}" for line in state_differences(saved, program.state_dict())]


def train_job(model_name: str, plan: str, opt_name: str, overrides: dict, steps: int = 3):
    """Train ``steps`` steps; the returned comm records are those of the last step, and carry its
    wire calls (the guard of tests/support/wire.py counts that step only)."""
    pm, batches = _parallelize(model_name, plan, opt_name, overrides, wire=False)
    losses = [pm.train_step(inputs, target) for inputs, target in batches[:steps - 1]]
    losses += [guard_program(pm).train_step(inputs, target) for inputs, target in batches[steps - 1:steps]]
    state = pm.state_dict()
    rank = dist.get_rank()
    return {
        "losses": losses,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()} if rank == 0 else None,
        "comm": pm.comm_stats(),
    }


def train_cases_job(cases: list, opt_name: str, steps: int = 3):
    """:func:`train_job` for each ``(model_name, plan, overrides)`` of ``cases`` in one pool call."""
    return [train_job(model_name, plan, opt_name, overrides, steps) for model_name, plan, overrides in cases]


def compile_cases_job(cases: list, opt_name: str, backend: str, steps: int = 3):
    """Each ``(model_name, plan, overrides)`` trained eagerly and with ``compile={"backend": backend}``:
    the compiled run's losses and state, the eager run's losses, and whether both ran the same
    collectives (in any order: a compiled backward may unpack saved tensors in another order),
    recomputed as many regions in the last step and print the same program, and the largest
    difference of their states (``state_diff``)."""
    out = []
    for model_name, plan, overrides in cases:
        runs = []
        for options in ({}, {"compile": {"backend": backend}}):
            torch.manual_seed(7)  # the dropout streams' base seed, the same for both runs
            pm, batches = _parallelize(model_name, plan, opt_name, overrides, **options)
            losses = [pm.train_step(inputs, target) for inputs, target in batches[:steps]]
            runs.append((pm, losses))
        (eager, eager_losses), (compiled, losses) = runs
        state, eager_state = compiled.state_dict(), eager.state_dict()  # collectives under ZeRO-3: every rank
        comm = [sorted(repr(sorted(r.items())) for r in pm.comm_stats()) for pm in (eager, compiled)]
        recomputed = [pm.step_context.counters["recomputed_regions"] for pm in (eager, compiled)]
        out.append({"losses": losses, "eager_losses": eager_losses, "same_comm": comm[0] == comm[1],
                    "same_recomputed": recomputed[0] == recomputed[1], "same_code": eager.code() == compiled.code(),
                    "state_diff": max(float((v - eager_state[k]).abs().max()) for k, v in state.items()),
                    "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None})
    return out


def roundtrip_job(model_name: str, plan: str, overrides: dict) -> list[str]:
    """``state_dict()`` after a training step, loaded into a program of other weights (:func:`load_problems`):
    what differs afterwards, and whether the loaded program's loss on the next batch is the trained
    program's (the program computes with what was loaded).  Lines naming each difference; empty when none."""
    pm, batches = _parallelize(model_name, plan, "adamw", overrides)
    pm.train_step(*batches[0])
    saved = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    loaded = fresh_program(model_name, plan, "adamw", overrides)
    problems = load_problems(saved, loaded)
    want, got = pm.eval_step(*batches[1]), loaded.eval_step(*batches[1])
    if got != want:
        problems.append(f"loss on the next batch: the loaded program {got!r}, the trained one {want!r}")
    return problems


def load_original_job(model_name: str, plan: str, overrides: dict):
    """Load the state dict of another (seed 5) original model; return the first-step loss."""
    pm, batches = _parallelize(model_name, plan, "sgd", overrides)
    other, _, _ = build(model_name, overrides, seed=5)
    pm.load_state_dict(other.state_dict())
    return pm.train_step(*batches[0])


def untouched_job(model_name: str, plan: str, overrides: dict) -> list[str]:
    """parallelize + training leave the user's model exactly as it was (values and .grad): what changed,
    as lines (empty when nothing did)."""
    model, loss_fn, kwargs = build(model_name, overrides)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = make_batches(VOCAB, BATCH, SEQ, 2, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    for inputs, target in batches:
        pm.train_step(inputs, target)
    problems = state_differences(before, model.state_dict())
    with_grads = [n for n, p in model.named_parameters() if p.grad is not None]
    if with_grads:
        problems.append(f"parameters of the user's model with a .grad ({len(with_grads)}): {', '.join(with_grads)}")
    return problems


def auto_job(model_name: str):
    """plan='auto': the cost model picks a plan for this world; train 3 steps with it."""
    model, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="auto",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    losses = [pm.train_step(inputs, target) for inputs, target in batches]
    state = pm.state_dict()  # on every rank: a collective under ZeRO-3, which the plan may choose
    state = state if dist.get_rank() == 0 else None
    return {"plan": str(pm.plan), "losses": losses,
            "state": {k: v.detach().cpu().clone() for k, v in state.items()} if state else None}
