"""``autopar.verify``: prove a plan on a shrunk copy of the user's architecture, on the CPU.

:func:`verify` resolves and shrinks the model (:mod:`autopar.verification.sources`,
:mod:`autopar.verification.shrink`), builds it once here for the initial weights, starts the
plan's ranks as gloo processes (:mod:`autopar.verification.launch`, each rank
:mod:`autopar.verification.worker`), trains the unparallelized model in this process on the
same batches with the same optimizer meanwhile, and compares the two
(:mod:`autopar.verification.compare`): each step's loss, the gradients of step 1 (under
SGD), and every tensor of the state dict after ``parallelize`` and after every step.
``autopar verify`` (autopar/cli/verify_cmd.py) is the command-line face of it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import tempfile
from typing import Callable, Iterator

import torch

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.verification.compare import VerifyResult, compare
from autopar.verification.launch import DEFAULT_TIMEOUT_S, start_ranks, stop_ranks, wait_ranks
from autopar.verification.sources import (OPTIMIZERS, SGD_LR, batch_shape, make_batches, next_token_loss,
                                          resolve_source, seeded_steps, vocab_size)

__all__ = ["verify"]

# The testing hook, out of the public signature: the name of a parameter whose gradient one rank
# doubles, to see verify report the difference (``autopar verify --corrupt NAME``, which
# tests/e2e/test_verify.py runs).  Set only through :func:`_corrupting`.
_CORRUPT: contextvars.ContextVar[str | None] = contextvars.ContextVar("autopar_verify_corrupt", default=None)


@contextlib.contextmanager
def _corrupting(name: str | None) -> Iterator[None]:
    """Within the block, :func:`verify` doubles parameter ``name``'s gradient on one rank (None: not)."""
    token = _CORRUPT.set(name)
    try:
        yield
    finally:
        _CORRUPT.reset(token)


def _plan(plan: str | Plan, world_size: int | None) -> tuple[Plan, int]:
    if isinstance(plan, str) and plan.strip().lower() == "auto":
        raise AutoparError("autopar: verify checks a given plan, not plan='auto'; write the plan out, e.g. the "
                           "one `autopar plan` or pm.plan printed (--plan tp=2,sp,dp=2).")
    p = Plan.parse(plan)
    world_size = p.world_size if world_size is None else world_size
    p.validate(world_size=world_size)
    return p, world_size


def _reference_beside(procs, model, kwargs, batches, optimizer: str, seed: int):
    """The one-process run, trained while the ranks start up; the ranks stopped if it fails."""
    try:
        return _reference(model, kwargs, batches, optimizer, seed=seed)
    except Exception as exc:
        stop_ranks(procs)
        if isinstance(exc, AutoparError):
            raise
        raise AutoparError(f"autopar: the model does not train on one process ({type(exc).__name__}: {exc}); "
                           "verify compares the plan against that run, so it expects a model whose forward "
                           "and backward run on token ids alone: fix the model or its config, or pass a "
                           "MODULE:FUNCTION that returns the inputs it needs.") from exc
    except BaseException:
        stop_ranks(procs)
        raise


def _reference(model: torch.nn.Module, kwargs: dict, batches, optimizer: str, parts: int = 1, *,
               seed: int = 0) -> dict:
    """Single-process training of ``model`` (modified): losses, state dicts (step 0..K), step 1's gradients.

    ``parts > 1``: each batch's rows in ``parts`` equal slices, each slice's mean loss over
    ``parts`` back-propagated on its own and the gradients summed -- the same mean, reduced in the
    order a data-parallel or micro-batched program reduces it (targets without padding).  The steps
    draw from the default generator seeded with ``seed``, as the ranks' do (``sources.seeded_steps``)."""
    with seeded_steps(seed):
        return _train(model, kwargs, batches, optimizer, parts)


def _train(model: torch.nn.Module, kwargs: dict, batches, optimizer: str, parts: int) -> dict:
    opt = OPTIMIZERS[optimizer](model.parameters())
    states = [_cpu(model.state_dict())]
    losses, grads = [], {}
    for step, (inputs, target) in enumerate(batches):
        opt.zero_grad()
        if parts == 1:
            loss = next_token_loss(model(*inputs, **kwargs), target)
            loss.backward()
        else:
            loss = _split_backward(model, inputs, kwargs, target, parts)
        if step == 0:
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                     for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
        states.append(_cpu(model.state_dict()))
    return {"losses": losses, "states": states, "grads": grads}


def _split_backward(model: torch.nn.Module, inputs: tuple, kwargs: dict, target: torch.Tensor,
                    parts: int) -> torch.Tensor:
    rows = target.shape[0] // parts

    def part(x, i):  # a batch-first tensor of the batch's rows; anything else as is
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == target.shape[0]:
            return x[i * rows:(i + 1) * rows]
        return x

    total = torch.zeros(())
    for i in range(parts):
        loss = next_token_loss(model(*(part(x, i) for x in inputs), **{k: part(v, i) for k, v in kwargs.items()}),
                               part(target, i)) / parts
        loss.backward()
        total = total + loss.detach()
    return total


def _cpu(state: dict) -> dict:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def verify(model: str | os.PathLike, plan: str | Plan, *, world_size: int | None = None, layers: int | None = None,
           steps: int = 3, seed: int = 0, optimizer: str = "sgd", global_batch: int | None = None,
           seq_len: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
           log: Callable[[str], None] | None = None) -> VerifyResult:
    """Train ``model`` under ``plan`` on ``world_size`` CPU gloo processes and on one process; compare.

    ``model``: a preset (``llama3-70b``), a transformers model type (``qwen2``), a ``config.json``
    path or ``MODULE:FUNCTION`` (returning a model, or ``(model, example_inputs[, example_kwargs])``).
    Configs are shrunk to ``layers`` decoder layers (default: 2, or the plan's pipeline chunks)
    and small widths that the plan still splits.  ``steps`` optimizer steps of ``optimizer``
    (``sgd``: lr 0.1, gradients compared too; ``adamw``) on batches of ``global_batch`` x ``seq_len``
    random tokens (defaults fit the plan) from ``seed``.  ``log`` receives progress lines
    (what was shrunk, the run's shape).

    Returns a :class:`~autopar.verification.compare.VerifyResult` (``.ok``, ``.report()``);
    raises :class:`~autopar.errors.AutoparError` when the plan is refused for this model, and
    :class:`~autopar.verification.launch.RankFailure` when a rank crashes.
    """
    say = log or (lambda line: None)
    corrupt = _CORRUPT.get()  # the testing hook (:func:`_corrupting`); None outside it
    p, world = _plan(plan, world_size)
    if optimizer not in OPTIMIZERS:
        raise AutoparError(f"autopar: unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}.")
    if steps < 1:
        raise AutoparError(f"autopar: --steps {steps}; expected at least 1 optimizer step.")
    batch, seq = batch_shape(p, global_batch, seq_len)
    source = resolve_source(model, p, layers, seq)
    for note in source.notes:
        say(f"shrunk: {note}" if " -> " in note else f"note: {note}")
    with torch.random.fork_rng(devices=[]):  # the caller's random state stays as it was
        reference_model, kwargs = source.build(seed)
    init = _cpu(reference_model.state_dict())
    if corrupt is not None and corrupt not in dict(reference_model.named_parameters()):
        names = [n for n, _ in reference_model.named_parameters()]
        raise AutoparError(f"autopar: --corrupt {corrupt} is not a parameter of the model; expected one of "
                           f"{', '.join(names[:6])}{', ...' if len(names) > 6 else ''}.")
    vocab = vocab_size(reference_model)
    batches = make_batches(vocab, batch, seq, steps, seed)
    say(f"verifying plan '{p}' on {world} gloo ranks against one process: {steps} steps of {optimizer}, "
        f"batch {batch} x {seq} tokens, vocabulary {vocab}, seed {seed}")
    job = dict(source=source, plan=str(p), seed=seed, vocab=vocab, batch=batch, seq=seq, steps=steps,
               optimizer=optimizer, corrupt=corrupt)
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as workdir:
        torch.save(job, os.path.join(workdir, "job.pt"))
        torch.save(init, os.path.join(workdir, "init.pt"))
        procs = start_ranks(workdir, world)
        ref = _reference_beside(procs, reference_model, kwargs, batches, optimizer, seed)
        got = wait_ranks(procs, workdir, timeout)
    corrupted = (f"gradient of {corrupt} doubled on rank {got['corrupted_rank']} (--corrupt)"
                 if corrupt is not None else None)
    return compare(ref, got, lr=SGD_LR if optimizer == "sgd" else None, model=str(model), plan=str(p),
                   world_size=world, steps=steps, global_batch=batch, seq_len=seq, optimizer=optimizer, notes=source.notes,
                   corrupted=corrupted)
