"""Checkpoints of a :class:`autopar.runtime.module.ParallelModule` with ``torch.distributed.checkpoint``.

What is stored: the model's parameters and buffers under the original model's names
(``model.<name>``) and the optimizer state per original parameter (``optim.<name>.<key>``,
e.g. ``exp_avg``), all as full, unsharded tensors.  Every rank gathers what it holds (TP, EP
and ZeRO shards; under pp only its stage's parameters) and stages its share of the entries
(``ParallelModule.checkpoint_state``, :func:`autopar.runtime.weights.state.writes`: one rank per entry,
chosen from its name), so each tensor is written once, the writes spread over the ranks, and a
rank's host copy is its share, not the whole model (what DCP's deduplication would keep).  On load each rank
reads the entries it holds (``checkpoint_wants``) and cuts its own shards.  This module
does the I/O only and reads nothing private of the module.  Full tensors under plan-independent names are what
make a checkpoint load under any other plan (each rank cuts its own shards on load) and
into the unparallelized model (:func:`load_model_state_dict`).

Export: :func:`export_safetensors` (``pm.export_weights``) writes the full weights alone as
a Hugging Face directory (sharded safetensors, ``config.json``) or one safetensors file, each
rank writing its own pieces without gathering the model (:mod:`autopar.runtime.weights.export`).

Crash safety, asynchronous writes and retention: :mod:`autopar.runtime.weights.checkpoint_files` (the
layout: a link switched atomically to a complete data directory; the newest complete checkpoint;
the checks that refuse a damaged one by name before anything is loaded) and
:mod:`autopar.runtime.weights.checkpoint_writer` (``blocking=False``: DCP's ``async_save`` after the state
is staged in host memory; one save in flight).  Besides model and optimizer, a checkpoint holds
what a run needs to resume: the step, dropout's RNG and the data position
(:mod:`autopar.runtime.weights.train_state`).

Neighbours: :mod:`autopar.runtime.module` (``ParallelModule.save`` / ``load`` /
``wait_checkpoint`` call :func:`save`, :func:`load` and :func:`wait`), :mod:`autopar.runtime.weights.state`
(the state it holds), the gradient-sync strategies (:mod:`autopar.runtime.gradients.grad_sync`,
:mod:`autopar.runtime.gradients.zero`: optimizer state per parameter).
"""
from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.runtime.weights.checkpoint_files import check_files, check_writable, data_dir_of, latest_checkpoint
from autopar.runtime.weights.export import distributed, export_weights, shared_token
from autopar.runtime.weights.safetensors_io import WEIGHTS_NAME
from autopar.runtime.weights.state import MODEL_PREFIX, OPTIM_PREFIX, SCHEDULER_KEY, model_shapes
from autopar.runtime.weights.train_state import DATA_KEY

__all__ = ["save", "wait", "load", "load_model_state_dict", "read_entries", "latest_checkpoint", "MODEL_PREFIX", "OPTIM_PREFIX",
           "SCHEDULER_KEY", "export_safetensors", "SAFETENSORS_NAME"]

# Entry names (autopar/runtime/weights/state.py): ``model.<original name>``, ``optim.<original name>.<state
# key>``, and the learning-rate scheduler's pickled state dict as one uint8 tensor.


def save(pm, path: str | os.PathLike, *, blocking: bool = True, keep: int | None = None, data=None,
         overlap_steps: int | None = None) -> None:
    """Write ``pm``'s state (model, optimizer, schedule, step, dropout RNG, ``data``'s position) as
    the checkpoint ``path`` (collective: call on every rank).  ``blocking=False`` returns once the
    state is staged in host memory and writes in the background (:func:`wait` joins it);
    ``overlap_steps=k``: the write may overlap the forward and backward of the next ``k`` steps,
    and the ``k``-th step's update waits for it (so a failure loses at most the steps since the
    previous save, as with blocking saves; None: no bound).  ``keep``: then remove the complete
    checkpoints of ``path``'s directory beyond the ``keep`` newest."""
    path = os.path.abspath(os.fspath(path))
    check_writable(path)
    for name, value in (("keep", keep), ("overlap_steps", overlap_steps)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise AutoparError(f"autopar: pm.save({name}={value!r}); expected a whole number >= 1, or None (no limit).")
    writer = pm.checkpoint_writer
    writer.wait()  # one save in flight: the previous one finishes (and may raise) first
    # A background save stages into the writer's buffers, kept from one save to the next (the
    # previous save is complete: waited for above); a blocking one into memory freed after it.
    state = pm.checkpoint_state(data=data, into=None if blocking else writer.staging)
    data_dir, tmp_dir = data_dir_of(path, shared_token())
    info = {"step": pm.num_steps_taken, "plan": str(pm.plan), "world_size": pm.plan.world_size, "format": 2}
    writer.write(state, path, tmp_dir, data_dir, info, blocking=blocking, keep=keep, overlap_steps=overlap_steps)


def wait(pm) -> None:
    """Join ``pm``'s save in flight (``blocking=False``), raising what made it fail."""
    pm.checkpoint_writer.wait()


def _metadata(data_dir: str):
    return dcp.FileSystemReader(data_dir).read_metadata()


def _read(path: str, metadata, wanted) -> dict[str, torch.Tensor]:
    """The entries ``wanted(key)`` of the checked checkpoint ``path``, in fresh tensors (nothing is
    loaded into a program until every rank has read all it needs)."""
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and wanted(k)}
    try:
        dcp.load(state, checkpoint_id=os.path.realpath(path), no_dist=not distributed())
    except BaseException as exc:  # DCP's CheckpointException (a BaseException), raised on every rank
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(exc, "failures", None) or {}
        first = next(iter(failures.values()), (exc, None))[0]
        where = f" on rank(s) {sorted(failures)}" if failures else ""
        raise AutoparError(f"autopar: reading checkpoint {path} failed{where} ({type(first).__name__}: {first}); "
                           "expected intact files; nothing was loaded; load an earlier checkpoint "
                           "(autopar.latest_checkpoint(dir)).") from None
    return state


def _check_model(pm, path: str, metadata, data) -> None:
    """Refuse a checkpoint of another model (its ``model.*`` entries and shapes), or one without
    the data position asked for, on every rank alike (the index is the same everywhere)."""
    saved = {k[len(MODEL_PREFIX):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
             if k.startswith(MODEL_PREFIX)}
    model = model_shapes(pm.params)
    missing = sorted(set(model) - set(saved))
    unexpected = sorted(set(saved) - set(model))
    shapes = [f"{name}: {saved[name]} in the checkpoint, {model[name]} in the model"
              for name in sorted(set(saved) & set(model)) if saved[name] != model[name]]
    if missing or unexpected or shapes:
        parts = [f"{len(v)} {what} ({', '.join(v[:3])}{', ...' if len(v) > 3 else ''})"
                 for v, what in ((missing, "of the model's tensors missing"), (unexpected, "tensors the model lacks"),
                                 (shapes, "tensors of other shapes")) if v]
        raise AutoparError(f"autopar: checkpoint {path} is not of this model: {'; '.join(parts)}; expected the "
                           "tensors of this model's state_dict() with their shapes; nothing was loaded; load a "
                           "checkpoint saved from this model.")
    if data is not None and DATA_KEY not in metadata.state_dict_metadata:
        raise AutoparError(f"autopar: checkpoint {path} holds no data position (saved without pm.save(..., data=...)); "
                           "expected one for pm.load(..., data=...); load without data= and position the data "
                           "yourself, or save with data=.")


def load_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict stored at ``path``, for the unparallelized model's ``load_state_dict``."""
    path = os.path.abspath(os.fspath(path))
    _, metadata = check_files(path, _metadata)
    state = _read(path, metadata, lambda k: k.startswith(MODEL_PREFIX))
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}


def read_entries(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor entry of the checkpoint at ``path`` under its entry name (``model.*``, ``optim.*``,
    ``train.*``, ...), sorted by name, after the checks of a damaged checkpoint (collective under a
    process group: DCP reads with every rank)."""
    path = os.path.abspath(os.fspath(path))
    _, metadata = check_files(path, _metadata)
    return dict(sorted(_read(path, metadata, lambda k: True).items()))


def load(pm, path: str | os.PathLike, *, data=None) -> None:
    """Load a checkpoint saved under any plan into ``pm`` (and ``data``'s position into ``data``;
    collective).  A damaged checkpoint, or one of another model, is refused by name on every
    rank before anything is loaded."""
    wait(pm)
    path = os.path.abspath(os.fspath(path))
    _, metadata = check_files(path, _metadata)
    _check_model(pm, path, metadata, data)
    state = _read(path, metadata, lambda k: pm.checkpoint_wants(k, data=data))
    pm.load_checkpoint_state(state, data=data)


# --- full-weights export (autopar/runtime/weights/export.py) ----------------------------------------

# The file name Hugging Face's save_pretrained / from_pretrained use for one unsharded file.
SAFETENSORS_NAME = WEIGHTS_NAME


def export_safetensors(pm, path: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> str:
    """``pm.export_weights(path)``: the full weights under the original names, no rank gathering
    them; a Hugging Face directory, or one file for a path ending in ``.safetensors``
    (:func:`autopar.runtime.weights.export.export_weights`; collective: call on every rank)."""
    return export_weights(pm.params, path, max_shard_size=max_shard_size)
