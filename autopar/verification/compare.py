"""The verdict of ``autopar verify``: the bounds, the comparison and the report.

:data:`LOSS_ATOL` and :data:`PARAM_ATOL` are the equivalence bounds of the whole project
(the multi-rank tests use them too, through tests/support/reference.py).  :func:`compare` sets what
the ranks produced against the single-process reference (both from
:mod:`autopar.verification.api`) and returns a :class:`VerifyResult`, whose
:meth:`VerifyResult.report` is what the CLI prints (autopar/cli/verify_cmd.py).
"""
from __future__ import annotations

import dataclasses
import math

import torch

__all__ = ["LOSS_ATOL", "PARAM_ATOL", "VerifyResult", "max_abs_diff", "compare"]

LOSS_ATOL = 1e-5
"""Largest |difference| of a step's loss from the single-process loss (fp32)."""
PARAM_ATOL = 1e-4
"""Largest |difference| of any tensor of the state dict from the single-process one (fp32)."""


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| (in float64); NaN on either side, or unequal integer tensors, give inf."""
    if a.numel() == 0:
        return 0.0
    if a.is_floating_point() or a.is_complex():
        diff = (a.double() - b.double()).abs()
        return math.inf if diff.isnan().any() else float(diff.max())
    return 0.0 if torch.equal(a, b) else math.inf


@dataclasses.dataclass
class VerifyResult:
    """What ``autopar.verify`` found (every difference is a max absolute difference)."""

    model: str
    plan: str
    world_size: int
    steps: int
    global_batch: int
    seq_len: int
    optimizer: str
    notes: list[str]                    # what was shrunk or changed to build the model
    ref_losses: list[float]             # the single process, per step
    losses: list[float]                 # the parallel program, per step
    loss_diffs: list[float]
    worst_grad_diff: float | None       # the gradients of step 1 (None: not recoverable, see grad_note)
    worst_grad_tensor: str | None
    grad_atol: float | None
    worst_param_diff: float             # the parameters after parallelize (step 0) and after each step
    worst_param_tensor: str | None
    worst_param_step: int | None
    problems: list[str]                 # missing or extra tensors, shape or dtype changes
    grad_note: str = ""
    corrupted: str | None = None        # the testing hook: whose gradient was doubled, on which rank
    loss_atol: float = LOSS_ATOL
    param_atol: float = PARAM_ATOL

    @property
    def ok(self) -> bool:
        """Whether the plan trained exactly like one process, within the bounds."""
        grads_ok = self.worst_grad_diff is None or self.worst_grad_diff <= self.grad_atol
        return (not self.problems and all(d <= self.loss_atol for d in self.loss_diffs) and grads_ok
                and self.worst_param_diff <= self.param_atol)

    def report(self) -> str:
        lines = [f"step  reference loss   parallel loss    |diff|"]
        for i, (a, b, d) in enumerate(zip(self.ref_losses, self.losses, self.loss_diffs), start=1):
            flag = "" if d <= self.loss_atol else f"   > {self.loss_atol:g}"
            lines.append(f"{i:>4}  {a:<15.9g}  {b:<15.9g}  {d:.3g}{flag}")
        if self.worst_grad_diff is not None:
            lines.append(f"worst gradient |diff| (step 1): {self.worst_grad_diff:.3g} at {self.worst_grad_tensor} "
                         f"(bound {self.grad_atol:g})")
        else:
            lines.append(f"gradients: {self.grad_note}")
        where = ("after parallelize, before step 1" if self.worst_param_step == 0
                 else f"after step {self.worst_param_step}")
        lines.append(f"worst parameter |diff|: {self.worst_param_diff:.3g} at {self.worst_param_tensor} ({where}; "
                     f"bound {self.param_atol:g})")
        lines += [f"problem: {p}" for p in self.problems]
        if self.corrupted:
            lines.append(f"testing hook: {self.corrupted}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        if self.ok:
            return (f"verdict: EQUAL - plan '{self.plan}' on {self.world_size} ranks trains this model like one "
                    f"process (losses within {self.loss_atol:g}, parameters within {self.param_atol:g}, "
                    f"{self.steps} steps)")
        bad = [f"the loss of step {i}" for i, d in enumerate(self.loss_diffs, start=1) if not d <= self.loss_atol]
        if self.worst_grad_diff is not None and not self.worst_grad_diff <= self.grad_atol:
            bad.append(f"the gradient of {self.worst_grad_tensor}")
        if not self.worst_param_diff <= self.param_atol:
            bad.append(f"the parameter {self.worst_param_tensor}")
        bad += self.problems[:1]
        hint = ("expected: the testing hook corrupted it" if self.corrupted else
                "see docs/troubleshooting.md ('autopar verify reports DIFFERENT') and report it with this output")
        return (f"verdict: DIFFERENT - plan '{self.plan}' does not train like one process: "
                f"{', '.join(bad)} differ beyond the bounds; {hint}.")


def _worst(pairs) -> tuple[float, str | None, int | None]:
    worst = (0.0, None, None)
    for diff, name, step in pairs:
        if worst[1] is None or diff > worst[0] or (math.isinf(diff) and not math.isinf(worst[0])):
            worst = (diff, name, step)
    return worst


def _state_diffs(ref_states: list[dict], states: list[dict], problems: list[str]):
    for step, (ref, got) in enumerate(zip(ref_states, states)):
        if step == 0:
            missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
            if missing:
                problems.append(f"the parallel state dict lacks {', '.join(missing[:5])}")
            if extra:
                problems.append(f"the parallel state dict has unexpected {', '.join(extra[:5])}")
        for name in sorted(set(ref) & set(got)):
            a, b = ref[name], got[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                if step == 0:
                    problems.append(f"{name}: reference {tuple(a.shape)} {a.dtype}, "
                                    f"parallel {tuple(b.shape)} {b.dtype}")
                continue
            yield max_abs_diff(a, b), name, step


def compare(ref: dict, got: dict, *, lr: float | None, **info) -> VerifyResult:
    """``ref``: the reference's ``losses``, ``states`` (step 0..K) and ``grads`` (step 1);
    ``got``: rank 0's ``losses`` and ``states``; ``lr``: SGD's learning rate (None: no gradients
    are recovered from the parallel run's update)."""
    losses, ref_losses = list(got["losses"]), list(ref["losses"])
    loss_diffs = [abs(a - b) if not (math.isnan(a) or math.isnan(b)) else math.inf
                  for a, b in zip(ref_losses, losses)]
    problems: list[str] = []
    if len(losses) != len(ref_losses):
        problems.append(f"{len(losses)} parallel losses for {len(ref_losses)} steps")
    param, name, step = _worst(_state_diffs(ref["states"], got["states"], problems))
    grad = grad_name = grad_atol = None
    note = "not compared: only plain SGD (--optimizer sgd) lets verify read them off the update"
    if lr is not None and len(got["states"]) > 1:
        before, after = got["states"][0], got["states"][1]
        # SGD: p1 = p0 - lr * g, so the gradient the parallel program applied is (p0 - p1) / lr.
        pairs = ((max_abs_diff(g, (before[n].double() - after[n].double()) / lr), n, 1)
                 for n, g in ref["grads"].items() if n in before and before[n].shape == g.shape)
        grad, grad_name, _ = _worst(pairs)
        grad_atol = PARAM_ATOL / lr  # the step-1 parameter bound, in gradient units
    return VerifyResult(ref_losses=ref_losses, losses=losses, loss_diffs=loss_diffs, worst_grad_diff=grad,
                        worst_grad_tensor=grad_name, grad_atol=grad_atol, worst_param_diff=param,
                        worst_param_tensor=name, worst_param_step=step, problems=problems, grad_note=note, **info)
