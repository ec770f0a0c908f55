"""Each step's global shapes against the shapes the traced graph holds for.

``torch.export`` traces with symbolic batch and sequence sizes, but a model may still branch on
them: a chunked scan (Qwen3-Next's gated delta rule, Mamba-2's SSD) unrolls one loop iteration per
chunk, so the graph traced at 32 tokens with 64-token chunks computes one chunk whatever length it
is given.  Export records such decisions as *guards* (``ceil(s / 64) == 1``) and checks them in a
``_guards_fn`` call at the top of the graph, with the traced ranges (``s >= 32`` for a scan over
chunks of 32), which the exported module also checks in a forward pre-hook.  Neither can stay:
after sharding, a rank sees local shapes (a cp rank half of the sequence), and a core run whole
under cp sees the global length that no input of the rank has.  :mod:`passes.cleanup` drops the
call and :class:`~autopar.runtime.module.ParallelModule` turns the pre-hook off.

So the runtime checks the guards itself, on the shapes of the *global* batch (what one device would
compute, whatever the plan), before the first step of each new shape: a step the graph does not
hold for is refused with an ``autopar:`` error instead of training silently wrong.

Neighbours: :mod:`autopar.frontend.trace` keeps the guards (``Traced.input_guards``);
:meth:`autopar.runtime.module.ParallelModule._begin` calls :meth:`ShapeGuards.check`;
:func:`autopar.runtime.stepping.batching.global_sizes` is the same rule for the batch and sequence.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from autopar.errors import AutoparError

__all__ = ["ShapeGuards"]


class ShapeGuards:
    """The traced graph's shape guards, checked once per new global shape of a step's batch."""

    def __init__(self, guards: Callable | None, example: tuple, plan):
        self._guards, self._plan = guards, plan
        self._example = tuple(tuple(t.shape) for t in example if isinstance(t, torch.Tensor))
        self._checked: set[tuple] = set()

    def _global(self, tensors: tuple, local: bool) -> tuple:
        """Meta tensors of the global batch's shapes (``local``: the dims as long as the first input's
        rows times ``dp`` and as long as its sequence times ``cp``, the dims ``train_step`` cuts:
        :func:`~autopar.runtime.stepping.batching.cut_rows`, ``cut_positions``)."""
        first = tensors[0] if tensors and isinstance(tensors[0], torch.Tensor) else None
        rows = first.shape[0] if first is not None and first.dim() > 0 else None
        seq = first.shape[1] if first is not None and first.dim() > 1 else None
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                out.append(t)
                continue
            shape = list(t.shape)
            if local and shape and shape[0] == rows:
                shape[0] *= self._plan.dp
                if len(shape) > 1 and seq is not None and shape[1] == seq:
                    shape[1] *= self._plan.cp
            out.append(torch.empty(shape, dtype=t.dtype, device="meta"))
        return tuple(out)

    def check(self, inputs: tuple, target: Any, local: bool) -> None:
        """Raise an ``autopar:`` error when the step's global shapes break a guard of the trace."""
        if self._guards is None:
            return
        tensors = tuple(inputs) + ((target,) if target is not None else ())
        key = (local, tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in tensors))
        if key in self._checked:
            return
        shapes = self._global(tensors, local)
        try:
            self._guards(*shapes)
        except Exception as exc:  # torch.export raises its own guard failure (an assertion or RuntimeError)
            found = [tuple(t.shape) for t in shapes if isinstance(t, torch.Tensor)]
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise AutoparError(
                f"autopar: the model was traced at input shapes {list(self._example)}, and its graph holds only "
                f"where torch.export's guards hold; this step's global batch has shapes {found}, which fails "
                f"one ({why}). The model branches on its sizes (a chunked scan unrolls its chunks at the traced "
                "length). Trace with example inputs of the batch and sequence length you train at.") from None
        self._checked.add(key)
