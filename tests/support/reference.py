"""Single-process side of the equivalence tests: reference training and the comparison.

:func:`reference_train` trains the unparallelized model, :func:`assert_equivalent`
compares it with what the parallel run produced (the bounds every equivalence test
uses), :func:`make_batches` and :data:`OPTIMIZERS` give both sides identical inputs, and
:func:`next_token_loss` is the loss they share.  The bounds (``LOSS_ATOL``, ``PARAM_ATOL``)
are defined once, in autopar/verification/compare.py, by which ``autopar verify`` judges
too.  Nothing here starts a process or a process group; the multi-rank worker pool is
``tests/support/harness.py``, which re-exports these names so ``from tests.support.harness import
make_batches`` keeps working.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

# The bounds and the difference are product code (``autopar verify`` judges by the same numbers).
from autopar.verification.compare import LOSS_ATOL, PARAM_ATOL
from autopar.verification.compare import max_abs_diff as _max_abs_diff
from autopar.verification.sources import next_token_loss  # the one definition (product code)

__all__ = [
    "OPTIMIZERS",
    "next_token_loss",
    "make_batches",
    "reference_train",
    "assert_equivalent",
    "state_differences",
    "assert_no_differences",
]

OPTIMIZERS: dict[str, Callable] = {
    # Plain SGD keeps updates proportional to the gradient, so a gradient off by a
    # factor (a missing 1/dp) shows; AdamW is scale-invariant but has sharded state
    # (ZeRO) and a weight-decay path.  Both rates move tiny models by >> param_atol.
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1),
}


def make_batches(vocab_size: int, batch: int, seq: int, num_steps: int,
                 seed: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    """``num_steps`` batches of ``((input_ids,), target)``, target = input shifted by one.

    Tokens are uniform in ``[0, vocab_size)``, int64, from a private generator.
    """
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_steps):
        tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen, dtype=torch.int64)
        out.append(((tokens[:, :-1].clone(),), tokens[:, 1:].clone()))
    return out


def reference_train(build_model: Callable[[], torch.nn.Module], batches, loss_fn: Callable,
                    make_optimizer: Callable, example_kwargs: dict | None = None,
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train the unparallelized model one optimizer step per batch.

    ``build_model`` must be deterministic (seed inside it) and return the model in the
    mode the parallel run uses (disable dropout for equivalence tests).  Returns the
    loss of every step and CPU clones of the final state dict.
    """
    kwargs = dict(example_kwargs or {})
    model = build_model()
    optimizer = make_optimizer(model.parameters())
    losses: list[float] = []
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(*inputs, **kwargs), target)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return losses, state


def assert_equivalent(ref: tuple[list[float], dict], got: tuple[list[float], dict], *,
                      loss_atol: float = LOSS_ATOL, param_atol: float = PARAM_ATOL,
                      num_worst: int = 5) -> None:
    """Assert two ``(losses, state_dict)`` results match; list what differs if not.

    Losses are compared step by step (absolute tolerance ``loss_atol``); state dicts
    must have the same keys, shapes and dtypes, and every tensor's max absolute
    difference must be within ``param_atol`` (integer tensors must be equal).
    """
    ref_losses, ref_state = ref
    got_losses, got_state = got
    problems: list[str] = []

    if len(ref_losses) != len(got_losses):
        problems.append(f"loss count: reference has {len(ref_losses)} steps, got {len(got_losses)}")
    bad_steps = []
    for step, (a, b) in enumerate(zip(ref_losses, got_losses)):
        a, b = float(a), float(b)
        if not (abs(a - b) <= loss_atol):  # written so NaN fails
            bad_steps.append(f"step {step}: reference {a:.8g}, got {b:.8g}, |diff| {abs(a - b):.3g}")
    if bad_steps:
        problems.append(f"losses differ beyond {loss_atol:g} at {len(bad_steps)} step(s):\n    "
                        + "\n    ".join(bad_steps))

    problems += state_differences(ref_state, got_state, atol=param_atol, num_worst=num_worst)
    if problems:
        raise AssertionError("results are not equivalent:\n  " + "\n  ".join(problems))


def state_differences(ref_state: dict, got_state: dict, *, atol: float = 0.0, num_worst: int = 5) -> list[str]:
    """What differs between two state dicts, one line per kind of difference; empty when none does.

    Keys missing or unexpected (named), shapes and dtypes, and the tensors whose max absolute
    difference exceeds ``atol`` (``0.0``: bit for bit; integer tensors must be equal), the
    ``num_worst`` largest named with their difference.  Lines are plain strings, so a job can
    return them from its ranks.
    """
    problems: list[str] = []
    missing = sorted(set(ref_state) - set(got_state))
    extra = sorted(set(got_state) - set(ref_state))
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if extra:
        problems.append(f"unexpected keys ({len(extra)}): {', '.join(extra)}")
    diffs: list[tuple[float, str]] = []
    common = sorted(set(ref_state) & set(got_state))
    for key in common:
        a = ref_state[key].detach().cpu()
        b = got_state[key].detach().cpu()
        if a.shape != b.shape:
            problems.append(f"shape of {key}: reference {tuple(a.shape)}, got {tuple(b.shape)}")
        elif a.dtype != b.dtype:
            problems.append(f"dtype of {key}: reference {a.dtype}, got {b.dtype}")
        else:
            diff = _max_abs_diff(a, b)
            if not (diff <= atol):  # written so NaN differs
                diffs.append((diff, key))
    if diffs:
        diffs.sort(key=lambda d: (-d[0], d[1]))
        worst = "\n    ".join(f"{key}: max |diff| {d:.3g}" for d, key in diffs[:num_worst])
        more = f"\n    ... and {len(diffs) - num_worst} more" if len(diffs) > num_worst else ""
        problems.append(f"{len(diffs)} of {len(common)} tensors differ beyond {atol:g}; worst:\n    {worst}{more}")
    return problems


def assert_no_differences(per_rank: list[list[str]]) -> None:
    """Every rank's report of what differed (a job's list of lines, e.g. from
    :func:`state_differences`) is empty; else fail with the lines, rank by rank."""
    bad = [f"rank {rank}:\n  " + "\n  ".join(lines) for rank, lines in enumerate(per_rank) if lines]
    assert not bad, "\n".join(bad)
