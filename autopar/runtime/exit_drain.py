"""A gloo program ends cleanly: its process groups' worker threads finish while Python still runs.

:func:`autopar.runtime.api.init_distributed` and :func:`autopar.runtime.api.parallelize` call
:func:`drain_at_exit`; the process group itself comes from :mod:`autopar.runtime.rendezvous`.

**Why** (a rank of ``examples/train_llama.py`` under torchrun died with SIGABRT, "terminate called
without an active exception", about one run in ten, after its last step had printed).  Each gloo
process group runs its collectives on worker threads (``pt_gloo_runloop``, torch 2.13).  A worker
drops its reference to a finished collective's work only after the caller has seen the result, so
the work's tensors may be freed on that thread; a tensor whose Python object it then owns needs the
GIL to free it.  If the main thread has meanwhile begun finalizing the interpreter, the worker's
attempt to take the GIL ends the thread (``PyThread_exit_thread``), the unwind crosses a
``noexcept`` destructor and ``std::terminate`` aborts the process (the stack, taken with gdb:
``~AsyncAllgatherCoalescedWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
``destroy_process_group`` does not stop those threads: a group's threads are joined only when its
last reference goes, and a ``ParallelModule`` in a reference cycle keeps its groups until the
interpreter's final garbage collection, which is too late.

**The fix**: at exit, before finalization (``atexit`` handlers run while other threads may still
take the GIL), collect garbage, so that unreachable groups are destroyed and their threads joined
(torch frees a group with the GIL released); if a group is still referenced (a module kept in a
global), release the GIL for a moment so its workers can finish what they hold.
"""
from __future__ import annotations

import atexit
import gc
import os
import time

__all__ = ["drain_at_exit"]

_REGISTERED = False
_WORKER_THREAD = "pt_gloo_runloop"  # the thread name torch's ProcessGroupGloo gives its workers
_GRACE_SECONDS = 0.2
"""How long the GIL is left to a group's workers still alive at exit (a finished work is freed
in microseconds once its thread runs; the margin is for a loaded machine)."""


def drain_at_exit() -> None:
    """Register (once per process) the exit handler of the module docstring."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_drain)
        _REGISTERED = True


def _gloo_workers_alive() -> bool:
    """Whether a gloo worker thread is still running (Linux names threads in ``/proc``; elsewhere
    assume one is)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() == _WORKER_THREAD:
                    return True
        except OSError:
            continue  # the thread ended while we looked
    return False


def _drain() -> None:
    gc.collect()
    if _gloo_workers_alive():
        time.sleep(_GRACE_SECONDS)  # sleeping releases the GIL
