"""State dicts and checkpoint state of a :class:`autopar.runtime.module.ParallelModule`.

Two forms, both under the original model's names and plan-independent:

* :func:`state_dict` / :func:`load_state_dict`: full, unsharded tensors on every rank (the
  pp rank owning a tensor broadcasts it), as ``model.state_dict()`` would give them;
* :func:`checkpoint_state` / :func:`checkpoint_wants` / :func:`load_checkpoint_state`: what
  this rank holds, as full tensors on the CPU, with the optimizer state per parameter and the
  learning-rate scheduler, under the entry names ``model.<name>``, ``optim.<name>.<key>`` and
  ``sched.state`` (:data:`MODEL_PREFIX`, :data:`OPTIM_PREFIX`, :data:`SCHEDULER_KEY`), with
  the step, dropout's RNG and the data position of :mod:`autopar.runtime.weights.train_state`;
  :mod:`autopar.runtime.weights.checkpoint` does the I/O.

A tensor's whole value is gathered over the axes that cut it (tp, ep:
:func:`autopar.runtime.weights.layout.gather_full`) from what the gradient-sync strategy holds
(``grad_sync.full_parameters()``: whole over ``dp``, the fp32 master under mixed precision);
loading cuts this rank's piece again (:func:`autopar.runtime.weights.layout.shard_local`) and writes it
back through the same strategy.  ``ParallelModule.state_dict``, ``load_state_dict``,
``checkpoint_state``, ``checkpoint_wants`` and ``load_checkpoint_state`` call these functions.
"""
from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.weights.layout import gather_full
from autopar.runtime.weights.train_state import load_train_entries, pickled, train_entries, train_wants, unpickled

__all__ = ["state_dict", "load_state_dict", "checkpoint_state", "writes", "checkpoint_wants", "load_checkpoint_state",
           "model_shapes", "MODEL_PREFIX", "OPTIM_PREFIX", "SCHEDULER_KEY"]

# Entry names: ``model.<original name>``, ``optim.<original name>.<state key>``, and the
# learning-rate scheduler's pickled state dict as one uint8 tensor.
MODEL_PREFIX, OPTIM_PREFIX, SCHEDULER_KEY = "model.", "optim.", "sched.state"


def _full(params, name: str, local: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """The full tensor of graph parameter ``name`` from this rank's piece of it (collective over tp/ep);
    ``copy=False``: it may be ``local`` itself (the caller copies)."""
    shards = params.shards_of(name)
    if not shards or local.dim() == 0:
        return local.clone() if copy else local
    full = gather_full(local.contiguous(), shards, params.groups, params.coords(), params.full_shape(name))
    return full.clone() if copy else full


def _host_copy(t: torch.Tensor, dtype: torch.dtype | None = None, into: dict | None = None,
               key: str = "") -> torch.Tensor:
    """A copy of ``t`` in host memory, one copy whatever the device (a checkpoint's staged value);
    with ``into``, in its buffer ``key`` when it has one of that shape and dtype (kept there for
    the next save: copying into memory already mapped is ~4x faster than into fresh pages)."""
    dtype = dtype or t.dtype
    if into is None:
        return t.to(device="cpu", dtype=dtype, copy=True)
    buffer = into.get(key)
    if buffer is None or buffer.shape != t.shape or buffer.dtype != dtype:
        buffer = into[key] = torch.empty(t.shape, dtype=dtype, device="cpu")
    return buffer.copy_(t)


def _local(params, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of graph parameter ``name`` cut from the full tensor."""
    if full.dim() == 0:
        return full.clone()
    return params.local(full, name).to(params.device)


# --- full state dicts ---------------------------------------------------------------------

def state_dict(params) -> dict[str, torch.Tensor]:
    """Full, unsharded tensors under the original model's names (identical on every rank);
    ``params``: the rank's :class:`autopar.runtime.weights.parameters.RankParameters`."""
    out = {}
    groups = params.groups
    with params.full_values() as values:
        for orig, name in params.aliases.items():
            owner = params.owner(name)
            if params.holds(name):
                full = _full(params, name, params.tensor(name, values).detach()).to(params.orig_dtypes[orig])
            else:
                full = torch.empty(params.full_shape(name), dtype=params.orig_dtypes[orig], device=params.device)
            if owner is not None and "pp" in groups and groups["pp"].size > 1:  # owner broadcasts
                dist.broadcast(full, group=groups["pp"].group, group_src=owner)
            out[orig] = full
    return out


def _check_keys(params, keys, needed) -> None:
    missing = sorted(set(needed) - set(keys))
    unexpected = sorted(set(keys) - set(params.aliases))
    if missing or unexpected:
        raise AutoparError(f"autopar: state dict does not match the model: missing keys {missing[:5]}"
                           f"{'...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                           f"{'...' if len(unexpected) > 5 else ''}; expected the original model's keys.")


def load_state_dict(params, state_dict: dict[str, torch.Tensor]) -> None:
    """Load full tensors (from ``state_dict()`` of any plan, or of the original model)."""
    _check_keys(params, state_dict, params.aliases)
    _load_model_entries(params, state_dict)


def _load_model_entries(params, state_dict: dict[str, torch.Tensor]) -> None:
    """This rank's pieces of the full tensors ``state_dict`` (original names) written into ``params``."""
    with torch.no_grad(), params.full_values(write_back=True) as values:
        for orig, name in params.aliases.items():
            if not params.holds(name):
                continue
            target = params.tensor(name, values)
            local = params.local(state_dict[orig], name)
            if local.shape != target.shape:
                raise AutoparError(f"autopar: state dict entry '{orig}' has shape {tuple(state_dict[orig].shape)}; "
                                   f"expected the full shape of the original parameter.")
            target.copy_(local)
            params.unset.discard(name)


# --- checkpoint state (autopar/runtime/weights/checkpoint.py does the I/O) -----------------------

def writes(pm, key: str, name: str) -> bool:
    """Whether this rank is the one that stages and writes checkpoint entry ``key`` of graph tensor
    ``name``.  Every rank of the pipeline stages holding ``name`` has its full value (gathered over
    tp, ep and, under ZeRO, dp), so one of them, chosen from the key alone (the same choice on every
    rank, no message), copies and writes it: a rank's staged copy is its share of the checkpoint,
    not the whole model, and the writes spread over the ranks."""
    if not dist.is_initialized() or pm.plan.world_size == 1:
        return True
    per_stage = pm.plan.world_size // pm.plan.pp
    stages = pm.params.holders(name)
    stages = range(pm.plan.pp) if stages is None else sorted(stages)
    candidates = [p * per_stage + i for p in stages for i in range(per_stage)]
    return candidates[zlib.crc32(key.encode()) % len(candidates)] == dist.get_rank()


def checkpoint_state(pm, data: Any = None, into: dict | None = None) -> dict[str, torch.Tensor]:
    """The entries this rank writes (:func:`writes`), as full tensors copied to host memory, under
    plan-independent keys: ``model.<name>`` for parameters and buffers, ``optim.<name>.<key>`` for
    optimizer state, ``sched.state`` for the learning-rate scheduler, and the step, dropout's RNG
    and ``data``'s position (:mod:`autopar.runtime.weights.train_state`); the union over the ranks is the
    checkpoint.  Collective: call on every rank, in the training thread (the gathers, and ZeRO's
    reads, are collectives every rank issues in the same order); the result shares no memory with
    the program, so training may go on while it is written.  ``into``: host buffers by entry name,
    reused and refilled (a background save's staging memory, kept from one save to the next)."""
    state = {}
    params = pm.params
    with params.full_values() as values:
        for orig, name in params.aliases.items():
            if params.holds(name):
                full = _full(params, name, params.tensor(name, values).detach(), copy=False)
                if writes(pm, MODEL_PREFIX + orig, name):
                    state[MODEL_PREFIX + orig] = _host_copy(full, params.orig_dtypes[orig], into, MODEL_PREFIX + orig)
    to_orig = params.graph_to_original()
    for name, entries in sorted(pm.grad_sync.optimizer_state().items()):
        for key, value in sorted(entries.items()):
            value = value if torch.is_tensor(value) else torch.tensor(value)
            full = _full(params, name, value.detach(), copy=False)
            entry = f"{OPTIM_PREFIX}{to_orig[name]}.{key}"
            if writes(pm, entry, name):
                state[entry] = _host_copy(full, None, into, entry)
    if pm.lr_scheduler is not None:  # the same on every rank; stored as its pickled state dict
        state[SCHEDULER_KEY] = pickled(pm.lr_scheduler.state_dict())
    state.update(train_entries(pm, data))
    return state


def model_shapes(params) -> dict[str, tuple[int, ...]]:
    """Original name -> full shape of every tensor of the model's state dict (what a checkpoint of
    this model holds under ``model.<name>``, whatever rank holds it)."""
    return {orig: tuple(params.full_shape(name)) for orig, name in params.aliases.items()}


def checkpoint_wants(pm, key: str, data: Any = None) -> bool:
    """Whether this rank loads checkpoint entry ``key`` (its own parameters' entries, the
    training state; ``data.state`` only with ``data``)."""
    train = train_wants(pm, key, data)
    if train is not None:
        return train
    if key == SCHEDULER_KEY:
        return pm.lr_scheduler is not None
    if key.startswith(MODEL_PREFIX):
        name = pm.params.aliases.get(key[len(MODEL_PREFIX):])
        return name is not None and pm.holds(name)
    if key.startswith(OPTIM_PREFIX):
        orig = key[len(OPTIM_PREFIX):].rpartition(".")[0]
        name = pm.params.aliases.get(orig)
        return name is not None and pm.holds(name)
    return False


def load_checkpoint_state(pm, state: dict[str, torch.Tensor], data: Any = None) -> None:
    """Load what :func:`checkpoint_state` wrote (under any plan) into this rank (collective)."""
    params = pm.params
    model = {k[len(MODEL_PREFIX):]: v for k, v in state.items() if k.startswith(MODEL_PREFIX)}
    _check_keys(params, model, [o for o, n in params.aliases.items() if params.holds(n)])
    _load_model_entries(params, model)
    entries: dict[str, dict[str, torch.Tensor]] = {}
    for name, orig in params.graph_to_original().items():
        prefix = f"{OPTIM_PREFIX}{orig}."
        found = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if found and params.holds(name):
            entries[name] = {key: _local(params, name, v) for key, v in found.items()}
    pm.grad_sync.load_optimizer_state(entries)
    if pm.lr_scheduler is not None and SCHEDULER_KEY in state:
        pm.lr_scheduler.load_state_dict(unpickled(state[SCHEDULER_KEY]))
        # The next step runs at the restored rate (a scheduler sets it only when it steps).
        for group, lr in zip(pm.optimizer.param_groups, pm.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    load_train_entries(pm, state, data)
