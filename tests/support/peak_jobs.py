"""Per-rank job of the peak-memory tests: a step's peak bytes by the CPU allocator, a meter that is not autopar's.

Not a test module.  The meter is torch's own accounting of CPU allocations: with
``profile_memory=True`` torch's profiler records every allocation and free of c10's CPU
allocator with the allocator's running total (``total_allocated``).  Two details make that total
exact across threads: c10 counts a free only when it knows the block's size, which it records
for blocks allocated while profiling -- so the program is built inside the profile, and the
batches outside it --, and it updates its total on a thread that is not profiling (gloo's
threads free the buffers of the collectives they finish) only when c10's flag
``caffe2_report_cpu_memory_usage`` is set, which :func:`_count_every_free` sets.  Nothing of
autopar's own accounting (``MemoryMeter``, ``comm_stats``) is read.

:func:`peak_job` returns, per rank, the largest total reached inside each measured step minus
nothing: the absolute bytes the process's program holds at its peak (parameters, optimizer
state, gradients and every transient).  gloo frees a collective's working copy on its own
thread, at times only after the program's next allocation (ZeRO-1's blocking reduce-scatter,
ZeRO-3's gathers), so a step's peak takes one of two or three values; the job measures ten
steps and reports each step's peak and the largest.
"""
from __future__ import annotations

import ctypes
import gc
import os

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import VOCAB, build

__all__ = ["peak_job"]

_STEP = "peak_probe:step"


def _count_every_free() -> None:
    """c10's flag that keeps its CPU allocation total on every thread (see the module docstring)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _events(prof) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(time, allocator total) of every allocation, and the (start, end) of each measured step."""
    totals, steps, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            totals.append((e.start_time_ns, e.extra_fields.total_allocated))
        elif e.name == _STEP:
            steps.append((e.start_time_ns, e.end_time_ns))
        stack.extend(e.children)
    return sorted(totals), sorted(steps)


def peak_job(model_name: str, plan: str, batch: int, seq: int = 16, warmup: int = 2, measured: int = 10,
             overrides: dict | None = None, bucket_bytes: int | None = None) -> dict:
    """Build and train ``plan`` with AdamW; the allocator's peak over ``measured`` steps after
    ``warmup`` (the optimizer state exists from the first step), and its total between steps
    (``bucket_bytes``: the gradient buckets' cap, parallelize's default when None)."""
    batches = make_batches(VOCAB, batch, seq, 2, seed=1)
    gc.collect()
    _count_every_free()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, loss_fn, kwargs = build(model_name, overrides or {})
        extra = {"bucket_bytes": bucket_bytes} if bucket_bytes is not None else {}
        pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                                 loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], **extra)
        del model  # the program holds what it needs; the caller's model is not the program's memory
        for i in range(warmup + measured):
            gc.collect()
            with record_function(_STEP if i >= warmup else "peak_probe:warmup"):
                pm.train_step(*batches[i % 2])
    totals, steps = _events(prof)
    peaks = [max(t for when, t in totals if start <= when <= end) for start, end in steps]
    between = [t for when, t in totals if when < steps[0][0]][-1]
    return {"peak": max(peaks), "peaks": peaks, "between_steps": between,
            "pp_rank": pm.coords().get("pp", (0, 1))[0]}
