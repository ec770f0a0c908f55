"""A checkpoint on disk: its names, the atomic switch, retention, the newest complete one, and its checks.

Layout of a checkpoint saved at ``<path>``:

    <path>                      a symbolic link to the data directory below (what users name)
    <path>.data-<token>/        torch.distributed.checkpoint's files: ``.metadata`` (the index)
                                and ``__<rank>_<n>.distcp`` (the tensors), plus ``autopar.json``
    <path>.data-<token>.tmp/    the same while it is being written

The data go to the ``.tmp`` directory; once every rank has written its part (DCP's finish
step, which writes ``.metadata`` after gathering every rank's results), rank 0 writes
``autopar.json`` (the step and the plan), renames the directory and switches the link with one
atomic ``os.replace`` (:func:`commit`).  A save killed at any point leaves ``<path>`` at the
last complete checkpoint; a ``.tmp`` directory is never a checkpoint.

Retention (``pm.save(path, keep=K)``, :func:`retain`): after a commit, the complete checkpoints
of ``path``'s directory beyond the ``K`` newest are removed, so a newer one always exists
before an older one goes.  :func:`latest_checkpoint` is the newest complete checkpoint of a
directory, by its commit time (``autopar.json``, with the step it was saved at).

Checks before a load (:func:`check_files`), the same on every rank since they read only the
shared files, so every rank refuses together and nothing is loaded: the link's target exists,
is not half-written, has its index, and every file the index names exists and is long enough.

Neighbours: :mod:`autopar.runtime.weights.checkpoint` (save, load and the background writer call
these), :mod:`autopar.runtime.weights.train_state` (the step recorded here).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from autopar.errors import AutoparError

__all__ = ["INFO_NAME", "CheckpointInfo", "data_dir_of", "commit", "retain", "list_checkpoints",
           "latest_checkpoint", "check_writable", "check_files"]

INFO_NAME = "autopar.json"  # rank 0 writes it into a checkpoint's data directory at the commit
_METADATA = ".metadata"     # DCP's index of a checkpoint (FileSystemWriter writes it last)
_DATA = ".data-"
_TMP = ".tmp"


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint: its link, its data directory and what ``autopar.json`` says."""

    path: str
    data_dir: str
    step: int          # optimizer steps taken when it was saved (-1: not recorded)
    committed: float   # time of the commit (seconds since the epoch)
    plan: str = ""
    world_size: int = 0


def data_dir_of(path: str, token: str) -> tuple[str, str]:
    """The data directory of a save of ``path`` and the temporary directory it is written to."""
    data_dir = f"{path}{_DATA}{token}"
    return data_dir, data_dir + _TMP


def check_writable(path: str) -> None:
    """Refuse to save over something that is not an autopar checkpoint link."""
    if os.path.lexists(path) and not os.path.islink(path):
        raise AutoparError(f"autopar: checkpoint path {path} exists and is not an autopar checkpoint link; "
                           "expected a new path or one written by ParallelModule.save; choose another path.")


def commit(path: str, tmp_dir: str, data_dir: str, info: dict) -> None:
    """Rank 0, once every rank's part of ``tmp_dir`` is written: record ``info``, rename the
    directory, switch ``path`` to it atomically, then remove what ``path`` pointed to before and
    the leftovers of killed saves of ``path``."""
    with open(os.path.join(tmp_dir, INFO_NAME), "w") as f:
        json.dump({**info, "committed": time.time()}, f)
    old = os.path.realpath(path) if os.path.islink(path) else None
    os.rename(tmp_dir, data_dir)
    link = f"{path}.link-{os.path.basename(data_dir).rpartition('-')[2]}"
    os.symlink(os.path.basename(data_dir), link)
    os.replace(link, path)  # atomic: readers see the old or the new checkpoint, never a mix
    if old and old != data_dir and os.path.isdir(old):
        shutil.rmtree(old, ignore_errors=True)
    prefix = os.path.basename(path) + _DATA
    for name in os.listdir(os.path.dirname(path)):  # killed saves of this path (one save at a time)
        if name.startswith(prefix) and name.endswith(_TMP):
            shutil.rmtree(os.path.join(os.path.dirname(path), name), ignore_errors=True)


def _info(path: str) -> CheckpointInfo | None:
    """``path``'s checkpoint if it is a link to a complete data directory of its own, else None."""
    if not os.path.islink(path):
        return None
    target = os.readlink(path)
    data_dir = os.path.join(os.path.dirname(path), target)
    if (os.path.dirname(target) or not target.startswith(os.path.basename(path) + _DATA)
            or target.endswith(_TMP) or not os.path.isfile(os.path.join(data_dir, _METADATA))):
        return None
    try:
        with open(os.path.join(data_dir, INFO_NAME)) as f:
            meta = json.load(f)
    except (OSError, ValueError):  # written before autopar.json existed: ordered by the link's age
        meta = {"step": -1, "committed": os.lstat(path).st_mtime}
    return CheckpointInfo(path, data_dir, int(meta.get("step", -1)), float(meta.get("committed", 0.0)),
                          str(meta.get("plan", "")), int(meta.get("world_size", 0)))


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """The complete checkpoints whose links are in ``directory``, oldest first: by commit time (a
    run resumed from an older checkpoint makes its own saves the newest), then step."""
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(directory):
        return []
    found = [_info(os.path.join(directory, name)) for name in os.listdir(directory)]
    return sorted((c for c in found if c is not None), key=lambda c: (c.committed, c.step, c.path))


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under ``directory`` (the path to pass to ``pm.load``), or None."""
    found = list_checkpoints(directory)
    return found[-1].path if found else None


def retain(path: str, keep: int) -> None:
    """Remove the complete checkpoints of ``path``'s directory beyond the ``keep`` newest, never
    ``path`` itself, just committed (link first, then data: a reader never finds a link to a
    half-removed directory), and what killed saves left there (one save runs at a time, and this
    one is complete)."""
    directory = os.path.dirname(path)
    others = [c for c in list_checkpoints(directory) if c.path != path]
    for old in others[:max(0, len(others) - (keep - 1))]:
        os.unlink(old.path)
        shutil.rmtree(old.data_dir, ignore_errors=True)
    for name in os.listdir(directory):
        if _DATA in name and name.endswith(_TMP):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def check_files(path: str, metadata_reader) -> tuple[str, object]:
    """The data directory of the checkpoint at ``path`` and its DCP metadata, after checking that
    every file it needs is there and whole; an ``autopar:`` error naming the file otherwise.
    ``metadata_reader(dir)`` reads the index (DCP's ``FileSystemReader(dir).read_metadata``)."""
    hint = ("load an earlier checkpoint (autopar.latest_checkpoint(dir) finds the newest complete one)")
    if not os.path.lexists(path):
        raise AutoparError(f"autopar: no checkpoint at {path}; expected a path written by ParallelModule.save.")
    data_dir = os.path.realpath(path)
    if not os.path.exists(data_dir):
        raise AutoparError(f"autopar: checkpoint {path} points to {data_dir}, which is missing (removed by "
                           f"retention or by hand); expected its data directory; {hint}.")
    if data_dir.endswith(_TMP):
        raise AutoparError(f"autopar: {path} is a half-written checkpoint directory (a save that did not finish: "
                           f"'{_TMP}'); expected a complete checkpoint; {hint}.")
    index = os.path.join(data_dir, _METADATA)
    if not os.path.isfile(index):
        if list_checkpoints(data_dir):
            raise AutoparError(f"autopar: {path} is a directory of checkpoints, not one; expected a checkpoint "
                               f"path; pass autopar.latest_checkpoint('{path}').")
        raise AutoparError(f"autopar: checkpoint {path} has no index file {index} (half-written, or not a "
                           f"checkpoint); expected the '{_METADATA}' torch.distributed.checkpoint writes last; {hint}.")
    try:
        metadata = metadata_reader(data_dir)
    except Exception as exc:  # a damaged index: unpickling fails in many ways
        raise AutoparError(f"autopar: the index file {index} of checkpoint {path} does not read "
                           f"({type(exc).__name__}: {exc}); expected a complete checkpoint; {hint}.") from None
    _check_storage(path, data_dir, metadata, hint)
    return data_dir, metadata


def _check_storage(path: str, data_dir: str, metadata, hint: str) -> None:
    """Every file the index names exists and holds every byte range the index gives it."""
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(data_dir, name)
        if not os.path.isfile(file):
            raise AutoparError(f"autopar: checkpoint {path} is missing its shard file {file}; expected every file "
                               f"its index names; {hint}.")
        have = os.path.getsize(file)
        if have < size:
            raise AutoparError(f"autopar: checkpoint {path} has a truncated shard file {file}: {have} bytes, its "
                               f"index needs {size}; expected the whole file; {hint}.")
