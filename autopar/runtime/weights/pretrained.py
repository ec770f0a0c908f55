"""``pm.load_pretrained(path)``: Hugging Face safetensors weights into one rank's shards.

Each rank reads only the files holding tensors it keeps and, of each tensor, only the slice it
keeps (:func:`autopar.runtime.weights.layout.local_index` says which positions; the slice reads are
:class:`autopar.runtime.weights.safetensors_io.SafetensorsFile`'s), converts it to the program's dtype
and writes it where the program keeps it (the parameter, its fp32 master under mixed
precision, or its piece of a ZeRO shard: ``grad_sync.write_parameter``).  A rank's peak memory
while loading is its share of the model plus one block of rows.

Names: the checkpoint speaks the model's own state-dict names.  For a transformers model the
checkpoint may be in an older layout that its ``from_pretrained`` converts on load (Mixtral's
experts saved one by one and stacked in the model, renamed prefixes): the same conversion
rules are applied here (``transformers.conversion_mapping``), one target tensor at a time;
such a tensor is read whole, converted and then cut.  Tied weights are read once.

Everything is checked before anything is written: a missing tensor, a tensor the model does
not have, or one whose shape differs from the model's is an ``autopar:`` error naming it.

Neighbours: :class:`autopar.runtime.module.ParallelModule` (``load_pretrained``, the names it
records at construction: :class:`CheckpointNames`), :mod:`autopar.runtime.weights.initialize` (the
other two ways a meta-built program gets values).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys
from typing import Any

import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.runtime.weights.layout import local_index, pad_piece
from autopar.runtime.weights.safetensors_io import INDEX_NAME, WEIGHTS_NAME, SafetensorsFile

__all__ = ["CheckpointNames", "load_pretrained", "checkpoint_files", "INDEX_NAME", "WEIGHTS_NAME"]



@dataclasses.dataclass(frozen=True)
class CheckpointNames:
    """What loading needs to know of the user's model, recorded at ``parallelize`` (no tensors kept):
    its state-dict names, shapes and dtypes, and for a transformers model its checkpoint
    conversion rules, base-model prefix and config."""

    shapes: dict[str, tuple[int, ...]]
    transforms: tuple = ()
    base_model_prefix: str | None = None
    config: Any = None
    ignored: tuple[str, ...] = ()  # patterns of checkpoint keys the model's from_pretrained ignores

    @classmethod
    def of(cls, model: nn.Module) -> "CheckpointNames":
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        config = getattr(model, "config", None)
        transformers = sys.modules.get("transformers")  # a transformers model has imported it already
        if transformers is None or not isinstance(model, transformers.PreTrainedModel):
            return cls(shapes)  # the checkpoint speaks the model's own names
        from transformers.conversion_mapping import get_model_conversion_mapping
        transforms = tuple(get_model_conversion_mapping(model))
        ignored = tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        if any(k.endswith("rotary_emb.inv_freq") for k, _ in model.named_buffers()):
            ignored += (r"rotary_emb\.inv_freq",)  # older checkpoints saved it; transformers skips it too
        return cls(shapes, transforms, model.base_model_prefix or None, config, ignored)

    def resolve(self, keys) -> tuple[dict[str, str], dict[str, list[tuple[str, str]]], list[str]]:
        """Checkpoint ``keys`` -> ``(direct, converted, unexpected)``: model name -> the checkpoint
        key holding it; model name -> ``[(checkpoint key, source pattern)]`` a conversion rule
        builds it from; the keys that name nothing of the model."""
        direct: dict[str, str] = {}
        converted: dict[str, list[tuple[str, str]]] = {}
        unexpected: list[str] = []
        rename = self._renamer()
        for key in sorted(keys):
            target, pattern = rename(key)
            if target not in self.shapes:
                if not any(re.search(p, key) for p in self.ignored):
                    unexpected.append(key)
            elif pattern is None:
                direct[target] = key
            else:
                converted.setdefault(target, []).append((key, pattern))
        return direct, converted, unexpected

    def _renamer(self):
        if not self.transforms:
            return lambda key: (key, None)
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        meta = dict.fromkeys(self.shapes, True)

        def rename(key: str):
            target, pattern = rename_source_key(key, renamings, converters, self.base_model_prefix, meta)
            if target not in meta and key in meta:  # as transformers does: keep the key, fix the prefix
                target, pattern = rename_source_key(key, [], [], self.base_model_prefix, meta)
            return target, pattern
        return rename

    def convert(self, target: str, sources: list[tuple[str, str]], read) -> dict[str, torch.Tensor]:
        """The full tensors a conversion rule builds for ``target`` from its checkpoint sources
        (``read(key)`` -> the whole tensor)."""
        from transformers.core_model_loading import WeightConverter

        by_pattern = {p: t for t in self.transforms if isinstance(t, WeightConverter) for p in t.source_patterns}
        converter = copy.deepcopy(by_pattern[sources[0][1]])
        for key, pattern in sources:
            converter.add_tensor(target, key, pattern, (lambda k=key: read(k)))
        return converter.convert(target, model=None, config=self.config)


def checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a Hugging Face model directory (one
    ``model.safetensors``, or ``model.safetensors.index.json`` and its shards) or one file."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        if path.endswith(".json"):
            return _from_index(path)
        return dict.fromkeys(SafetensorsFile(path).keys(), path)
    if not os.path.isdir(path):
        raise AutoparError(f"autopar: load_pretrained found nothing at {path}; expected a Hugging Face model "
                           f"directory ({WEIGHTS_NAME} or {INDEX_NAME} with its shards) or a .safetensors file.")
    if os.path.exists(os.path.join(path, INDEX_NAME)):
        return _from_index(os.path.join(path, INDEX_NAME))
    if os.path.exists(os.path.join(path, WEIGHTS_NAME)):
        return checkpoint_files(os.path.join(path, WEIGHTS_NAME))
    found = sorted(os.listdir(path))
    raise AutoparError(
        f"autopar: {path} holds no {WEIGHTS_NAME} and no {INDEX_NAME} (found: {', '.join(found[:8]) or 'nothing'}); "
        "expected safetensors weights as save_pretrained writes them. A PyTorch .bin checkpoint: load it once "
        "with from_pretrained and save it again with save_pretrained(..., safe_serialization=True).")


def _from_index(index_path: str) -> dict[str, str]:
    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise AutoparError(f"autopar: {index_path} has no weight_map; expected a safetensors index as "
                           "save_pretrained writes it.")
    root = os.path.dirname(index_path)
    return {name: os.path.join(root, file) for name, file in weight_map.items()}


def load_pretrained(params, path: str | os.PathLike) -> None:
    """Read the weights at ``path`` into ``params`` (every rank its own slices; see the module docstring)."""
    files = checkpoint_files(path)
    opened: dict[str, SafetensorsFile] = {}

    def handle(file: str) -> SafetensorsFile:
        if file not in opened:
            if not os.path.exists(file):
                raise AutoparError(f"autopar: the checkpoint index names {file}, which does not exist; expected "
                                   "every shard file the index lists next to it.")
            opened[file] = SafetensorsFile(file)
        return opened[file]

    names: CheckpointNames = params.checkpoint_names
    direct, converted, unexpected = names.resolve(files)
    _check_complete(params, path, direct, converted, unexpected)
    shapes = {key: handle(file).shape(key) for key, file in files.items()}
    _check_shapes(params, path, direct, shapes)
    written: set[str] = set()
    for file in sorted({files[key] for key in direct.values()}):  # one file at a time
        for orig, key in direct.items():
            if files[key] != file:
                continue
            name = params.graph_name(orig)
            if name in written or not params.holds(name):
                continue
            shards, coords = params.shards_of(name), params.coords()
            index = local_index(names.shapes[orig], shards, coords)
            params.write_local(name, pad_piece(handle(file).read(key, index), names.shapes[orig], shards, coords))
            written.add(name)
    for orig, sources in sorted(converted.items()):
        name = params.graph_name(orig)
        if name in written or not params.holds(name):
            continue
        built = names.convert(orig, sources, lambda key: handle(files[key]).read(key))
        value = built.get(orig)
        if value is None or tuple(value.shape) != names.shapes[orig]:
            raise AutoparError(
                f"autopar: converting {', '.join(k for k, _ in sources[:3])} of {path} gave "
                f"{'no ' + orig if value is None else f'{orig} of shape {tuple(value.shape)}'}; expected "
                f"shape {names.shapes[orig]}. The checkpoint does not match this model's config.")
        params.write_local(name, params.local(value, name))
        written.add(name)
        del built, value


def _check_complete(params, path, direct, converted, unexpected) -> None:
    """Every tensor of the model (a tied weight under any of its names) and nothing else."""
    covered = {params.graph_name(o) for o in list(direct) + list(converted)}
    missing = sorted(o for o in params.checkpoint_names.shapes if params.graph_name(o) not in covered)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) of the model: {', '.join(missing[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            parts.append(f"{len(unexpected)} tensor(s) the model does not have: {', '.join(unexpected[:6])}"
                         f"{' ...' if len(unexpected) > 6 else ''}")
        raise AutoparError(f"autopar: the checkpoint at {path} does not match the model: {'; '.join(parts)}. "
                           "Expected the model's own state-dict names (as save_pretrained writes them); check "
                           "that the checkpoint and the model's config are of the same architecture and size. "
                           "Nothing was loaded.")


def _check_shapes(params, path, direct, shapes) -> None:
    wrong = [(orig, key) for orig, key in direct.items() if tuple(shapes[key]) != params.checkpoint_names.shapes[orig]]
    if wrong:
        listed = ", ".join(f"{key} {tuple(shapes[key])} (model: {params.checkpoint_names.shapes[orig]})"
                           for orig, key in wrong[:6])
        raise AutoparError(f"autopar: the checkpoint at {path} has {len(wrong)} tensor(s) whose shape differs from "
                           f"the model's: {listed}. Expected the shapes of the model's config; check hidden size, "
                           "vocabulary and layer counts. Nothing was loaded.")
