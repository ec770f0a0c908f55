"""Which device a rank's program runs on, and moving a traced program there.

A program is traced wherever the user's model is (cpu, cuda or meta, :func:`autopar.frontend.trace.model_device`)
and runs on the rank's own device (:func:`run_device`: ``cuda:LOCAL_RANK`` under NCCL, the CPU
under gloo; in one process without a process group, where the model is).  Three kinds of tensor must follow it there, and this module
moves all of them, so no pass and no runtime part needs to know where the model was traced:

* parameters and buffers: cut and placed by :class:`autopar.runtime.module.ParallelModule`;
* constants torch.export lifted out of the model's code (``torch.tensor(...)`` in a forward),
  held as plain tensor attributes of the graph module or of its sub-graphs (a rotary embedding
  under ``wrap_with_set_grad_enabled``): :func:`move_constants`;
* tensors the graph creates as it runs (``arange``, ``ones``, ``full``, ``_to_copy``, the shape
  checks of ``_assert_tensor_metadata``), whose ``device`` argument the trace recorded as the
  model's device: :func:`retarget_devices` rewrites every such argument.  A device other than
  the traced one (a model that explicitly computes something on the CPU) is left as it is.

The scale simulation is the one exception: a model on the meta device under a fake process
group stays on meta and never holds values (:func:`is_simulation`).  Its program runs the
attention kernel a GPU would (:func:`use_fused_attention`), so that what it allocates and
computes is the GPU's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.frontend.op_sets import SDPA
from autopar.ops.fused_attention import fused_sdpa
from autopar.runtime.mesh import local_device

__all__ = ["run_device", "is_simulation", "retarget_devices", "use_fused_attention", "move_constants", "move_to"]


def run_device(traced: torch.device) -> torch.device:
    """Where a rank's program runs: under a process group the rank's device (``cuda:LOCAL_RANK``
    under NCCL, the CPU under gloo: :func:`autopar.runtime.mesh.local_device`); in one process
    without one, where the model is (a meta-built model: the current GPU if there is one)."""
    if dist.is_initialized():
        return local_device()
    if traced.type == "meta":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return traced


def is_simulation(model: nn.Module) -> bool:
    """A meta-device model under torch's fake process group: the scale simulation (no values)."""
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    return on_meta and dist.is_initialized() and dist.get_backend() == "fake"


def _same(value, device: torch.device) -> bool:
    if isinstance(value, str):
        try:
            value = torch.device(value)
        except RuntimeError:
            return False
    return isinstance(value, torch.device) and value == device


def _retarget(value, src: torch.device, dst: torch.device):
    if _same(value, src):
        return dst
    if isinstance(value, (list, tuple)):
        return type(value)(_retarget(v, src, dst) for v in value)
    if isinstance(value, dict):
        return {k: _retarget(v, src, dst) for k, v in value.items()}
    return value


def retarget_devices(gm: torch.fx.GraphModule, src: torch.device, dst: torch.device) -> int:
    """Rewrite every device argument equal to ``src`` into ``dst``, in ``gm`` and every sub-graph;
    returns how many nodes changed (the graphs are recompiled when any did)."""
    if src == dst:
        return 0
    changed = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        touched = False
        for node in module.graph.nodes:
            args, kwargs = _retarget(node.args, src, dst), _retarget(node.kwargs, src, dst)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                touched = True
                changed += 1
        if touched:
            module.recompile()
    return changed


def use_fused_attention(gm: torch.fx.GraphModule) -> int:
    """Every SDPA node of ``gm`` and its sub-graphs calls :func:`autopar.ops.fused_attention.fused_sdpa`
    (same arguments), which on the meta device runs the fused kernel a CUDA GPU would pick where
    torch's dispatcher would run the math path and materialise the scores; returns how many changed."""
    changed = 0
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        nodes = [n for n in module.graph.nodes if n.op == "call_function" and n.target is SDPA]
        for node in nodes:
            node.target = fused_sdpa
        if nodes:
            module.recompile()
            changed += len(nodes)
    return changed


def move_to(t: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    """``t`` on ``device``; a meta tensor (no values) cannot go to a real device: refused, naming ``what``."""
    if t.device == device:
        return t
    if t.is_meta:
        raise AutoparError(
            f"autopar: {what} is on the meta device and has no values, and nothing loads it; expected a tensor "
            f"autopar can place on {device}. Register it as a buffer of its module (persistent buffers load "
            "with load_pretrained / load_state_dict, any buffer with init_weights), or build it on the CPU.")
    return t.to(device)


def move_constants(gm: torch.fx.GraphModule, device: torch.device) -> int:
    """Move the graph's lifted constants (tensor attributes that are neither parameters nor
    buffers, in ``gm`` and its sub-graphs) to ``device``; returns how many moved."""
    moved = 0
    for prefix, module in gm.named_modules():
        owned = set(module._parameters) | set(module._buffers)
        for name, value in list(vars(module).items()):
            if name in owned or not isinstance(value, torch.Tensor) or value.device == device:
                continue
            where = f"constant '{prefix + '.' if prefix else ''}{name}' of the traced program"
            setattr(module, name, move_to(value, device, where))
            moved += 1
    return moved
