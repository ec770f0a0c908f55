"""``pm.export_weights(path)``: the full weights as a Hugging Face directory, no rank gathering them.

What is written: ``config.json`` (when the model has a transformers config), the tensors under
the model's own state-dict names in the original model's dtypes, and either one
``model.safetensors`` or, past ``max_shard_size``, shards ``model-0000k-of-0000n.safetensors``
with ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name:
file}}``), as ``save_pretrained`` writes them.  A tensor tied to another (an LM head tied to the
embedding) is written once, under its first state-dict name, as ``save_pretrained`` drops the
tied head; ``from_pretrained`` ties it again.  A path ending in ``.safetensors`` gets one file
instead, holding every name (tied ones too), for ``load_state_dict(safetensors.torch.load_file)``.

How, without gathering: every file's layout follows from the full shapes and dtypes alone
(``params.checkpoint_names.shapes``, ``params.orig_dtypes``), so rank 0 creates each file with its
header and sized data region first (:class:`autopar.runtime.weights.safetensors_io.SafetensorsLayout`).
Then every rank reads its parameters one at a time (``params.read_parameters``: under ZeRO
one unit is all-gathered at a time, so every rank of a stage reads the same names in the same
order) and the ranks holding distinct pieces each write their own piece (a tp or ep shard, a
pipeline stage's tensors) at its byte offsets with ``os.pwrite``; of the ranks holding the same
piece (data-parallel replicas) the lowest writes it.  No tp/ep/pp collective runs, and a rank's
memory beyond its share is one tensor piece (under ZeRO-3 one unit).

Crash safety: everything goes to ``<path>.export-<token>.tmp`` (a file: ``<path>.tmp-<token>``)
and is renamed to ``path`` once every rank has written; a failure on any rank is reported on
every rank and the staging is removed.  Into an existing directory the files are moved one by
one (shards first, the index last) and weight files of an earlier export not rewritten are removed.

Neighbours: :class:`autopar.runtime.module.ParallelModule` (``export_weights``);
:mod:`autopar.runtime.weights.pretrained` reads such a directory back, each rank its own slices;
:mod:`autopar.runtime.weights.checkpoint` (DCP checkpoints with optimizer state; ``export_safetensors``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid

import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.runtime.weights.layout import local_index, unpad_piece
from autopar.runtime.weights.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsLayout, parse_size

__all__ = ["export_weights", "distributed", "shared_token", "shard_names", "INDEX_NAME", "WEIGHTS_NAME"]

_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if distributed() else 0


def export_weights(params, path, *, max_shard_size: int | str = "5GB") -> str:
    """Write the full weights of ``params`` (the rank's
    :class:`autopar.runtime.weights.parameters.RankParameters`) at ``path`` (see the module docstring;
    collective: call on every rank).  Returns the directory, or the file for a path ending in ``.safetensors``."""
    raw = os.fspath(path)
    path = os.path.abspath(raw)
    single = raw.endswith(".safetensors") and not os.path.isdir(path)
    limit = parse_size(max_shard_size)
    if not single and os.path.exists(path) and not os.path.isdir(path):
        raise AutoparError(f"autopar: export_weights cannot write {path}: it exists and is a file; expected a new "
                           "path or a directory (a Hugging Face model directory), or a path ending in .safetensors "
                           "for one file.")
    by_graph = _tensors_to_write(params, dedupe=not single)
    tensors = {orig: (params.orig_dtypes[orig], params.checkpoint_names.shapes[orig])
               for origs in by_graph.values() for orig in origs}
    shards = [list(tensors)] if single else _split(tensors, limit)
    names = [os.path.basename(path)] if single else shard_names(len(shards))
    layouts = {file: SafetensorsLayout({n: tensors[n] for n in shard}) for file, shard in zip(names, shards)}
    token = shared_token()
    staging = f"{path}.tmp-{token}" if single else f"{path}.export-{token}.tmp"
    file_of = {n: file for file, shard in zip(names, shards) for n in shard}

    def create():
        if single:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            layouts[names[0]].create(staging)
            return
        os.makedirs(staging)
        for file, layout in layouts.items():
            layout.create(os.path.join(staging, file))
        if len(names) > 1:
            weight_map = {n: file_of[n] for n in sorted(file_of)}
            total = sum(layout.data_bytes for layout in layouts.values())
            with open(os.path.join(staging, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = params.checkpoint_names.config
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(staging)

    where = (lambda file: staging) if single else (lambda file: os.path.join(staging, file))
    _everywhere(create, "create", staging, cleanup=staging)
    error = _write_pieces(params, by_graph, layouts, file_of, where)
    _report(error, staging)
    _everywhere(lambda: _publish(staging, path, single), "move into place", path, cleanup=staging)
    return path


def shard_names(count: int) -> list[str]:
    """Hugging Face's file names for ``count`` shards (one: ``model.safetensors``)."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def _tensors_to_write(params, dedupe: bool) -> dict[str, list[str]]:
    """Graph name -> the state-dict names written from it, in the model's state-dict order
    (``dedupe``: only the first of tied names)."""
    out: dict[str, list[str]] = {}
    for orig in params.checkpoint_names.shapes:
        name = params.aliases.get(orig)
        if name is None:
            continue
        if name not in out:
            out[name] = [orig]
        elif not dedupe:
            out[name].append(orig)
    return out


def _split(tensors: dict, limit: int) -> list[list[str]]:
    """Names in order, cut into shards of at most ``limit`` bytes (a bigger tensor alone), as
    ``save_pretrained`` cuts them."""
    shards: list[list[str]] = []
    size = limit + 1
    for name, (dtype, shape) in tensors.items():
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if not shards or size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards or [[]]


def _write_pieces(params, by_graph, layouts, file_of, where) -> str | None:
    """Every rank reads its parameters in one order; the chosen rank of each piece writes it.
    Returns this rank's failure, if any (reading goes on after one: the reads are collective)."""
    writer = _Writers(params)
    fds: dict[str, int] = {}
    error = None

    def write(name, value):
        nonlocal error
        if error is not None or not writer.writes(name):
            return
        try:
            full = params.checkpoint_names.shapes[by_graph[name][0]]
            index = local_index(full, params.shards_of(name), params.coords()) if full else []
            kept = tuple(n if i is None else len(i) for n, i in zip(full, index))
            value = unpad_piece(value, kept)  # an uneven vocabulary shard's padding rows
            if tuple(value.shape) != kept:
                raise ValueError(f"{name}: this rank holds shape {tuple(value.shape)}, its piece of {full} is {kept}")
            for orig in by_graph[name]:
                file = file_of[orig]
                if file not in fds:
                    fds[file] = os.open(where(file), os.O_WRONLY)
                layouts[file].write_piece(fds[file], orig, value.to(params.orig_dtypes[orig]), index)
        except Exception as exc:  # reported on every rank (_report), not left to hang a barrier
            error = f"{type(exc).__name__}: {exc}"

    held = [n for n in by_graph if n in params.param_names]
    for name, value in params.read_parameters(held):
        write(name, value.detach())
    for name in by_graph:
        if name not in params.param_names and params.holds(name):
            write(name, params.tensor(name).detach())
    for fd in fds.values():
        try:
            os.fsync(fd)
        except OSError as exc:
            error = error or f"{type(exc).__name__}: {exc}"
        os.close(fd)
    return error


class _Writers:
    """Which rank writes each graph tensor's piece: of the ranks on the tensor's writing pipeline
    stage whose coordinates on the tensor's sharded axes equal this rank's (they hold the same
    piece), the lowest."""

    def __init__(self, params):
        self.params = params
        self.me = _rank()
        mine = (params.pp_rank(), {a: r for a, (r, _) in params.coords().items()})
        everyone = [None] * (dist.get_world_size() if distributed() else 1)
        if distributed():
            dist.all_gather_object(everyone, mine)
        else:
            everyone[0] = mine
        self.everyone = everyone
        self._cache: dict[tuple, bool] = {}

    def writes(self, name: str) -> bool:
        params = self.params
        if not params.holds(name):
            return False
        owner = params.owner(name)
        holders = params.holders(name)
        stage = owner if owner is not None else (min(holders) if holders else 0)
        axes = tuple(sorted(a for a in params.shards_of(name) if params.coords().get(a, (0, 1))[1] > 1))
        key = (stage, axes)
        if key not in self._cache:
            pp, coords = self.everyone[self.me]
            same = [r for r, (p, c) in enumerate(self.everyone)
                    if p == stage and all(c.get(a) == coords.get(a) for a in axes)]
            self._cache[key] = pp == stage and min(same) == self.me
        return self._cache[key]


def shared_token() -> str:
    """A random name part every rank agrees on (rank 0's, broadcast)."""
    token = [uuid.uuid4().hex[:12]]
    if distributed():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _everywhere(action, what: str, where: str, cleanup: str | None = None) -> None:
    """``action`` on rank 0, its failure raised on every rank (the broadcast is also the barrier)."""
    failure = [None]
    if _rank() == 0:
        try:
            action()
        except Exception as exc:
            failure[0] = f"{type(exc).__name__}: {exc}"
            if cleanup is not None:
                _remove(cleanup)
    if distributed():
        dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise AutoparError(f"autopar: export_weights could not {what} {where} on rank 0: {failure[0]}")


def _report(error: str | None, staging: str) -> None:
    """Every rank's write failure, raised on every rank (the gather is also the barrier)."""
    errors = [error]
    if distributed():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        if _rank() == 0:
            _remove(staging)
        rank, first = failed[0]
        raise AutoparError(f"autopar: export_weights failed writing {staging} on rank {rank}"
                           f"{f' (and {len(failed) - 1} other rank(s))' if len(failed) > 1 else ''}: {first}; "
                           "nothing was exported.")


def _publish(staging: str, path: str, single: bool) -> None:
    """Rename the staging file or directory to ``path``; into an existing directory, move the files
    one by one (the index or model.safetensors last) and drop weight files of an earlier export."""
    if single or not os.path.exists(path):
        os.replace(staging, path) if single else os.rename(staging, path)
        return
    new = sorted(os.listdir(staging), key=lambda f: f in (INDEX_NAME, WEIGHTS_NAME))
    for file in new:
        os.replace(os.path.join(staging, file), os.path.join(path, file))
    for file in os.listdir(path):
        if _WEIGHT_FILE.match(file) and file not in new:
            os.remove(os.path.join(path, file))
    os.rmdir(staging)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)
