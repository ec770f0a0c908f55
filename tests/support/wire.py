"""A wire-level guard: every collective and point-to-point call counted where it enters torch.distributed.

Not a test module.  The byte tests compare the cost model with ``pm.comm_stats()``, the records
that autopar's own collectives write (autopar/ops/collectives.py, the pipeline's recording stage
of autopar/compat.py).  Those records are the program's own word: a collective issued without a
record would go unnoticed.  :class:`WireCounter` is a ``TorchDispatchMode`` that sees every
operator of the ``c10d`` and functional-collective namespaces as it enters the dispatcher, however
it was called (``dist.all_reduce``, ``dist.all_gather_single``, an async work handle, ``isend`` /
``batch_isend_irecv``, ``torch.distributed._functional_collectives``, a DTensor redistribution).
``CommDebugMode`` is not enough: it counts neither ``send`` nor ``recv_`` and reports no bytes.

What enters the dispatcher, per call autopar makes (checked on gloo, torch 2.13):

==========================================  ==========================================
call                                        operator seen
==========================================  ==========================================
``dist.all_reduce`` (sync or async)          ``c10d.allreduce_``
``dist.all_gather_single`` /                 ``c10d._allgather_base_``
``all_gather_into_tensor``
``dist.all_gather`` (a list of outputs)      ``c10d.allgather_``
``dist.reduce_scatter_single`` /             ``c10d._reduce_scatter_base_``
``reduce_scatter_tensor``
``dist.all_to_all_single`` (even or split)   ``c10d.alltoall_base_``
``dist.isend`` / ``irecv``, and              ``c10d.send`` / ``c10d.recv_``
``batch_isend_irecv`` of ``P2POp``\\ s
``dist.broadcast``                           ``c10d.broadcast_``
``dist.barrier``                             ``c10d.barrier``
functional collectives                       ``_c10d_functional.all_reduce`` (…), then
                                             ``wait_tensor`` (no traffic); the c10d
                                             operator they run is not seen again
==========================================  ==========================================

Each call becomes a :class:`WireCall`: the operator, the kind of collective it is in the records'
vocabulary (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``send``, ``recv``;
``None`` for an operator the records never name, e.g. ``broadcast_``), the group size, and the
bytes this rank sends and receives by the ring convention of docs/architecture.md, derived from the
tensors alone (``ring_bytes`` of autopar is not used):

* ``allreduce_`` of ``F`` bytes on ``n`` ranks: ``2(n-1)/n·F`` each way (record ``all_reduce`` of ``F``);
* ``_allgather_base_`` of an input shard ``s``: ``(n-1)·s`` (record ``all_gather`` of the shard);
* ``_reduce_scatter_base_`` of an input ``F``: ``(n-1)/n·F`` (record ``reduce_scatter`` of ``F``);
* ``alltoall_base_`` even: ``(n-1)/n`` of the input (received: of the output); with split sizes,
  the rows to (from) the other ranks (record ``all_to_all``; MoE dispatch and combine);
* ``send`` of ``B`` bytes: ``B`` sent; ``recv_``: ``B`` received (records ``send`` / ``recv``).

:func:`wire_problems` compares the wire calls of one step with that step's records: per
(kind, group size) the same number of calls and, call by call, a record of the same bytes; a wire
call that no record matches is named.  Calls autopar deliberately issues without a record are
listed in :data:`UNRECORDED` with the reason: an allow-list, empty today (every collective of a
training step is recorded); :data:`OUTSIDE_STEP` lists those made outside any step, which the guard
does not count.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["train_guarded", "WireCall", "WireCounter", "WireRecords", "UNRECORDED", "OUTSIDE_STEP", "describe", "wire_problems",
           "guard_program"]

_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
# Operators of those namespaces that move nothing (they wait on or wrap a functional collective's result).
_NO_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd"}

# The allow-list: operators that may enter torch.distributed inside a counted step without a record,
# each with its reason; the guard leaves them out of the comparison.  Empty: every collective of a
# training step is recorded (checked on gloo for tp, sp, dp, mb, zero 1-3, cp ring / allgather /
# ulysses, ep, pp 1f1b, bf16 mixed precision, gradient clipping's norm all-reduce and the
# valid-token count of local batches).  An entry needs a reason a reviewer can check.
UNRECORDED: dict[str, str] = {}

# What autopar issues without a record outside a training step, which the guard (counting
# ``train_step`` and ``eval_step`` only) never sees; listed so a change that moves one into the
# step is decided in UNRECORDED, with its reason.
OUTSIDE_STEP: dict[str, str] = {
    "c10d.barrier.default": "checkpoint save and load (autopar/runtime/weights/checkpoint.py): synchronisation, no payload",
    "c10d.broadcast_.default": "the RNG seed at parallelize (autopar/ops/rng.py); pipeline-owned tensors "
                               "gathered by state_dict (autopar/runtime/weights/state.py, layout.py)",
    "c10d.allgather_.default": "all_gather_object / the per-axis gathers of state_dict and export "
                               "(autopar/runtime/weights/layout.py, export.py, api.py's plan choice)",
    "c10d._allgather_base_.default": "ZeRO's full-weight gathers of state_dict (autopar/runtime/gradients/zero.py)",
}


@dataclasses.dataclass(frozen=True)
class WireCall:
    """One operator call that entered torch.distributed on this rank."""

    op: str  # the dispatcher operator, e.g. "c10d.allreduce_.default"
    kind: str | None  # the records' collective kind, None for one they never name
    group_size: int
    bytes_sent: float
    bytes_recv: float
    shape: tuple
    dtype: str


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _flat(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat(item)]
    return []


def _group(value) -> tuple[int, int]:
    """(size, this rank's index) of a process group argument: a ProcessGroup or a group name."""
    if isinstance(value, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        value = _resolve_process_group(value)
    elif isinstance(value, torch.ScriptObject):  # how the c10d operators receive their group
        value = torch.distributed.ProcessGroup.unbox(value)
    return int(value.size()), int(value.rank())


def _split_bytes(t, splits, me: int, n: int) -> float:
    """Bytes of ``t`` bound to (or from) the other ranks of an all-to-all: all but this rank's rows."""
    if not splits:
        return (n - 1) / n * _nbytes(t)
    row = _nbytes(t) / max(sum(splits), 1)
    return (sum(splits) - splits[me]) * row


def describe(func, args, kwargs) -> WireCall | None:
    """The :class:`WireCall` of one dispatcher call; None for operators that move nothing."""
    name = func._schema.name.split("::", 1)[1]
    if name in _NO_TRAFFIC:
        return None
    bound = dict(zip((a.name for a in func._schema.arguments), args))
    bound.update(kwargs or {})
    group = bound.get("process_group", bound.get("group_name", bound.get("group")))
    n, me = _group(group) if group is not None else (1, 0)
    tensors = [t for a in func._schema.arguments for t in _flat(bound.get(a.name))]
    first = tensors[0] if tensors else torch.empty(0)
    base = name.rstrip("_").lstrip("_")
    kind, sent, recv = None, 0.0, 0.0
    if base in ("allreduce", "all_reduce", "allreduce_coalesced", "all_reduce_coalesced"):
        full = sum(_nbytes(t) for t in _flat(bound.get("tensors", bound.get("input", bound.get("inputs")))))
        kind, sent = "all_reduce", 2 * (n - 1) / n * full
        recv = sent
    elif base in ("allgather_base", "all_gather_into_tensor", "allgather", "allgather_into_tensor_coalesced",
                  "all_gather_into_tensor_coalesced", "allgather_coalesced"):
        shard = sum(_nbytes(t) for t in _flat(bound.get("input_tensor", bound.get("input_tensors", bound.get(
            "input", bound.get("inputs", bound.get("input_list")))))))
        kind, sent = "all_gather", (n - 1) * shard
        recv = sent
    elif base in ("reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter",
                  "reduce_scatter_tensor_coalesced"):
        full = sum(_nbytes(t) for t in _flat(bound.get("input_tensor", bound.get("input_tensors", bound.get(
            "input", bound.get("inputs"))))))
        kind, sent = "reduce_scatter", (n - 1) / n * full
        recv = sent
    elif base in ("alltoall_base", "all_to_all_single"):
        out, inp = bound.get("output"), bound.get("input")
        kind = "all_to_all"
        sent = _split_bytes(inp, list(bound.get("input_split_sizes") or []), me, n)
        if out is None:  # functional: the output is allocated by the operator, its rows given by the splits
            out_splits = [int(s) for s in bound.get("output_split_sizes") or []]
            per_row = _nbytes(inp) / max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
            recv = (sum(out_splits) - out_splits[me]) * per_row if out_splits else (n - 1) / n * _nbytes(inp)
        else:
            recv = _split_bytes(out, list(bound.get("output_split_sizes") or []), me, n)
    elif base == "alltoall":
        outs, ins = _flat(bound.get("output_tensors")), _flat(bound.get("input_tensors"))
        kind = "all_to_all"
        sent = sum(_nbytes(t) for i, t in enumerate(ins) if i != me)
        recv = sum(_nbytes(t) for i, t in enumerate(outs) if i != me)
    elif base == "send":
        kind, sent = "send", float(sum(_nbytes(t) for t in tensors))
    elif base in ("recv", "recv_any_source"):
        kind, recv = "recv", float(sum(_nbytes(t) for t in tensors))
    elif base == "broadcast":
        kind = "broadcast"  # not a kind the records name: the UNRECORDED list decides
        size = float(sum(_nbytes(t) for t in tensors))
        sent, recv = (size, 0.0) if bound.get("root_rank", bound.get("src", 0)) == me else (0.0, size)
    elif base in ("barrier", "monitored_barrier"):
        kind = "barrier"
    return WireCall(str(func), kind, n, float(sent), float(recv), tuple(first.shape),
                    str(first.dtype).replace("torch.", ""))


class WireCounter(TorchDispatchMode):
    """Collects a :class:`WireCall` for every communication operator dispatched while active.

    ``with WireCounter() as wire: pm.train_step(...)``; then ``wire.calls``.  Only plain data is
    kept (no tensors, no process groups: a group held past its job would leak its gloo threads).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[WireCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COMM_NAMESPACES:
            call = describe(func, args, kwargs)
            if call is not None:
                self.calls.append(call)
        return func(*args, **(kwargs or {}))


class WireRecords(list):
    """``pm.comm_stats()`` (a list of record dicts) that also carries the same step's wire calls,
    ``.wire``; picklable, so a job's result brings both back to the test."""

    wire: list | None = None

    def __init__(self, records, wire) -> None:
        super().__init__(records)
        self.wire = [dataclasses.asdict(c) for c in wire]


def wire_problems(records, wire) -> list[str]:
    """What of one step's wire calls the same step's records do not account for, as lines (empty: none).

    Per (kind, group size): the same number of calls on both sides; call by call, each wire call
    matched by a record of the same kind, group size and bytes sent and received (the records'
    ring convention, derived on the wire side from the tensors).  Operators of :data:`UNRECORDED`
    are left out, with their reason in that table.
    """
    problems = []
    counted = [c for c in wire if c["op"] not in UNRECORDED]
    for c in counted:
        if c["kind"] is None:
            problems.append(f"wire call {c['op']} (group of {c['group_size']}, {c['shape']} {c['dtype']}): "
                            "an operator the records never name")
    wire_count = collections.Counter((c["kind"], c["group_size"]) for c in counted)
    rec_count = collections.Counter((r["op"], r["group_size"]) for r in records)
    for key in sorted(set(wire_count) | set(rec_count), key=repr):
        if wire_count[key] != rec_count[key]:
            ops = sorted({c["op"] for c in counted if (c["kind"], c["group_size"]) == key})
            problems.append(f"{key[0]} on {key[1]} ranks: {wire_count[key]} wire calls ({', '.join(ops) or 'none'}), "
                            f"{rec_count[key]} recorded")
    # Call by call: a multiset of (kind, group size, sent, received), bytes compared to 1e-9 relative.
    left = collections.defaultdict(list)
    for r in records:
        left[(r["op"], r["group_size"])].append((r["bytes_sent"], r["bytes_recv"]))
    for c in counted:
        pool = left.get((c["kind"], c["group_size"]), [])
        hit = next((i for i, (s, v) in enumerate(pool)
                    if math.isclose(s, c["bytes_sent"], rel_tol=1e-9, abs_tol=1e-9)
                    and math.isclose(v, c["bytes_recv"], rel_tol=1e-9, abs_tol=1e-9)), None)
        if hit is None:
            if c["kind"] is not None:
                problems.append(f"wire call {c['op']} (group of {c['group_size']}, {c['shape']} {c['dtype']}, "
                                f"sent {c['bytes_sent']:g} B, received {c['bytes_recv']:g} B): no record of it")
        else:
            pool.pop(hit)
    return problems


def guard_program(pm):
    """Count the wire of each ``pm.train_step`` from now on (and ``eval_step``, which starts new
    records) and make ``pm.comm_stats()`` return :class:`WireRecords` carrying the last step's wire
    calls, the step those records are of; returns ``pm``.  Per instance (the class is untouched).
    A counted step costs about twice an uncounted one (every operator passes the mode), so a job
    guards its program just before the step it measures.
    """
    last: list = []
    ref, cls = weakref.ref(pm), type(pm)  # no cycle through the instance: its groups go with it

    def counted(name: str):
        method = getattr(cls, name)

        def run(*args, **kwargs):
            with WireCounter() as counter:
                out = method(ref(), *args, **kwargs)
            last[:] = counter.calls
            return out
        return run

    pm.train_step, pm.eval_step = counted("train_step"), counted("eval_step")
    pm.comm_stats = lambda: WireRecords(cls.comm_stats(ref()), last)
    return pm


def train_guarded(pm, batches) -> list[float]:
    """``pm.train_step`` on each ``(inputs, target)`` of ``batches``, the last one counted on the
    wire (:func:`guard_program`): ``pm.comm_stats()`` is then that step's records with its calls."""
    losses = [pm.train_step(*batch) for batch in batches[:-1]]
    guard_program(pm)
    return losses + [pm.train_step(*batches[-1])]
