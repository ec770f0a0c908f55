"""Trace a deep model in time flat in its depth: export a few layers, stamp out the repeats.

``torch.export`` costs about the same for every layer it traces (0.25 s a layer of a
Llama-70B-shaped model on this project's 2-core machine), so an 80-layer model took 80
times one layer.  Most models repeat one or a few layer kinds, so :mod:`autopar.frontend.trace`
exports a *shallow copy* of the model that holds only the first ``k`` layers of its layer
list (the user's module objects, never modified) and this module copies the traced
subgraph of each remaining layer from a traced layer of the same kind, with that layer's
own parameters.  The result is the graph a full export gives: the same aten calls in the
same order on the same values, parameter names and module paths (``tests/unit/test_stamp.py``
compares the two node for node, and the programs' numerics).

A repeat is stamped only when every condition below holds; otherwise the whole model is
exported (the old, slower path) and the log says why:

1. **Same kind.** Two layers are the same kind when their module trees, classes, parameter
   and buffer shapes, hooks and every attribute agree, except attributes that hold the
   layer's own position (``layer_idx``); a module held as a plain attribute (not a child)
   agrees when its class and attributes do and it holds no tensor.  (:func:`layer_kinds`)
2. **Same behaviour.** Each untraced layer is run eagerly, on the meta device (or fake
   tensors), under export's own "compiling" flags, on the inputs its traced twin received,
   and its aten calls (op, arguments, dataflow, parameters by name, small constants by value)
   must equal the twin's: a forward that reads the configuration at ``self.layer_idx``
   differs here.  (:mod:`autopar.frontend.stamp_behaviour`)
3. **Same wiring.** In the traced graph each layer takes one tensor from the layer before
   it (the hidden state) plus values computed before the layers; it gives one tensor to
   the next layer; no other node sits between layers; and two traced layers of one kind
   have the same subgraph with the same shared inputs.  (:func:`stamp_layers`)

Neighbours: :mod:`autopar.frontend.trace` calls :func:`plan_stamping`, :func:`shallow_model`, the
behaviour check of :mod:`autopar.frontend.stamp_behaviour` and :func:`stamp_layers`;
:mod:`autopar.frontend.analyze` reads the stamped graph like any other.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._ops import HigherOrderOperator

from autopar.frontend.fx_utils import module_path, within

__all__ = ["StampPlan", "CannotStamp", "plan_stamping", "shallow_model", "stamp_layers"]

# Stamp when at least this many layers are left after the exported prefix.
MIN_STAMPED = 1


class CannotStamp(Exception):
    """A condition of the module docstring does not hold: export the whole model instead."""


@dataclasses.dataclass(frozen=True)
class StampPlan:
    """Which layers to export and which to copy: ``kinds[i]`` is layer ``i``'s kind."""

    path: str  # the layer list's name in the user's model, e.g. "model.layers"
    layers: tuple  # the user's layer modules
    kinds: tuple[int, ...]
    num_traced: int  # layers 0 .. num_traced-1 are exported

    def twin(self, i: int) -> int:
        """The traced layer layer ``i`` is copied from: the last traced one of its kind."""
        return max(j for j in range(1, self.num_traced) if self.kinds[j] == self.kinds[i])


def _layer_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The largest outermost ``ModuleList`` whose children share one class."""
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if best is not None and name.startswith(best[0] + "."):
            continue  # nested inside a list already taken (experts inside layers)
        if len({type(m) for m in mod}) != 1:
            continue
        if best is None or len(mod) > len(best[1]):
            best = (name, mod)
    return best


_SKIPPED = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}


def _attributes(layer: nn.Module) -> dict[str, Any]:
    """Every attribute of the layer's module tree that can change what its forward does."""
    out: dict[str, Any] = {}
    for prefix, mod in layer.named_modules():
        out[f"{prefix}:class"] = type(mod)
        for key, value in vars(mod).items():
            if key in _SKIPPED:
                continue
            if key.endswith("hooks") or key.endswith("hooks_with_kwargs") or key.endswith("_always_called"):
                value = tuple(value.values()) if isinstance(value, dict) else value
            out[f"{prefix}:{key}"] = value
        for key, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            out[f"{prefix}:tensor:{key}"] = None if t is None else (
                type(t), tuple(t.shape), t.dtype, t.requires_grad, key in mod._non_persistent_buffers_set)
    return out


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two attribute values make a layer's forward do the same thing."""
    if a is b:
        return True
    if depth > 4 or type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return False  # an unregistered tensor attribute: a constant the graph would share
    if isinstance(a, functools.partial):  # HF's per-layer activations
        return (_same(a.func, b.func, depth + 1) and _same(a.args, b.args, depth + 1)
                and _same(a.keywords, b.keywords, depth + 1))
    if isinstance(a, nn.Module):
        # A module held as a plain attribute, not a child (transformers >= 5.25 gives each
        # attention its own ``_kernel_funcs`` wrapper of ``apply_rotary_pos_emb``): the same
        # when its class and attributes agree and it holds no tensor of its own.
        if _tensors(a) or _tensors(b):
            return False
        return _same(_attributes(a), _attributes(b), depth + 1)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k], depth + 1) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # objects without a usable ==: equal only when identical
        return False


def layer_kinds(layers) -> tuple[int, ...]:
    """Kind of each layer (condition 1): equal attributes but those holding the position."""
    attrs = [_attributes(m) for m in layers]
    common = set.intersection(*(set(a) for a in attrs))
    # An attribute that is the layer's position (plus a constant) in every layer: layer_idx.
    index_keys = {k for k in common if all(type(a[k]) is int for a in attrs)
                  and len({a[k] - i for i, a in enumerate(attrs)}) == 1 and attrs[0][k] != attrs[1][k]}
    kinds: list[int] = []
    reps: list[dict] = []
    for a in attrs:
        for kind, rep in enumerate(reps):
            if set(rep) == set(a) and all(k in index_keys or _same(rep[k], a[k]) for k in a):
                kinds.append(kind)
                break
        else:
            kinds.append(len(reps))
            reps.append(a)
    return tuple(kinds)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer under every name it has."""
    return ([t for _, t in module.named_parameters(remove_duplicate=False)]
            + [t for _, t in module.named_buffers(remove_duplicate=False)])


def plan_stamping(model: nn.Module) -> StampPlan | None:
    """What to export and what to copy, or None when a full export is as good."""
    found = _layer_list(model)
    if found is None:
        return None
    path, layers = found
    counts = collections.Counter(id(t) for t in _tensors(model))
    if any(counts[id(t)] > 1 for layer in layers for t in _tensors(layer)):
        return None  # a tensor shared with another layer or module: export names it once
    kinds = layer_kinds(list(layers))
    # Export the shortest prefix with two layers of each later kind after layer 0 (the
    # second one checks the first: condition 3).
    for k in range(3, len(layers) - MIN_STAMPED + 1):
        later = set(kinds[k:])
        if all(kinds[1:k].count(kind) >= 2 for kind in later):
            return StampPlan(path=path, layers=tuple(layers), kinds=kinds, num_traced=k)
    return None


def shallow_model(model: nn.Module, plan: StampPlan) -> nn.Module:
    """A copy of the module path down to the layer list, holding the first layers only.

    Every module is the user's object (parameters shared, nothing modified); only the
    modules on the path to the list are shallow copies with their own child dictionaries.
    """
    parts = plan.path.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    new_parent, old_parent = root, model
    for name in parts[:-1]:
        old_child = old_parent._modules[name]
        new_child = copy.copy(old_child)
        new_child._modules = dict(old_child._modules)
        new_parent._modules[name] = new_child
        new_parent, old_parent = new_child, old_child
    old_list = old_parent._modules[parts[-1]]
    new_list = copy.copy(old_list)
    new_list._modules = {str(i): plan.layers[i] for i in range(plan.num_traced)}
    new_parent._modules[parts[-1]] = new_list
    return root


def _layer_of(node: torch.fx.Node, prefix: str) -> int | None:
    """The layer list position whose module (or parameter) ``node`` belongs to."""
    name = str(node.target) if node.op == "get_attr" else module_path(node)
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _carry_out(nodes: list, members: set) -> list:
    return [n for n in nodes if _is_tensor(n) and any(u not in members for u in n.users)]


def _is_size(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), (torch.SymInt, int))


def _same_subgraph(a: list, b: list, carry_a: list, carry_b: list, gm: torch.fx.GraphModule) -> bool:
    """Two traced layers of one kind compute the same thing from the same shared inputs.

    Sizes are compared by value: export makes a size node where a size is first asked for
    and reuses it after, so the first layer may own size nodes a later one shares."""
    a = [n for n in a if not _is_size(n)]
    b = [n for n in b if not _is_size(n)]
    if len(a) != len(b):
        return False
    pos = {n: i for i, n in enumerate(a)} | {n: i for i, n in enumerate(b)}
    carry = {n: ("carry", i) for i, n in enumerate(carry_a)} | {n: ("carry", i) for i, n in enumerate(carry_b)}

    def key(v, members):
        if not isinstance(v, torch.fx.Node):
            return v
        if v in members:
            return ("own", pos[v])
        if v in carry:
            return carry[v]
        if _is_size(v):
            return ("size", str(v.meta["val"]))
        return ("shared", v)

    members_a, members_b = set(a), set(b)
    for x, y in zip(a, b):
        if x.op != y.op or (x.op != "get_attr" and x.target != y.target):
            return False
        if x.op == "get_attr" and not _same_attr(gm, x, y):
            return False
        kx = pytree.tree_map(lambda v: key(v, members_a), (x.args, x.kwargs))
        ky = pytree.tree_map(lambda v: key(v, members_b), (y.args, y.kwargs))
        if kx != ky:
            return False
    return True


def _constant(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The value of a tensor constant the forward made (export lifts it as ``lifted_tensor_N``)."""
    *path, leaf = str(node.target).split(".")
    owner = gm.get_submodule(".".join(path))
    if leaf in owner._parameters or leaf in owner._buffers:
        return None
    return getattr(owner, leaf)


def _same_attr(gm: torch.fx.GraphModule, x: torch.fx.Node, y: torch.fx.Node) -> bool:
    cx, cy = _constant(gm, x), _constant(gm, y)
    if cx is None or cy is None:  # parameters and buffers: the same name within the layer
        return cx is cy and str(x.target).rsplit(".", 1)[-1] == str(y.target).rsplit(".", 1)[-1]
    return cx.shape == cy.shape and cx.dtype == cy.dtype and bool(torch.equal(cx, cy))


def _renamed_stack(stack: dict, old: str, new: str) -> dict:
    """``nn_module_stack`` with layer ``old``'s paths (in keys and values) moved to ``new``."""
    def sub(path: str) -> str:
        return new + path[len(old):] if within(path, old) else path

    tag = "L__self__"
    return {(tag + sub(k[len(tag):]) if k.startswith(tag) else k): (sub(path), cls)
            for k, (path, cls) in stack.items()}


def _assign(gm: torch.nn.Module, target: str, tensor: torch.Tensor, persistent: bool,
            constant: bool = False) -> None:
    """Register ``tensor`` on ``gm`` at ``target`` as ``ep.module()`` registers the traced ones."""
    *path, leaf = target.split(".")
    mod = gm
    for name in path:
        if not hasattr(mod, name):
            mod.add_module(name, torch.nn.Module())
        mod = getattr(mod, name)
    if constant:
        setattr(mod, leaf, tensor)
    elif isinstance(tensor, nn.Parameter):
        mod.register_parameter(leaf, tensor)
    else:
        mod.register_buffer(leaf, tensor, persistent=persistent)


def stamp_layers(gm: torch.fx.GraphModule, plan: StampPlan, model_prefix: str) -> int:
    """Copy the twins' subgraphs for layers ``num_traced ..``; returns the nodes added.

    ``model_prefix``: how the graph names the user's model ("model." under the training
    wrapper).  Raises :class:`CannotStamp` (the graph untouched) when condition 3 fails.
    """
    prefix = f"{model_prefix}{plan.path}."
    graph = gm.graph
    order = list(graph.nodes)
    by_layer: dict[int, list] = {i: [] for i in range(plan.num_traced)}
    seen: list[int | None] = []
    for n in order:
        i = _layer_of(n, prefix)
        if i is not None:
            if i not in by_layer:
                raise CannotStamp(f"node {n.name} belongs to layer {i}, which was not exported")
            by_layer[i].append(n)
        if n.op in ("call_function", "call_method", "call_module"):
            if not seen or seen[-1] != i:
                seen.append(i)
    calls = [i for i in seen if i is not None]
    if calls != list(range(plan.num_traced)):
        raise CannotStamp(f"the exported layers run in the order {calls}, not once each in order, "
                          "or other computation sits between them")
    nested = next((n for ns in by_layer.values() for n in ns if isinstance(n.target, HigherOrderOperator)), None)
    if nested is not None:  # its subgraph would be shared by the copies, with the twin's parameters
        raise CannotStamp(f"layer node {nested.name} calls a nested graph ({nested.target})")
    members = {i: set(ns) for i, ns in by_layer.items()}
    carry = {i: _carry_out(ns, members[i]) for i, ns in by_layer.items()}
    last = plan.num_traced - 1
    for i in range(plan.num_traced):
        if len(carry[i]) != 1:
            raise CannotStamp(f"layer {i} passes {len(carry[i])} tensors on, expected one (its hidden state)")
        outside = {u for c in carry[i] for u in c.users if u not in members[i]}
        target = members.get(i + 1) if i < last else None
        if target is not None and not outside <= target:
            raise CannotStamp(f"layer {i}'s output is used beyond the next layer")
        if i == last and any(_layer_of(u, prefix) is not None for u in outside):
            raise CannotStamp(f"layer {i}'s output is used by another layer")
    layer_nodes = set().union(*members.values())
    for i in range(1, plan.num_traced):
        for n in by_layer[i]:
            for a in n.all_input_nodes:
                if a in members[i] or a in carry[i - 1] or a not in layer_nodes or not _is_tensor(a):
                    continue
                raise CannotStamp(f"layer {i} reads {a.name} of an earlier layer besides its input")
    for j in {plan.twin(i) for i in range(plan.num_traced, len(plan.layers))}:
        other = max(x for x in range(1, plan.num_traced) if plan.kinds[x] == plan.kinds[j] and x != j)
        if not _same_subgraph(by_layer[other], by_layer[j], carry[other - 1], carry[j - 1], gm):
            raise CannotStamp(f"layers {other} and {j} are of one kind but their traced graphs differ")
    return _copy_layers(gm, plan, prefix, by_layer, carry)


def _copy_layers(gm, plan: StampPlan, prefix: str, by_layer: dict, carry: dict) -> int:
    graph = gm.graph
    last = plan.num_traced - 1
    final = carry[last][0]
    post_users = [u for u in final.users if _layer_of(u, prefix) is None]
    anchor = by_layer[last][-1]  # the copies go after the exported layers, before what follows them
    prev = final
    added = 0
    for i in range(plan.num_traced, len(plan.layers)):
        j = plan.twin(i)
        old, new = f"{prefix}{j}", f"{prefix}{i}"
        layer = plan.layers[i]
        tensors = dict(layer.named_parameters(remove_duplicate=False)) | dict(layer.named_buffers(remove_duplicate=False))
        env = {carry[j - 1][0]: prev}
        for n in by_layer[j]:
            if n.op == "get_attr":
                rel = str(n.target)[len(old) + 1:]
                target = f"{new}.{rel}"
                constant = _constant(gm, n)
                if constant is not None:  # checked equal in every layer of the kind (check_behaviour)
                    _assign(gm, target, constant, persistent=False, constant=True)
                else:
                    owner = layer.get_submodule(rel.rsplit(".", 1)[0]) if "." in rel else layer
                    leaf = rel.rsplit(".", 1)[-1]
                    _assign(gm, target, tensors[rel], leaf not in owner._non_persistent_buffers_set)
                with graph.inserting_after(anchor), warnings.catch_warnings():
                    # FX warns for a plain-tensor attribute; export's own constants are plain tensors too
                    warnings.simplefilter("ignore", UserWarning)
                    copied = graph.get_attr(target)
                copied.meta = dict(n.meta)
            else:
                with graph.inserting_after(anchor):
                    copied = graph.node_copy(n, lambda a: env.get(a, a))
                if "nn_module_stack" in copied.meta:
                    copied.meta["nn_module_stack"] = _renamed_stack(copied.meta["nn_module_stack"], old, new)
            env[n] = copied
            anchor = copied
            added += 1
        prev = env[carry[j][0]]
    for u in post_users:
        u.replace_input_with(final, prev)
    graph.lint()
    gm.recompile()
    return added
