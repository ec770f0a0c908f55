"""Gradient synchronisation after backward, and the optimizer step around it.

The data-parallel pass (``passes/data_parallel.py``) decides the buckets; this module
executes them: for each bucket, all-reduce its gradients over the bucket's mesh axis (sum for
partial gradients, average over ``dp``) as one flat buffer, of which the gradients are views
(``GradSync._bucket_views``; else flattened each step and written back).  Every
collective is recorded with phase ``grad``.  In the flat executor's last micro-batch a
bucket's all-reduce starts during backward, once its gradients exist (:class:`_Overlap`);
``sync()`` waits for it.  With ``fused_optimizer`` under dp the stepped tensors and their
gradients are views of flat buffers stepped in one fused update (:mod:`autopar.runtime.gradients.fused_step`),
and a bucket is a slice of the flat gradient.

:class:`GradSync` is the gradient-sync strategy :class:`autopar.runtime.module.ParallelModule`
uses without ZeRO; ZeRO stages replace it with a strategy of :mod:`autopar.runtime.gradients.zero`.  All
implement :class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`, which is all that the
module, the executors, state dicts and checkpoints (:mod:`autopar.runtime.weights.state`), clipping and
the memory meter (:mod:`autopar.runtime.stepping.memory`) use; its docstrings say what each method does.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from autopar.ops import collectives
from autopar.plan_space import grads_kept
from autopar.runtime.gradients import fused_step
from autopar.runtime.stepping.precision import MainGrads

__all__ = ["GradSync"]


class GradSync:
    """Bucketed all-reduce of gradients, then a plain optimizer step on local parameters.

    ``originals``: graph name -> this rank's piece of the user's fp32 tensor, for mixed
    precision (:mod:`autopar.runtime.stepping.precision`): the optimizer then steps fp32 masters
    whose main gradients are what is reduced.  None: the parameters themselves.
    ``fused_optimizer``: for an element-wise optimizer class, the stepped tensors and their
    gradients become views of flat buffers that one (fused) update steps (:attr:`flat`,
    :mod:`autopar.runtime.gradients.fused_step`).  A
    :class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`."""

    zero_stage = 0

    def __init__(self, gm: torch.fx.GraphModule, buckets, groups: dict, make_optimizer, originals=None,
                 fused_optimizer: bool = True):
        self.gm = gm
        self.buckets = list(buckets)
        self.groups = groups
        params = dict(gm.named_parameters())
        self.main = MainGrads(params, originals) if originals is not None else None
        # What holds each parameter's value and gradient for sync, clipping, the step and state.
        self.params = self.main.masters if self.main is not None else params
        self.optimizer, self.flat = self._optimizer(make_optimizer, fused_optimizer)
        self._overlap = _Overlap(self) if self.main is None and self.buckets else None
        self._spans: set[int] = set()  # buckets whose buffer is a slice of the flat gradient
        self._views = self._bucket_views() if self.main is None or self.flat is not None else {}

    def _optimizer(self, make_optimizer, fused_optimizer: bool):
        """The user's optimizer over the stepped tensors, or (``fused_optimizer``, an element-wise
        class: :mod:`autopar.runtime.gradients.fused_step`) the same over flat buffers of which they become
        views where data-parallel buckets keep the gradients all step, else over the tensors with
        ``fused=True``; returns ``(optimizer, FlatParams or None)``."""
        stepped = [p for p in self.params.values() if p.requires_grad]
        probe = make_optimizer(stepped)
        if (not fused_optimizer or type(probe) not in fused_step.ELEMENTWISE or not stepped
                or any(p.device.type == "meta" for p in stepped)):
            return probe, None
        name_of = {id(p): n for n, p in self.params.items()}
        if any(id(p) not in name_of for g in probe.param_groups for p in g["params"]) or not self._keeps_grads():
            return fused_step.fused_version(probe), None  # tensors of the factory's own; or see _keeps_grads
        order = {n: i for i, n in enumerate(dict.fromkeys(n for b in self.buckets for n in b.params))}
        groups = [sorted((name_of[id(p)] for p in g["params"]), key=lambda n: order.get(n, len(order)))
                  for g in probe.param_groups]
        flat = fused_step.FlatParams({n: self.params[n] for g in groups for n in g}, groups)
        per_group = [[t for t, gi in zip(flat.flats, flat.group_of) if gi == i] for i in range(len(groups))]
        return fused_step.flat_optimizer(probe, per_group), flat

    def _keeps_grads(self) -> bool:
        """Whether data-parallel buckets keep the gradients all step (persistent bucket views): only
        then are they made flat, which keeps them so (the rule's one home: :func:`autopar.plan_space.grads_kept`,
        which the cost model's peak asks too)."""
        size = {axis: g.size for axis, g in self.groups.items()}
        return bool(grads_kept(0, size.get("dp", 1), size.get("cp", 1))) and any(b.average for b in self.buckets)

    def _bucket_views(self) -> dict[int, tuple[torch.Tensor, list[torch.Tensor]]]:
        """Bucket index -> (its flat buffer, each parameter's gradient as a view of it).

        As DDP's ``gradient_as_bucket_view``: backward accumulates into the bucket, which is
        averaged and all-reduced in place -- no flattening copy and no buffer allocated per
        step -- and the gradients are zeroed in place after the step.  With a flat optimizer
        (:attr:`flat`) a bucket whose parameters are contiguous in it is a slice of its flat
        gradient.  Under mixed precision only with a flat optimizer (its main gradients are
        views that MainGrads adds into; else it writes new ones), and never for a parameter in
        two buckets (a gradient partial over tp is summed, then averaged over dp)."""
        count = collections.Counter(n for b in self.buckets for n in b.params)
        out = {}
        for index, bucket in enumerate(self.buckets):
            params = [self.params[n] for n in bucket.params]
            if any(count[n] > 1 for n in bucket.params) or len({(p.dtype, p.device) for p in params}) > 1:
                continue
            flat = self.flat.grad_span(list(bucket.params)) if self.flat is not None else None
            if flat is not None:
                self._spans.add(index)  # zeroed with the flat gradient after the step
            else:
                flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, offset = [], 0
            for name, p in zip(bucket.params, params):
                # A slice of the flat gradient: the very view FlatParams holds (no re-pointing).
                views.append(self.flat.grad_view(name) if index in self._spans
                             else flat[offset:offset + p.numel()].view_as(p))
                p.grad = views[-1]
                offset += p.numel()
            out[index] = (flat, views)
        return out

    def microbatch(self, last: bool = False):
        """Context around one micro-batch's forward and backward; in the ``last`` one of a step
        (flat executor, no mixed precision) each bucket's all-reduce starts as soon as backward
        has produced its gradients, and :meth:`sync` waits for it."""
        if self.main is not None:
            return _after(self.after_backward)
        if last and self._overlap is not None:
            return self._overlap.armed()
        return contextlib.nullcontext()

    def after_backward(self, chunk: int | None = None, kind: str = "full") -> None:
        """Mixed precision: this backward's bf16 gradients into the fp32 main gradients
        (``chunk``, ``kind``: the pipeline action that ran, see :class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`)."""
        if self.main is not None and kind != "inference":
            self.main.accumulate()

    def chunk_shards(self, chunk: int) -> list:
        """ZeRO-3's flat shards of a pipeline chunk: none without ZeRO-3."""
        return []

    def pipeline_step(self):
        """Context around a pipelined step (every action of this rank): nothing to do without ZeRO-3."""
        return contextlib.nullcontext()

    def forward_only(self):
        """Context around a forward without backward (evaluation): nothing to do without ZeRO-3."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def full_parameters(self, write_back: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Graph name -> the tensor holding the parameter's value (the master under mixed precision)."""
        values = dict(self.params)
        yield values
        if write_back and self.main is not None:
            self.main.copy_to_params()

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set graph parameter ``name`` to ``value`` (its tp-local shape): the parameter, and under
        mixed precision its fp32 master too (loading weights one tensor at a time)."""
        with torch.no_grad():
            self.params[name].copy_(value)
            if self.main is not None:
                self.main.params[name].copy_(value)

    def read_parameters(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, value)`` for each graph parameter of ``names`` (its tp-local shape; the fp32
        master under mixed precision), one at a time (every rank calls it: ZeRO's is collective)."""
        for name in names:
            yield name, self.params[name].detach()

    def step(self) -> None:
        """The optimizer step on the synchronised gradients, which are then dropped (zeroed in
        their buckets)."""
        if self.flat is not None:
            self.flat.collect_grads()
            self.optimizer.step()
            self.flat.zero_grads()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for index, (flat, views) in self._views.items():
            if index not in self._spans:
                flat.zero_()
            for name, view in zip(self.buckets[index].params, views):
                self.params[name].grad = view
        if self.main is not None:
            self.main.copy_to_params()

    def grad_square_sum(self, weights: dict[str, float], device: torch.device) -> torch.Tensor:
        """Sum over this rank's gradients of ``weights[name] * ||grad||^2`` (float64, on ``device``)."""
        total = torch.zeros((), dtype=torch.float64, device=device)
        for name, p in self.params.items():
            if p.grad is not None and p.grad.numel():
                total += weights[name] * p.grad.detach().double().square().sum()
        return total

    def scale_grads(self, coef: float) -> None:
        """Multiply every gradient held (the parameters', or the fp32 masters') by ``coef``."""
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(coef)

    def sync(self) -> None:
        """Each bucket all-reduced (waited for where backward started it); the gradients are
        then views of the reduced buffers."""
        started = self._overlap.take() if self._overlap is not None else {}
        for index, bucket in enumerate(self.buckets):
            params = [self.params[n] for n in bucket.params]
            grads = [p.grad if p.grad is not None or index in self._views else torch.zeros_like(p) for p in params]
            if index in started:
                flat, work = started[index]
                if work is not None:  # None: a group of one rank, nothing to wait for
                    work.wait()
            else:
                flat = self.start(index, grads, async_op=False)[0]
            if index in self._views:
                continue  # reduced in place: the gradients are views of the bucket
            offset = 0
            for p, grad in zip(params, grads):
                n = grad.numel()
                p.grad = flat[offset:offset + n].view_as(grad)
                offset += n

    def start(self, index: int, grads: list[torch.Tensor], async_op: bool):
        """Flatten bucket ``index``'s gradients and all-reduce them (``async_op``: without waiting);
        returns ``(flat, work or None)``.

        A bucket of gradient views (:meth:`_bucket_views`) is reduced in place.  An averaged
        bucket is divided before the all-reduce (as DDP does, instead of after the wait, on the
        step's critical path); ``sum(g / d)`` equals ``sum(g) / d`` exactly for a power-of-two ``d``."""
        bucket = self.buckets[index]
        group = self.groups[bucket.axis]
        divisor = (bucket.divisor or group.size) if bucket.average else 1
        if index in self._views:
            flat, views = self._views[index]
            for name, view in zip(bucket.params, views):
                p = self.params[name]
                if p.grad is not view:  # replaced since (set to None, assigned): back into the bucket
                    view.zero_() if p.grad is None else view.copy_(p.grad)
                    p.grad = view
            if divisor > 1:
                flat.div_(divisor)
        elif divisor > 1:
            flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
            offset = 0
            for g in grads:
                torch.div(g.reshape(-1), divisor, out=flat[offset:offset + g.numel()])
                offset += g.numel()
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
        if group.size == 1:
            return flat, None
        collectives.record("all_reduce", bucket.axis, flat, "grad", f"gradient bucket ({len(grads)} tensors)")
        return flat, dist.all_reduce(flat, group=group.group, async_op=async_op)

    # --- what checkpoints and the memory meter read -------------------------------------

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Graph parameter name -> {state key: this rank's tensor} (tp-local, as the parameter)."""
        if self.flat is not None:
            return self.flat.state_by_name(self.optimizer)
        by_id = {id(p): n for n, p in self.params.items()}
        out: dict[str, dict] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    out.setdefault(by_id[id(p)], {})[key] = value
        return out

    def load_optimizer_state(self, entries: dict[str, dict[str, torch.Tensor]]) -> None:
        """Inverse of :meth:`optimizer_state` (entries already cut to this rank's tp shard)."""
        if self.flat is not None:
            self.flat.load_state(self.optimizer, entries)
            return
        for name, p in self.params.items():
            found = entries.get(name)
            if found:
                self.optimizer.state[p] = fused_step.place_state(self.optimizer, p, found)

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors held outside the module's parameters: extra ``params``, ``master_params``, ``grads``."""
        if self.main is None:
            return {"params": [], "master_params": [], "grads": []}
        masters = list(self.main.masters.values())
        return {"params": [], "master_params": masters, "grads": [m.grad for m in masters if m.grad is not None]}


class _Overlap:
    """Start each bucket's all-reduce from the gradient hooks of a step's last backward.

    A bucket starts when every one of its parameters has accumulated its gradient
    (``register_post_accumulate_grad_hook``), so the reduction runs while backward computes
    the earlier layers' gradients, as DDP's reducer does.  Buckets sharing a parameter (a
    gradient partial over tp is summed, then averaged over dp) and parameters without a
    gradient stay for :meth:`GradSync.sync`, which runs them in order."""

    def __init__(self, sync: GradSync):
        self.sync = sync
        owners: dict[str, list[int]] = {}
        for i, b in enumerate(sync.buckets):
            for name in b.params:
                owners.setdefault(name, []).append(i)
        self.bucket_of = {name: idx[0] for name, idx in owners.items() if len(idx) == 1}
        self.sizes = {i: len(b.params) for i, b in enumerate(sync.buckets)
                      if all(n in self.bucket_of for n in b.params)}
        self.active = False
        self.pending: dict[int, int] = {}
        self.started: dict[int, tuple] = {}
        # The hook lives in the parameter's C++ autograd metadata, which Python's garbage
        # collector cannot see into: a strong reference back to this object would close an
        # uncollectable cycle (parameter -> hook -> _Overlap -> GradSync -> parameter) that
        # keeps the program and its process groups (gloo's threads and sockets) alive for
        # the rest of the process.  The hook holds a weak reference instead.
        me = weakref.ref(self)
        for name, p in sync.params.items():
            if name in self.bucket_of and self.bucket_of[name] in self.sizes and p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(_ready_hook, me, name))

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        self.active, self.pending = True, dict(self.sizes)
        try:
            yield
        finally:
            self.active = False

    def _ready(self, name: str, param: torch.Tensor) -> None:
        if not self.active:
            return
        index = self.bucket_of[name]
        self.pending[index] -= 1
        if self.pending[index] == 0:
            bucket = self.sync.buckets[index]
            grads = [self.sync.params[n].grad for n in bucket.params]
            self.started[index] = self.sync.start(index, grads, async_op=True)

    def take(self) -> dict[int, tuple]:
        """The buckets started in the last backward (cleared for the next step)."""
        started, self.started = self.started, {}
        return started


def _ready_hook(overlap: "weakref.ref[_Overlap]", name: str, param: torch.Tensor) -> None:
    live = overlap()
    if live is not None:  # a program that was freed leaves an inert hook on a parameter kept elsewhere
        live._ready(name, param)


@contextlib.contextmanager
def _after(callback) -> Iterator[None]:
    """Run ``callback`` when the block completes (after a micro-batch's backward)."""
    yield
    callback()
