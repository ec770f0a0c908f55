"""Every private PyTorch API autopar relies on, in one place.

PyTorch does not promise to keep these; when an upgrade changes one, the test in
``tests/unit/test_compat.py`` that exercises it fails with its name, and this file is the
only one to change.  Each function says what it wraps and why no public API does the job.
Nothing here is imported at ``import autopar`` time: offline planning never loads torch.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["sym_expr", "sym_hint", "flatten_mesh", "rename_node", "tensor_base", "set_buffer",
           "ASSERT_METADATA_OPS", "is_guards_call", "recording_stage_class", "compute_kinds", "pipeline_order",
           "top_saved_tensors_hooks", "retained_compiled_backward", "set_default_group_timeout"]


def sym_expr(size: Any):
    """The sympy expression of a symbolic size (``SymInt.node.expr``), or None for a plain int.

    torch.export records symbolic batch and sequence sizes as SymInts; the passes compare
    them with the traced symbols, which only the private ``node`` exposes."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def sym_hint(size: Any) -> int:
    """The example value behind a symbolic size (``SymInt.node.hint``), or the int itself."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def flatten_mesh(mesh, dims: tuple[str, ...], name: str):
    """The 1-D mesh over ``dims`` of ``mesh`` flattened into one axis ``name``
    (``DeviceMesh._flatten``: the only way to get one process group over two mesh axes
    that DeviceMesh keeps consistent with its other groups)."""
    return mesh[dims]._flatten(name)


def map_tensors(tree: Any, fn) -> Any:
    """``fn`` applied to every tensor of a nested output (tuples, dicts, Hugging Face
    ``ModelOutput``s, which transformers registers with torch's private pytree)."""
    from torch.utils import _pytree

    return _pytree.tree_map_only(torch.Tensor, fn, tree)


def rename_node(node, name: str) -> None:
    """Rename an FX node in place (``Node._rename``), keeping the graph's names unique."""
    node._rename(name)


def tensor_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor ``t`` is a view of, or ``t`` itself (``Tensor._base``): saved-tensor hooks
    see views of a gathered parameter and must recognise the buffer they came from."""
    return t._base if t._base is not None else t


def storage_key(t: torch.Tensor) -> tuple:
    """Equal for a tensor and every view or alias of its storage, while that storage lives.

    Saved-tensor hooks recognise a gathered buffer by it.  The tensor autograd saves may be a
    view of the buffer (``_base`` is the buffer) or an alias without ``_base``: a compiled
    forward (``torch.compile``'s AOTAutograd) saves its inputs as fresh aliases.  On the meta
    device, or for an empty storage, there is no address: the base tensor's identity then."""
    storage = t.untyped_storage()
    if t.device.type == "meta" or storage.nbytes() == 0:
        return ("tensor", id(tensor_base(t)))
    return ("storage", str(t.device), storage.data_ptr())


def never_traced(fn) -> None:
    """TorchDynamo runs ``fn`` (a function or a method) and everything it calls eagerly.

    For the saved-tensor hooks, which autograd's C++ calls inside compiled regions
    (autopar/runtime/stepping/inductor.py).  ``torch.compiler.disable`` would do the same by wrapping
    ``fn``, at about a microsecond per call in eager programs too, where it is not needed;
    marking the code object skips the frame, and the frames it calls, only while TorchDynamo
    runs (torch._dynamo's frame strategies)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    code = getattr(fn, "__func__", fn).__code__
    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def retained_compiled_backward():
    """A context in which ``torch.compile`` builds backwards that may run twice
    (``torch._functorch.config.patch(donated_buffer=False)``).

    AOTAutograd lets a compiled backward free ("donate") the buffers it saved, which refuses
    ``retain_graph=True``; torch's pipeline stages differentiate a chunk's graph twice for the
    split input / weight backward (autopar/runtime/stepping/pipelined.py), the first time retaining it.
    The compiled backward reads the switch when it runs; only a private config has it."""
    import torch._functorch.config

    return torch._functorch.config.patch(donated_buffer=False)


def set_buffer(module: torch.nn.Module, leaf: str, value: torch.Tensor) -> None:
    """Replace buffer ``leaf`` of ``module`` keeping its persistence flag (``Module._buffers``;
    ``register_buffer`` would reset a non-persistent buffer to persistent)."""
    module._buffers[leaf] = value


# torch.export's shape and dtype checks (an aten op with a leading underscore).
ASSERT_METADATA_OPS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


def is_guards_call(node) -> bool:
    """The ``_guards_fn`` submodule call torch.export adds to check input shapes."""
    return node.op == "call_module" and str(node.target).startswith("_guards_fn")


def recording_stage_class(on_ops):
    """A ``PipelineStage`` subclass that passes every P2P op list it posts to
    ``on_ops(ops, phase, stage_index)``.  The ``get_*_ops`` methods are PipelineStage
    internals; they are the one place where every send and receive buffer is known.

    An instance's ``after_backward`` attribute (None by default), if set, is called as
    ``after_backward(kind)`` after each of its backward actions (``kind``: ``"full"``,
    ``"input"`` or ``"weight"``) and after torch's metadata inference (``"inference"``, a real
    forward and input backward on the first step): torch's weight backward accumulates
    ``param.grad`` by hand, so post-accumulate-grad hooks do not fire there."""
    from torch.distributed.pipelining import PipelineStage

    def recording(name: str, phase: str):
        def method(self, chunk_id):
            if "recv" in name:
                _contiguous_buffers(self, name, chunk_id)
            ops = getattr(PipelineStage, name)(self, chunk_id)
            if "send" in name:
                # A chunk's output (or an input gradient) may be a strided view (a transpose the
                # model returns as is), and gloo sends contiguous buffers only: send a contiguous
                # copy of those (the receiver's buffer is contiguous already).
                for op in ops:
                    if not op.tensor.is_contiguous():
                        op.tensor = op.tensor.contiguous()
            on_ops(ops, phase, self.stage_index)
            return ops

        method.__name__ = name
        return method

    def notifying(name: str, kind_of):
        def method(self, *args, **kwargs):
            out = getattr(PipelineStage, name)(self, *args, **kwargs)
            if self.after_backward is not None:
                self.after_backward(kind_of(*args, **kwargs))
            return out

        method.__name__ = name
        return method

    def backward_kind(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        return "full" if full_backward else "input"

    methods = {name: recording(name, phase) for name, phase in (
        ("get_fwd_recv_ops", "fwd"), ("get_fwd_send_ops", "fwd"),
        ("get_bwd_recv_ops", "bwd"), ("get_bwd_send_ops", "bwd"))}
    methods.update({"backward_one_chunk": notifying("backward_one_chunk", backward_kind),
                    "backward_weight_one_chunk": notifying("backward_weight_one_chunk", lambda *a, **k: "weight"),
                    "_post_metadata_inference_cleanup": notifying("_post_metadata_inference_cleanup",
                                                                  lambda: "inference")})
    methods["after_backward"] = None
    if hasattr(PipelineStage, "_to_tensor"):
        methods["_to_tensor"] = _zeroed_inference_input
    return type("RecordingStage", (PipelineStage,), methods)


def _contiguous_buffers(stage, name: str, chunk_id: int) -> None:
    """torch makes a receive buffer with the strides the sender's tensor had at metadata
    inference; an input gradient can be strided (Zamba2's, the gradient of a transposed use), and
    gloo receives into contiguous buffers only.  The sender sends a contiguous copy (above), so
    a contiguous buffer of the same shape takes it; autograd accepts either layout."""
    infos = (stage.args_recv_info if "fwd" in name else stage.grad_recv_info).get(chunk_id) or ()
    for info in infos:
        buffer = getattr(info, "buffer", None)
        if isinstance(buffer, torch.Tensor) and not buffer.is_contiguous():
            info.buffer = torch.empty(buffer.shape, dtype=buffer.dtype, device=buffer.device)


def _zeroed_inference_input(self, arg):
    """torch's metadata inference runs a real forward of each later stage on inputs made
    from the received metadata with ``empty_strided``: uninitialised memory.  An integer
    input (top-k indices a layer hands to the next, as HY-V4's shared indexer does) then
    holds garbage, and the stage's ``scatter`` / ``gather`` fails out of bounds before the
    first step.  Zeros are in range for any index and finite for any float."""
    from torch.distributed.pipelining import PipelineStage

    tensor = PipelineStage._to_tensor(self, arg)
    if not isinstance(arg, torch.Tensor):  # made from metadata, not a real tensor
        with torch.no_grad():
            tensor.zero_()
    return tensor


def _computation_type():
    from torch.distributed.pipelining.schedules import _ComputationType

    return _ComputationType


def compute_kinds() -> dict:
    """torch's private action types -> autopar's action kinds ``F``, ``B``, ``W``."""
    T = _computation_type()
    return {T.FORWARD: "F", T.FULL_BACKWARD: "B", T.BACKWARD_INPUT: "B", T.BACKWARD_WEIGHT: "W"}


def pipeline_order(schedule) -> list[list[tuple[str, int, int]]]:
    """Per rank, the compute actions a multi-stage torch schedule runs, as ``(kind, stage_index, microbatch_index)``
    tuples grouped per time slot (two for an overlapped forward-backward pair).

    Reads the private ``pipeline_order`` and ``_ComputationType`` of the schedule object."""
    T = _computation_type()
    kinds = compute_kinds()
    out = []
    for rank in sorted(schedule.pipeline_order):
        slots = []
        for a in schedule.pipeline_order[rank]:
            if a is None:
                continue
            subs = a.sub_actions if a.computation_type == T.OVERLAP_F_B else (a,)
            acts = tuple((kinds[s.computation_type], s.stage_index, s.microbatch_index)
                         for s in subs if s.computation_type in kinds)
            if acts:
                slots.append(acts)
        out.append(slots)
    return out


def top_saved_tensors_hooks():
    """The innermost ``saved_tensors_hooks`` pair now active, ``(pack, unpack)``, or None
    (``torch._C._autograd._top_saved_tensors_default_hooks``): activation recompute
    (:mod:`autopar.ops.recompute`) pushes hooks inside torch checkpoint's own and must
    delegate to them; hooks do not chain, and no public API returns the active pair."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def set_default_group_timeout(timeout) -> None:
    """Make ``timeout`` (a timedelta) the timeout of every process group created from now on
    whose creator passes none (``distributed_c10d.default_pg_timeout`` and
    ``default_pg_nccl_timeout``, which ``new_group`` reads through ``_get_default_timeout``).
    ``init_process_group(timeout=...)`` sets only the default group's: the groups
    ``init_device_mesh``, ``new_subgroups_by_enumeration`` and ``DeviceMesh._flatten`` make
    would wait 30 minutes (gloo) or 10 (NCCL) on a dead peer, and ``init_device_mesh`` takes no
    timeout to pass.  (:mod:`autopar.runtime.rendezvous`.)"""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
