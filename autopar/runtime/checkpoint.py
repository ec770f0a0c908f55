"""Checkpoints of a :class:`autopar.runtime.module.ParallelModule` with ``torch.distributed.checkpoint``.

What is stored: the model's parameters and buffers under the original model's names
(``model.<name>``) and the optimizer state per original parameter (``optim.<name>.<key>``,
e.g. ``exp_avg``), all as full, unsharded tensors.  Each rank contributes what it holds
(``ParallelModule.checkpoint_state``, :mod:`autopar.runtime.state`: TP, EP and ZeRO shards gathered; under pp only its
stage's parameters), and DCP's save planner deduplicates identical entries so each tensor
is written once, by one rank, with the writes spread over the ranks.  On load each rank
reads the entries it holds (``checkpoint_wants``) and cuts its own shards.  This module
does the I/O only and reads nothing private of the module.  Full tensors under plan-independent names are what
make a checkpoint load under any other plan (each rank cuts its own shards on load) and
into the unparallelized model (:func:`load_model_state_dict`).

Export: :func:`export_safetensors` (``pm.export_weights``) writes the full weights alone as
a Hugging Face directory (sharded safetensors, ``config.json``) or one safetensors file, each
rank writing its own pieces without gathering the model (:mod:`autopar.runtime.export`).

Crash safety: the data go to a fresh directory ``<path>.data-<token>.tmp``; only after
every rank finished writing is it renamed to ``<path>.data-<token>``, and ``<path>`` (a
symbolic link) is switched to it with one atomic ``os.replace``; the previous data
directory is deleted last.  A save killed at any point leaves ``<path>`` pointing at the
last complete checkpoint.

Neighbours: :mod:`autopar.runtime.module` (``ParallelModule.save`` / ``load`` call
:func:`save` and :func:`load`), :mod:`autopar.runtime.state` (the state it holds), the gradient-sync strategies
(:mod:`autopar.runtime.grad_sync`, :mod:`autopar.runtime.zero`: optimizer state per parameter).
"""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.runtime.export import distributed, export_weights, shared_token
from autopar.runtime.safetensors_io import WEIGHTS_NAME
from autopar.runtime.state import MODEL_PREFIX, OPTIM_PREFIX, SCHEDULER_KEY

__all__ = ["save", "load", "load_model_state_dict", "MODEL_PREFIX", "OPTIM_PREFIX", "SCHEDULER_KEY",
           "export_safetensors", "SAFETENSORS_NAME"]

# Entry names (autopar/runtime/state.py): ``model.<original name>``, ``optim.<original name>.<state
# key>``, and the learning-rate scheduler's pickled state dict as one uint8 tensor.


def save(pm, path: str | os.PathLike) -> None:
    """Write ``pm``'s model and optimizer state to ``path`` (collective: call on every rank)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.islink(path):
        raise AutoparError(f"autopar: checkpoint path {path} exists and is not an autopar checkpoint link; "
                           "expected a new path or one written by ParallelModule.save; choose another path.")
    state = pm.checkpoint_state()
    token = shared_token()
    data_dir = f"{path}.data-{token}"
    tmp_dir = data_dir + ".tmp"
    dcp.save(state, checkpoint_id=tmp_dir, no_dist=not distributed())
    if distributed():
        dist.barrier()
    if not distributed() or dist.get_rank() == 0:
        old = os.path.realpath(path) if os.path.islink(path) else None
        os.rename(tmp_dir, data_dir)
        link = f"{path}.link-{token}"
        os.symlink(os.path.basename(data_dir), link)
        os.replace(link, path)  # atomic: readers see the old or the new checkpoint, never a mix
        if old and old != data_dir and os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
    if distributed():
        dist.barrier()


def _read(path: str, wanted) -> dict[str, torch.Tensor]:
    if not os.path.exists(path):
        raise AutoparError(f"autopar: no checkpoint at {path}; expected a path written by ParallelModule.save.")
    meta = dcp.FileSystemReader(path).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and wanted(k)}
    dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    return state


def load_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict stored at ``path``, for the unparallelized model's ``load_state_dict``."""
    state = _read(os.path.abspath(os.fspath(path)), lambda k: k.startswith(MODEL_PREFIX))
    return {k[len(MODEL_PREFIX):]: v for k, v in state.items()}


def load(pm, path: str | os.PathLike) -> None:
    """Load model and optimizer state saved under any plan into ``pm`` (collective)."""
    pm.load_checkpoint_state(_read(os.path.abspath(os.fspath(path)), pm.checkpoint_wants))


# --- full-weights export (autopar/runtime/export.py) ----------------------------------------

# The file name Hugging Face's save_pretrained / from_pretrained use for one unsharded file.
SAFETENSORS_NAME = WEIGHTS_NAME


def export_safetensors(pm, path: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> str:
    """``pm.export_weights(path)``: the full weights under the original names, no rank gathering
    them; a Hugging Face directory, or one file for a path ending in ``.safetensors``
    (:func:`autopar.runtime.export.export_weights`; collective: call on every rank)."""
    return export_weights(pm, path, max_shard_size=max_shard_size)
