"""Per-rank job counting the copies around sequence parallelism's collectives (tests/dist/test_sp_copies.py).

Not a test module.  The meter is torch's: a ``TorchDispatchMode`` sees every aten operator of a
training step as it enters the dispatcher, forward and backward.  It counts the copying operators
(``clone``, ``copy_``, ``_to_copy``: what ``.contiguous()``, ``movedim(...).contiguous()`` and
``.to()`` turn into) and the ``c10d`` operators, both in the whole step and inside autopar's
all-gather and reduce-scatter bodies (``_gather`` / ``_scatter`` of autopar/ops/collectives.py,
wrapped for the step to mark where they run), with the body each is in.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.ops import collectives
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import SEQ, VOCAB, build

__all__ = ["sp_copies_job"]

_COPIES = {torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _CopyMeter(TorchDispatchMode):
    """Counts copies in the step, and inside the collectives' bodies (``inside`` > 0).  Inside, a
    ``copy_`` into an output buffer of a ``c10d`` call of the same body is the backend delivering
    its result (gloo's reduce-scatter reduces into a buffer of its own, then copies the rank's part
    out; NCCL writes in place) and is not one of autopar's copies."""

    def __init__(self):
        super().__init__()
        self.inside: list[str] = []  # the bodies running: "_gather" or "_scatter"
        self.copies, self.around, self.delivered = 0, [], 0
        self.calls_inside: list[tuple[str, str, int]] = []  # (body, c10d operator, tensors it writes)
        self.elsewhere: list[str] = []  # the step's other copies
        self.outputs: set[int] = set()  # storages the current body's c10d calls write

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _COPIES:
            self.copies += 1
            if self.inside and func.overloadpacket is torch.ops.aten.copy_ and _storage(args[0]) in self.outputs:
                self.delivered += 1
            elif self.inside:
                self.around.append((self.inside[-1], f"{func} of {tuple(args[0].shape)}"))
            else:
                self.elsewhere.append(f"{func} of {tuple(args[0].shape)}")
        elif func.namespace == "c10d" and self.inside:
            written = [t for t in pytree.tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            self.calls_inside.append((self.inside[-1], func.__name__, len(written)))
            self.outputs.update(_storage(t) for t in written)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _marked(meter: _CopyMeter):
    """``collectives._gather`` and ``_scatter`` (looked up by name at each call) mark their bodies."""
    originals = {name: getattr(collectives, name) for name in ("_gather", "_scatter")}

    def marking(name, fn):
        def run(*args, **kwargs):
            meter.inside.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                meter.inside.pop()
                if not meter.inside:
                    meter.outputs.clear()
        return run
    for name, fn in originals.items():
        setattr(collectives, name, marking(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(collectives, name, fn)


# What ``sliced`` sets gloo's entry of ``collectives.SLICED_OPS`` to for a job.
POLICIES = {"default": None, "both": frozenset({"all_gather", "reduce_scatter"}), "none": frozenset()}


def sp_copies_job(model_name: str, plan: str, batch: int, sliced: str = "default"):
    """One training step of ``plan`` at global ``batch`` after a warm-up step: the copies counted in
    the step and those inside the collectives' bodies (body, operator), the ``c10d`` calls there
    (body, operator, how many tensors it writes), and the step's tp records (op, phase, shape).
    ``sliced``: which collectives run sliced on gloo for the job (:data:`POLICIES`; "both" is what
    NCCL runs, "default" gloo's own choice)."""
    saved = collectives.SLICED_OPS
    if POLICIES[sliced] is not None:
        collectives.SLICED_OPS = {**saved, "gloo": POLICIES[sliced]}
    try:
        return _step_copies(model_name, plan, batch)
    finally:
        collectives.SLICED_OPS = saved


def _step_copies(model_name: str, plan: str, batch: int):
    model, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, batch, SEQ, 2, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"])
    pm.train_step(*batches[0])
    meter = _CopyMeter()
    with _marked(meter), meter:
        loss = pm.train_step(*batches[1])
    records = [(r["op"], r["phase"], r["shape"]) for r in pm.comm_stats()
               if r["op"] in ("all_gather", "reduce_scatter") and r["axis"] == "tp"]
    state = {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()}
    return {"loss": float(loss), "state": state, "copies": meter.copies, "around": meter.around,
            "delivered": meter.delivered, "elsewhere": meter.elsewhere, "calls_inside": meter.calls_inside,
            "records": records}
