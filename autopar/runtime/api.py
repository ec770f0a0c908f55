"""The public entry points of the runtime: ``init_distributed`` and ``parallelize``.

``parallelize`` runs the whole pipeline on the user's (unmodified) model: the front half
(trace, analyze, validate, rewrite) is :func:`autopar.passes.compile.compile_program`; the
result becomes this rank's :class:`autopar.runtime.module.ParallelModule`, which builds the
device mesh and cuts this rank's parameters out of the user's full tensors.
``plan="auto"`` lets the cost model choose (:mod:`autopar.planning.autoplan`).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.passes.compile import DEFAULT_BUCKET_BYTES, compile_program
from autopar.plan import Plan
from autopar.planning.autoplan import choose_plan
from autopar.runtime.stepping.inductor import torch_compile_options
from autopar.runtime.mesh import world
from autopar.runtime.module import ParallelModule
from autopar.runtime.stepping.precision import cast_inputs, low_precision_copy, mixed_precision_dtype
from autopar.runtime.exit_drain import drain_at_exit
from autopar.runtime.rendezvous import as_timedelta, init_process_group

__all__ = ["init_distributed", "parallelize"]


def init_distributed(backend: str | None = None, *,
                     timeout: float | datetime.timedelta | None = None) -> None:
    """Initialise the default process group from torchrun's environment (NCCL on GPUs, else gloo).

    ``timeout`` (seconds or a ``timedelta``; default :data:`autopar.runtime.rendezvous.DEFAULT_TIMEOUT`,
    10 minutes): a collective whose peer died or hangs raises after this long instead of waiting
    forever, and the step's error names the rank and the collective (:mod:`autopar.runtime.faults`).
    Under torchrun's restarts (``--max-restarts``, c10d rendezvous) every start of the workers
    gets a fresh namespace in torchrun's store (:mod:`autopar.runtime.rendezvous`), so restarted
    ranks never read a dead rank's address."""
    if dist.is_initialized():
        return
    timeout = as_timedelta(timeout)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    init_process_group(backend, timeout)
    drain_at_exit()


def parallelize(model: nn.Module, example_inputs: Sequence[Any], *, example_kwargs: dict | None = None,
                plan: str | Plan = "none", loss_fn: Callable | None = None,
                optimizer: Callable[..., torch.optim.Optimizer] | None = None, example_target: Any = None,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, pipeline_split: Sequence[int] | None = None,
                max_grad_norm: float | None = None,
                lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
                mixed_precision: str | None = None, compile: bool | dict = False,
                init_weights: Callable[[nn.Module], None] | None = None,
                fused_optimizer: bool = True) -> ParallelModule:
    """Compile ``model`` for ``plan`` on the current process group; the model is not modified.

    ``model(*example_inputs, **example_kwargs)`` is the call that is traced; every argument after
    ``example_inputs`` is keyword-only.  ``loss_fn(output, target)`` is traced with the model; ``optimizer`` is a factory called
    with this rank's parameters (default: ``torch.optim.AdamW``).  ``pipeline_split``: layers
    per pipeline chunk (default: balanced by the cost model).  ``max_grad_norm``: clip the
    global gradient norm (every shard, each parameter once) before each step; ``pm.last_grad_norm``
    is the norm before clipping (None without clipping).  ``lr_scheduler``: a factory called with the optimizer of
    this rank, stepped once per ``train_step`` and saved in checkpoints.  ``mixed_precision``:
    ``"bf16"``: bf16 parameters and activations, fp32 master weights, optimizer state, main
    gradients (accumulated and reduced in fp32) and loss; ``state_dict()`` returns the fp32
    masters (:mod:`autopar.runtime.stepping.precision`).  None: train in the model's own dtype.
    ``compile``: True (or a dict of ``torch.compile``'s keyword arguments, e.g.
    ``{"backend": "aot_eager"}``) compiles this rank's program with ``torch.compile``; the
    inserted collectives run eagerly between compiled regions (:mod:`autopar.runtime.stepping.inductor`):
    each pipeline chunk under every schedule, and each recomputed region's body.  ``fused_optimizer`` (default True): for an optimizer of an
    element-wise class (``torch.optim`` Adam, AdamW, SGD, Adagrad, RMSprop, exactly), the tensors it
    steps (the fp32 masters, or the parameters) and their gradients are views of one flat buffer per
    param group, dtype and device, stepped in one update with ``fused=True`` where torch has the
    kernel (ZeRO's flat shards too); ``pm.optimizer`` then holds the flat tensors, while checkpoints,
    ``state_dict`` and schedulers are unchanged (:mod:`autopar.runtime.gradients.fused_step`).  False: the
    optimizer the factory returns, stepping each parameter.

    Devices: the model may be on the CPU, on a GPU or on the meta device, and the example inputs
    anywhere (they stand for shapes and dtypes); the program runs on this rank's device
    (``cuda:LOCAL_RANK`` under NCCL, else the CPU: ``pm.device``), and ``train_step`` moves what it
    is given there.  A model built on the meta device (bigger than one host) gets its values on
    each rank, for that rank's shards only, from ``pm.load_pretrained(hf_dir)``, from
    ``init_weights`` (``fn(module)`` initialising one module in place, e.g. a transformers model's
    ``model._init_weights``, applied as ``model.apply(fn)`` would; :mod:`autopar.runtime.weights.initialize`),
    or from ``pm.load(checkpoint)``; under a fake process group it is the scale simulation.
    """
    _check_arguments(loss_fn, max_grad_norm)
    if dist.is_initialized():
        drain_at_exit()  # a process group the caller made: its gloo workers finish before exit too
    world_size, _ = world()
    dtype = mixed_precision_dtype(mixed_precision)
    auto = isinstance(plan, str) and plan.strip().lower() == "auto"
    options = torch_compile_options(compile)  # a bad value: refused before tracing
    traced_model = low_precision_copy(model, dtype) if dtype is not None else model
    example_inputs = cast_inputs(tuple(example_inputs), dtype)
    if auto:
        plan = _auto_plan(traced_model, example_inputs, example_kwargs, loss_fn, example_target, world_size)
    traced, program = compile_program(traced_model, example_inputs, example_kwargs, plan, loss_fn,
                                      world_size=world_size, example_target=example_target,
                                      bucket_bytes=bucket_bytes, pipeline_split=pipeline_split,
                                      upcast_outputs=dtype is not None)
    return ParallelModule(traced_model, traced, program, program.plan, optimizer or torch.optim.AdamW,
                          max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler,
                          masters_from=model if dtype is not None else None, torch_compile_options=options,
                          init_weights=init_weights, fused_optimizer=fused_optimizer)


def _check_arguments(loss_fn, max_grad_norm) -> None:
    if loss_fn is None:
        raise AutoparError("autopar: parallelize needs loss_fn(output, target) to train the model; "
                           "for a Hugging Face model, e.g. lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten()).")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise AutoparError(f"autopar: max_grad_norm={max_grad_norm}; expected a positive number (or None: no clipping).")


def _auto_plan(model, example_inputs, example_kwargs, loss_fn, example_target, world_size: int) -> Plan:
    structure = analyze(trace_model(model, example_inputs, example_kwargs, loss_fn, example_target).gm)
    ids = example_inputs[0]
    seq = ids.shape[1] if ids.dim() > 1 else 1
    plan = choose_plan(structure, world_size, seq, ids.shape[0])
    if dist.is_initialized() and world_size > 1:
        # Every rank must run the same plan: rank 0's choice, whatever ties between equally
        # priced plans (or the example inputs) might make another rank choose.
        chosen = [str(plan)]
        dist.broadcast_object_list(chosen, src=0)
        plan = Plan.parse(chosen[0])
    return plan
