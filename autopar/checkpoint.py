"""Checkpoints of a :class:`autopar.runtime.ParallelModule` with ``torch.distributed.checkpoint``.

What is stored: the model's parameters and buffers under the original model's names
(``model.<name>``) and the optimizer state per original parameter (``optim.<name>.<key>``,
e.g. ``exp_avg``), all as full, unsharded tensors.  Every rank can rebuild them (the
runtime's ``state_dict()``; ZeRO and TP optimizer shards are gathered here), and DCP's
save planner deduplicates identical entries so each tensor is written once, by one rank,
with the writes spread over the ranks.  Full tensors under plan-independent names are what
make a checkpoint load under any other plan (each rank cuts its own shards on load) and
into the unparallelized model (:func:`load_model_state_dict`).

Crash safety: the data go to a fresh directory ``<path>.data-<token>.tmp``; only after
every rank finished writing is it renamed to ``<path>.data-<token>``, and ``<path>`` (a
symbolic link) is switched to it with one atomic ``os.replace``; the previous data
directory is deleted last.  A save killed at any point leaves ``<path>`` pointing at the
last complete checkpoint.

Neighbours: :mod:`autopar.runtime` (``ParallelModule.save`` / ``load`` call :func:`save` and
:func:`load`), :mod:`autopar.zero` (the flat shard layout of ZeRO optimizer state),
:mod:`autopar.layout` (cutting and gathering TP shards).
"""
from __future__ import annotations

import os
import shutil
import uuid

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.layout import gather_full, shard_local

__all__ = ["save", "load", "load_model_state_dict"]

_MODEL, _OPTIM = "model.", "optim."


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _graph_to_original(pm) -> dict[str, str]:
    out: dict[str, str] = {}
    for orig, name in pm._aliases.items():
        out.setdefault(name, orig)
    return out


def _local_optimizer_state(pm) -> dict[str, dict[str, torch.Tensor]]:
    """Graph parameter name -> {state key: this rank's tp-local tensor} (ZeRO shards gathered over dp)."""
    from autopar.zero import ZeroSync

    sync, opt = pm._sync, pm.optimizer
    out: dict[str, dict[str, torch.Tensor]] = {}
    if isinstance(sync, ZeroSync):
        for unit, (shard, lay) in enumerate(zip(sync.shards, sync.layouts)):
            for key, value in opt.state.get(shard, {}).items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    for x in lay.names:
                        out.setdefault(x, {})[key] = value
                    continue
                buf = value.detach().contiguous()
                if sync.n > 1:
                    full = torch.empty(sync.n * lay.shard_numel, dtype=buf.dtype, device=buf.device)
                    dist.all_gather_single(full, buf, group=sync.groups["dp"].group)
                    buf = full
                for x, v in lay.views(lay.from_rank_major(buf)).items():
                    out.setdefault(x, {})[key] = v.clone()
        return out
    by_id = {id(p): n for n, p in pm.gm.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                out.setdefault(by_id[id(p)], {})[key] = value
    return out


def _full_state(pm) -> dict[str, torch.Tensor]:
    state = {_MODEL + k: v for k, v in pm.state_dict().items()}
    coords = pm._coords()
    to_orig = _graph_to_original(pm)
    for name, entries in sorted(_local_optimizer_state(pm).items()):
        shards = pm.ctx.param_shards.get(name, {})
        for key, value in sorted(entries.items()):
            value = value if torch.is_tensor(value) else torch.tensor(value)
            if value.dim() and shards:
                value = gather_full(value.contiguous(), shards, pm._groups, coords, pm._full_shapes.get(name))
            state[f"{_OPTIM}{to_orig[name]}.{key}"] = value.detach().cpu().clone()
    return state


def _shared_token() -> str:
    token = [uuid.uuid4().hex[:12]]
    if _dist():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def save(pm, path: str | os.PathLike) -> None:
    """Write ``pm``'s model and optimizer state to ``path`` (collective: call on every rank)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.islink(path):
        raise AutoparError(f"autopar: checkpoint path {path} exists and is not an autopar checkpoint link; "
                           "expected a new path or one written by ParallelModule.save; choose another path.")
    state = _full_state(pm)
    token = _shared_token()
    data_dir = f"{path}.data-{token}"
    tmp_dir = data_dir + ".tmp"
    dcp.save(state, checkpoint_id=tmp_dir, no_dist=not _dist())
    if _dist():
        dist.barrier()
    if not _dist() or dist.get_rank() == 0:
        old = os.path.realpath(path) if os.path.islink(path) else None
        os.rename(tmp_dir, data_dir)
        link = f"{path}.link-{token}"
        os.symlink(os.path.basename(data_dir), link)
        os.replace(link, path)  # atomic: readers see the old or the new checkpoint, never a mix
        if old and old != data_dir and os.path.isdir(old):
            shutil.rmtree(old, ignore_errors=True)
    if _dist():
        dist.barrier()


def _read(path: str, prefix: str | None = None) -> dict[str, torch.Tensor]:
    if not os.path.exists(path):
        raise AutoparError(f"autopar: no checkpoint at {path}; expected a path written by ParallelModule.save.")
    meta = dcp.FileSystemReader(path).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and (prefix is None or k.startswith(prefix))}
    dcp.load(state, checkpoint_id=path, no_dist=not _dist())
    return state


def load_model_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full model state dict stored at ``path``, for the unparallelized model's ``load_state_dict``."""
    state = _read(os.path.abspath(os.fspath(path)), _MODEL)
    return {k[len(_MODEL):]: v for k, v in state.items()}


def load(pm, path: str | os.PathLike) -> None:
    """Load model and optimizer state saved under any plan into ``pm`` (collective)."""
    from autopar.zero import ZeroSync

    state = _read(os.path.abspath(os.fspath(path)))
    pm.load_state_dict({k[len(_MODEL):]: v for k, v in state.items() if k.startswith(_MODEL)})
    coords = pm._coords()
    to_orig = _graph_to_original(pm)
    params = dict(pm.gm.named_parameters())

    def entries(name: str) -> dict[str, torch.Tensor]:
        prefix = f"{_OPTIM}{to_orig[name]}."
        return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}

    def local(name: str, value: torch.Tensor) -> torch.Tensor:
        if value.dim() == 0:
            return value.clone()
        return shard_local(value, pm.ctx.param_shards.get(name, {}), coords).to(pm.device)

    sync, opt = pm._sync, pm.optimizer
    if isinstance(sync, ZeroSync):
        rank = sync.groups["dp"].rank if "dp" in sync.groups else 0
        for shard, lay in zip(sync.shards, sync.layouts):
            per_name = {x: entries(x) for x in lay.names}
            keys = set.intersection(*(set(e) for e in per_name.values()))
            new = {}
            for key in sorted(keys):
                first = per_name[lay.names[0]][key]
                if first.dim() == 0:
                    new[key] = first.clone()
                    continue
                flat = lay.rank_major(lay.flatten({x: local(x, per_name[x][key]) for x in lay.names}))
                new[key] = flat.view(sync.n, -1)[rank].clone().to(shard.dtype)
            if new:
                opt.state[shard] = new
        return
    for name, p in params.items():
        found = entries(name) if name in to_orig else {}
        if found:
            opt.state[p] = {key: local(name, v).to(p.dtype) if v.dim() else v.clone() for key, v in found.items()}
