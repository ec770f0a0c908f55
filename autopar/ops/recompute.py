"""Activation recompute at run time: a region of the program runs under torch's checkpoint.

``passes/recompute.py`` cuts every region the plan recomputes (a decoder layer for
``recompute=full``; the attention core and the MLP activation for ``selective``) out of the
program into a GraphModule *body* and calls it through a :class:`Recompute` module, which
runs :func:`checkpointed`: ``torch.utils.checkpoint.checkpoint(body, *inputs,
use_reentrant=False)``.  Forward keeps the body's inputs (the checkpoint saves them, through
the saved-tensor hooks active around it) and none of the tensors the body saves; backward
runs the body again when it first needs one of them, and stops as soon as the last one is
recomputed (torch's early stop), so the row projection that ends each region is not re-run.

Three things the checkpoint does not know about autopar's step context
(:mod:`autopar.ops.step`), handled here:

* **Dropout streams.**  The checkpoint restores the default generators only; autopar's
  dropout draws from the step's per-stream generators (:mod:`autopar.ops.rng`).  Their
  states when the region starts are kept, and the recomputation draws from copies restored
  to them (a stream first used inside the region starts from its seed, as in forward), so
  it draws the same masks and leaves the step's generators where they were.
* **Collectives.**  A region's forward collectives run again while it is recomputed; they
  are recorded with phase ``bwd`` (``StepContext.recomputing``), which is where the cost
  model counts them (``cost/comm.py``).
* **A counter.**  Each recomputation adds one to the step counter ``recomputed_regions``.
* **The memory meter.**  Tensors the recomputation saves are shown to the saved-tensor hook
  that was active when the region ran forward (the memory meter's, or ZeRO-3's, which
  forwards to it), inside the checkpoint's own hook (:func:`autopar.compat.top_saved_tensors_hooks`),
  while the meter tallies them as the *recompute working set* of that region
  (``MemoryMeter.recomputing``; the region's own inputs, already counted, are left out).

Without grad (``eval_step``) the body simply runs; on the meta device (the scale
simulation) it is checkpointed too, so the recomputed collectives are recorded there as well.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from autopar.compat import top_saved_tensors_hooks
from autopar.ops.step import StepContext, activate, find_current

__all__ = ["Recompute", "checkpointed", "RECOMPUTED"]

RECOMPUTED = "recomputed_regions"  # the step counter of region recomputations run in backward


class Recompute(torch.nn.Module):
    """One recomputed region of a program: ``body`` (a GraphModule of plain inputs and outputs)
    run by :func:`checkpointed`; ``kind`` is ``layer``, ``attention`` or ``mlp``, ``module``
    the model module the region comes from."""

    def __init__(self, body: torch.fx.GraphModule, kind: str, module: str):
        super().__init__()
        self.body = body
        self.kind = kind
        self.module = module

    def forward(self, *inputs):
        return checkpointed(self.body, *inputs)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, module={self.module!r}"


class _Recomputing:
    """The recompute context of one checkpointed call (entered once per recomputation)."""

    def __init__(self, step: StepContext | None, states: dict, observe):
        self.step, self.states, self.observe = step, states, observe
        self._stack: contextlib.ExitStack | None = None
        self._left_out: set[int] | None = None

    def _generators(self) -> dict:
        restored = {}
        for key, state in self.states.items():
            gen = torch.Generator(device=key[1])
            gen.set_state(state)
            restored[key] = gen
        return restored

    def __enter__(self):
        if self.step is None:
            return self
        self.step.counters[RECOMPUTED] += 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(activate(self.step, generators=self._generators(), recomputing=True))
            meter, inner = self.step.memory, top_saved_tensors_hooks()  # the checkpoint's recomputation hook
            if meter is not None and self.observe is not None and inner is not None:
                self._left_out = stack.enter_context(meter.recomputing())
                observe, (inner_pack, inner_unpack) = self.observe, inner

                def pack(t):
                    observe(t)  # counted as the forward's hooks would count it, in the working set
                    return inner_pack(t)

                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, inner_unpack))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc):
        stack, self._stack, self._left_out = self._stack, None, None
        return stack.__exit__(*exc) if stack is not None else False

    def run(self, body, *inputs):
        """The body; while recomputing, the meter leaves its inputs (as unpacked now) out."""
        if self._left_out is not None:
            self._left_out.update(v.untyped_storage().data_ptr() for v in inputs
                                  if isinstance(v, torch.Tensor) and v.device.type != "meta")
        return body(*inputs)


def checkpointed(body, *inputs):
    """``body(*inputs)`` with its activations recomputed in backward (see the module docstring)."""
    if not torch.is_grad_enabled():
        return body(*inputs)
    step = find_current()
    states = {key: gen.get_state() for key, gen in step.generators.items()} if step is not None else {}
    hooks = top_saved_tensors_hooks()
    observe = hooks[0] if hooks is not None and step is not None and step.memory is not None else None
    context = _Recomputing(step, states, observe)
    return checkpoint(functools.partial(context.run, body), *inputs, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), context))
