""":class:`RankParameters`: this rank's parameters and buffers, and every way to name, read and write them.

A program's tensors go by three names: the user's model's state-dict keys (``orig``; tied
weights have several), the graph's attribute names (``name``; one per tensor), and, on disk,
the checkpoint's keys (:class:`autopar.runtime.weights.pretrained.CheckpointNames`).  This
object holds the maps between the first two (``tensor_names``: every parameter and buffer,
non-persistent buffers too; ``aliases``: the state dict's keys alone), the full shapes and
dtypes (``full_meta``: the graph's; ``orig_dtypes``: the user's model's, what a state dict and an
export return), the shard layout (``shards_of``), which pipeline ranks hold a tensor
(``holds``), and the tensors still without values (``unset``: a model built on the meta device,
until weights are loaded or initialised).

It also places them: :meth:`materialize` cuts each full tensor to this rank's piece on the rank's
device (:mod:`autopar.runtime.devices` moves the graph), and :meth:`write_local` /
:meth:`full_values` / :meth:`read_parameters` reach a value wherever the gradient-sync strategy
keeps it (the parameter, its fp32 master, its piece of a ZeRO shard; bound once with :meth:`bind`).
:mod:`autopar.runtime.weights.state`, ``export``, ``pretrained`` and ``initialize`` take this
object, never the :class:`autopar.runtime.module.ParallelModule`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator

import torch
import torch.nn as nn

from autopar.compat import set_buffer
from autopar.runtime.devices import move_constants, retarget_devices, use_fused_attention
from autopar.runtime.weights.layout import shard_local
from autopar.runtime.weights.pretrained import CheckpointNames

__all__ = ["RankParameters", "get_attr", "original_names"]


def get_attr(root: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer at dotted path ``name`` of ``root``."""
    return functools.reduce(getattr, name.split("."), root)


class RankParameters:
    """This rank's parameters and buffers of program ``gm`` (see the module docstring).

    ``holders(name)`` / ``owner(name)``: the pp ranks holding graph tensor ``name`` and the one
    that owns it (the executor's answer; None: every pp rank); ``simulation``: a full-size model
    on the meta device under a fake process group, whose tensors stay on meta."""

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule, program, groups: dict, *,
                 device: torch.device, traced_device: torch.device, simulation: bool,
                 holders: Callable[[str], tuple[int, ...] | None], owner: Callable[[str], int | None],
                 masters_from: nn.Module | None = None):
        self.gm, self.program, self.groups = gm, program, groups
        self.device, self.simulation = device, simulation
        self.holders, self.owner = holders, owner
        self.tensor_names = original_names(model, gm)  # every parameter and buffer, non-persistent too
        state_keys = model.state_dict().keys()
        self.aliases = {k: v for k, v in self.tensor_names.items() if k in state_keys}
        self.checkpoint_names = CheckpointNames.of(model)  # what load_pretrained needs of the model
        self.full_meta = {name: (tuple(p.shape), p.dtype) for name, p in gm.named_parameters()}
        self.orig_dtypes = {k: v.dtype for k, v in (masters_from or model).state_dict().items()}
        self.unset: set[str] = set()  # graph names without values yet
        self._store = None  # the gradient-sync strategy, once it exists (bind)
        self._materialize(traced_device)
        self.param_names = {n for n, _ in gm.named_parameters()}

    def bind(self, store) -> None:
        """Values now live in ``store`` (a :class:`autopar.runtime.gradients.sync_protocol.GradientSynchronizer`)."""
        self._store = store

    # --- where things are ---------------------------------------------------------------

    def coords(self) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (this rank's index on it, axis size)."""
        return {a: (g.rank, g.size) for a, g in self.groups.items()}

    def pp_rank(self) -> int:
        return self.groups["pp"].rank if "pp" in self.groups else 0

    def holds(self, name: str) -> bool:
        """Whether this rank holds graph parameter or buffer ``name`` (pipeline ranks hold their chunks')."""
        holders = self.holders(name)
        return holders is None or self.pp_rank() in holders

    def shards_of(self, name: str) -> dict:
        """How graph tensor ``name`` is cut over the mesh axes (``{}``: held whole)."""
        return self.program.param_shards.get(name, {})

    def graph_name(self, orig: str) -> str | None:
        """The graph's name for the original model's parameter or buffer ``orig`` (None: not in the graph)."""
        return self.tensor_names.get(orig)

    def graph_to_original(self) -> dict[str, str]:
        """Graph parameter or buffer name -> its first original state-dict key."""
        out: dict[str, str] = {}
        for orig, name in self.aliases.items():
            out.setdefault(name, orig)
        return out

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The full (unsharded) shape of graph tensor ``name``."""
        return self.full_meta[name][0] if name in self.full_meta else tuple(get_attr(self.gm, name).shape)

    def local(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of graph tensor ``name`` cut from its full value (on the tensor's device)."""
        return shard_local(full, self.shards_of(name), self.coords())

    def unset_names(self) -> list[str]:
        """Original names of the tensors still without values (a meta-built model not loaded yet)."""
        by_graph: dict[str, str] = {}
        for orig, name in self.tensor_names.items():
            by_graph.setdefault(name, orig)
        return sorted(by_graph.get(n, n) for n in self.unset)

    # --- values -------------------------------------------------------------------------

    def tensor(self, name: str, values: dict | None = None) -> torch.Tensor:
        """The tensor holding graph tensor ``name`` (``values``: from :meth:`full_values`)."""
        return values[name] if values and name in values else get_attr(self.gm, name)

    def full_values(self, write_back: bool = False):
        """A context giving each held parameter whole over dp (the store's ``full_parameters``)."""
        return self._store.full_parameters(write_back=write_back)

    def read_parameters(self, names) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, local value)`` of parameters ``names`` one at a time (under ZeRO one unit gathered)."""
        return self._store.read_parameters(names)

    def write_local(self, name: str, local: torch.Tensor) -> None:
        """Set this rank's piece of graph parameter or buffer ``name`` (wherever the program keeps it:
        the parameter, its fp32 master, its piece of a ZeRO shard)."""
        local = local.to(self.device)
        if name in self.param_names:
            self._store.write_parameter(name, local)
        else:
            with torch.no_grad():
                get_attr(self.gm, name).copy_(local)
        self.unset.discard(name)

    def master_values(self, masters_from: nn.Module) -> dict[str, torch.Tensor]:
        """Graph name -> this rank's piece of the user's fp32 parameter (the master's first value)."""
        originals = dict(masters_from.named_parameters(remove_duplicate=False))
        out = {}
        for name, orig in self.graph_to_original().items():
            if orig in originals and self.holds(name):
                local = self.local(originals[orig].detach(), name)
                out[name] = (torch.empty(local.shape, dtype=torch.float32, device=self.device)
                             if local.is_meta and not self.simulation  # loaded later (unset)
                             else local.to(device=self.device, dtype=torch.float32))
        return out

    def held_buckets(self, buckets) -> list:
        """The gradient buckets restricted to the parameters this rank holds (a bucket may span pp ranks)."""
        out = []
        for b in buckets:
            params = tuple(p for p in b.params if self.holds(p))
            if params:
                nbytes = sum(self.gm.get_parameter(p).numel() * self.gm.get_parameter(p).element_size()
                             for p in params)
                out.append(dataclasses.replace(b, params=params, num_bytes=nbytes))
        return out

    # --- placing ------------------------------------------------------------------------

    def _materialize(self, traced_device: torch.device) -> None:
        """This rank's parameters and buffers on its device, and the graph moved there
        (devices.py); a meta tensor outside the scale simulation becomes uninitialised memory of
        its local shape, listed in ``unset`` until weights are loaded or initialised.  On the meta
        device (the scale simulation) attention runs the fused kernel a GPU would (devices.py)."""
        pipeline = self.program.pipeline
        graphs = [self.gm] + [c.gm for c in (pipeline.chunks if pipeline is not None else ())]
        for graph in graphs:  # the program and the pipeline's own graphs
            retarget_devices(graph, traced_device, self.device)
            if self.device.type == "meta":
                use_fused_attention(graph)
        for chunk in graphs[1:]:
            _release_tensors(chunk, self.gm)
        move_constants(self.gm, self.device)
        for name, p in list(self.gm.named_parameters()):
            if not self.holds(name):
                *path, leaf = name.split(".")
                delattr(self.gm.get_submodule(".".join(path)), leaf)
                continue
            local = self._placed(name, self.local(p.detach(), name))
            _set_attr(self.gm, name, nn.Parameter(local, requires_grad=p.requires_grad))
        for name, b in list(self.gm.named_buffers()):
            _set_attr(self.gm, name, self._placed(name, b.detach()), buffer=True)

    def _placed(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if local.is_meta and not self.simulation:
            self.unset.add(name)
            return torch.empty(local.shape, dtype=local.dtype, device=self.device)
        return local.clone().to(self.device)


def original_names(model: nn.Module, gm: nn.Module) -> dict[str, str]:
    """Original parameter or buffer name -> graph attribute name (tied weights share one attribute),
    every name, non-persistent buffers included."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    graph_names = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(
            gm.named_buffers(remove_duplicate=False)):
        for orig in by_id.get(id(t), []):
            graph_names[orig] = name
    return graph_names


def _set_attr(root: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    *path, leaf = name.split(".")
    mod = functools.reduce(getattr, path, root)
    if buffer:
        set_buffer(mod, leaf, value)
    else:
        setattr(mod, leaf, value)


def _release_tensors(gm: torch.fx.GraphModule, program_gm: nn.Module) -> None:
    """The pipeline pass's chunk module keeps its graph and tensor shapes but no memory: its
    parameters and buffers become meta tensors.  The runtime builds this rank's chunks on the
    placed local parameters (runtime/stepping/pipelined.py); the pass's modules only describe a stage
    (``describe_stage``, ``autopar inspect``) -- holding the original tensors there kept every
    chunk's weights, the whole model, alive on each pipeline rank.  A submodule the chunk shares
    with the program's module is left alone."""
    shared = {id(mod) for mod in program_gm.modules()}
    owner = lambda name: gm.get_submodule(name.rpartition(".")[0])  # noqa: E731
    for name, p in list(gm.named_parameters()):
        if id(owner(name)) not in shared:
            _set_attr(gm, name, nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
    for name, b in list(gm.named_buffers()):
        if id(owner(name)) not in shared:
            _set_attr(gm, name, b.detach().to("meta"), buffer=True)
