"""Sharding rules, one registry keyed by aten op (and by autopar's own runtime ops).

A rule receives a node and the placements of its tensor inputs on one mesh axis, and
returns the placement of the node's output (a tuple for multi-output ops).  Rules that
change local sizes (views, expands, splits) rewrite the node's shape arguments to local
sizes through :class:`RuleContext`.  An op without a rule whose inputs are sharded is an
error that names the node, its module and its source line; an op whose inputs are all
replicated needs no rule.

Placements are PyTorch's own ``Replicate``, ``Shard(dim)`` and ``Partial`` from
``torch.distributed.tensor``.  Rules are written here; view-family rules live in
``passes/view_rules.py``; the propagation loop is ``passes/shard_propagation.py``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.ops import collectives as C
from autopar.ops import random as RNG
from autopar.errors import AutoparError, describe_node
from .context import provenance

aten = torch.ops.aten

__all__ = ["RuleContext", "register", "lookup", "ShardingError", "is_sharded", "R", "P"]

R = Replicate()
P = Partial()

_REGISTRY: dict[Any, Callable] = {}


class ShardingError(AutoparError):
    pass


def register(*ops):
    def deco(fn):
        for op in ops:
            _REGISTRY[op] = fn
        return fn

    return deco


def lookup(op) -> Callable | None:
    return _REGISTRY.get(op)


def is_sharded(p: Any) -> bool:
    if isinstance(p, (tuple, list)):
        return any(is_sharded(x) for x in p)
    return isinstance(p, (Shard, Partial))


@dataclasses.dataclass
class RuleContext:
    """What a rule may know and do: the axis, its size, and local-shape rewriting."""

    gm: torch.fx.GraphModule
    axis: str
    size: int
    local_syms: dict[Node, set[str]]  # symint nodes already local on some axes

    def fail(self, node: Node, found: str, hint: str = "") -> ShardingError:
        return ShardingError(
            f"autopar: cannot shard {describe_node(node)} on mesh axis '{self.axis}': {found}. "
            + (hint or "Try a plan without this dimension (e.g. drop tp/sp) for this model, or report the op.")
        )

    def shard_operand(self, node: Node, arg: Node, dim: int) -> Node:
        """Replace ``node``'s replicated input ``arg`` by this rank's slice along ``dim``."""
        with self.gm.graph.inserting_before(node):
            part = self.gm.graph.call_function(C.local_shard, (arg, dim, self.axis))
        part.meta["val"] = arg.meta.get("val")
        part.meta["autopar_placement"] = {self.axis: Shard(dim)}
        provenance(part, "shard_propagation_pass", self.axis,
                   f"take this rank's slice of replicated {arg.name} (no communication)")
        node.replace_input_with(arg, part)
        return part

    def local_size(self, node: Node, elem: Any) -> Any:
        """Local value of a global size ``elem`` (int, -1 or symint node) divided by the axis size."""
        if isinstance(elem, int):
            if elem == -1:
                return -1
            if elem % self.size:
                raise self.fail(node, f"size {elem} is not divisible by {self.axis}={self.size}",
                                f"Choose a {self.axis} degree that divides {elem}.")
            return elem // self.size
        if isinstance(elem, Node):
            if self.axis in self.local_syms.get(elem, set()):
                return elem
            with self.gm.graph.inserting_before(node):
                div = self.gm.graph.call_function(operator.floordiv, (elem, self.size))
            div.meta["val"] = elem.meta.get("val") // self.size if "val" in elem.meta else None
            self.local_syms[div] = self.local_syms.get(elem, set()) | {self.axis}
            return div
        raise self.fail(node, f"unsupported size argument {elem!r}")


def shape_of(node: Any) -> tuple:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else ()


def ndim_of(node: Any) -> int:
    return len(shape_of(node))


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else dim


# --- pointwise ------------------------------------------------------------------------

_LINEAR_IN_FIRST = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
_PARTIAL_SAFE = {
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default, aten.alias.default,
    aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.detach.default, aten.type_as.default,
}


@register(
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.tanh.default, aten.sigmoid.default, aten.rsqrt.default, aten.sqrt.default, aten.exp.default,
    aten.log.default, aten.cos.default, aten.sin.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default,
    aten.clone.default, aten.alias.default, aten.contiguous.default, aten.detach.default,
    aten.dropout.default, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor, aten.lt.Scalar,
    aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.ge.Tensor, aten.ge.Scalar,
    aten.__and__.Tensor, aten.__or__.Tensor, aten.logical_not.default, aten.bitwise_not.default,
    aten.abs.default, aten.square.default, aten.reciprocal.default, aten.erf.default,
    aten.clamp.default, aten.softplus.default, RNG.dropout,
)
def pointwise_rule(node: Node, pls: list, rc: RuleContext):
    out_ndim = ndim_of(node)
    out_shape = shape_of(node)
    shard_dim = None
    partial = 0
    tensor_args = [a for a in node.args if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    for arg, pl in zip(tensor_args, pls):
        if isinstance(pl, Partial):
            partial += 1
        elif isinstance(pl, Shard):
            d = pl.dim + out_ndim - ndim_of(arg)
            if shard_dim is not None and shard_dim != d:
                raise rc.fail(node, f"operands are sharded on different dims ({shard_dim} and {d})")
            shard_dim = d
    if partial:
        if shard_dim is not None:
            raise rc.fail(node, "mixes a partial sum with a sharded operand")
        num_partial_ok = len(tensor_args) if node.target in (aten.add.Tensor, aten.sub.Tensor) else 1
        if node.target in _LINEAR_IN_FIRST and partial == 1 and isinstance(pls[0], Partial):
            return P
        if node.target in _PARTIAL_SAFE and partial == num_partial_ok:
            return P
        raise rc.fail(node, "a partial sum reaches an op that is not linear in it",
                      "The reduction after a row-parallel projection should come first; report the model.")
    if shard_dim is None:
        return R
    for arg, pl in zip(tensor_args, pls):
        if isinstance(pl, Replicate):
            d = shard_dim - (out_ndim - ndim_of(arg))
            if d >= 0 and shape_of(arg)[d] != 1 and out_shape[shard_dim] != 1:
                # e.g. learned position embeddings added to sequence shards under SP
                rc.shard_operand(node, arg, d)
    return Shard(shard_dim)


# --- reductions and normalisation ------------------------------------------------------

@register(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
          aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
          aten.cumsum.default, aten.argmax.default)
def reduction_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if not isinstance(pl, Shard):
        if isinstance(pl, Partial):
            raise rc.fail(node, "reduces a partial sum")
        return R
    in_ndim = ndim_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        raise rc.fail(node, "reduces over all dims of a sharded tensor")
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_norm(d, in_ndim) for d in dims]
    if pl.dim in dims:
        raise rc.fail(node, f"reduces over the sharded dim {pl.dim}",
                      "Only reductions over unsharded dims are supported under this plan.")
    keepdim = node.target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                              aten.log_softmax.int, aten.cumsum.default)
    if not keepdim:
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if keepdim:
        return Shard(pl.dim)
    return Shard(pl.dim - sum(1 for d in dims if d < pl.dim))


# --- matmuls ----------------------------------------------------------------------------

@register(aten.linear.default)
def linear_rule(node: Node, pls: list, rc: RuleContext):
    x, w = pls[0], pls[1]
    b = pls[2] if len(pls) > 2 else R
    nd = ndim_of(node)
    if isinstance(w, Shard) and w.dim == 0 and isinstance(x, Replicate) and not isinstance(b, Partial):
        if isinstance(b, Replicate) and len(pls) > 2:
            raise rc.fail(node, "column-parallel weight with a replicated bias")
        return Shard(nd - 1)
    if isinstance(w, Shard) and w.dim == 1 and isinstance(x, Shard) and x.dim == nd - 1:
        if len(pls) > 2:
            raise rc.fail(node, "row-parallel linear still has its bias (the TP pass moves it after the reduction)")
        return P
    if isinstance(w, Replicate) and isinstance(b, Replicate):
        if isinstance(x, Shard) and x.dim < nd - 1:
            return x
        if isinstance(x, (Replicate, Partial)):
            return x
    raise rc.fail(node, f"input {x}, weight {w}, bias {b} do not form a column- or row-parallel linear")


@register(aten.addmm.default)
def addmm_rule(node: Node, pls: list, rc: RuleContext):
    b, x, w = pls
    if isinstance(w, Shard) and w.dim == 1 and isinstance(x, Replicate) and isinstance(b, Shard):
        return Shard(1)
    if isinstance(w, Shard) and w.dim == 0 and isinstance(x, Shard) and x.dim == 1 and isinstance(b, Replicate):
        raise rc.fail(node, "row-parallel addmm with a bias (the TP pass should have split the bias)")
    if all(isinstance(p, Replicate) for p in (b, w)) and isinstance(x, Shard) and x.dim == 0:
        return x
    raise rc.fail(node, f"bias {b}, input {x}, weight {w} do not form a column- or row-parallel addmm")


@register(aten.mm.default)
def mm_rule(node: Node, pls: list, rc: RuleContext):
    x, w = pls
    if isinstance(x, Replicate) and isinstance(w, Shard) and w.dim == 1:
        return Shard(1)
    if isinstance(x, Shard) and x.dim == 1 and isinstance(w, Shard) and w.dim == 0:
        return P
    if isinstance(x, Shard) and x.dim == 0 and isinstance(w, Replicate):
        return x
    raise rc.fail(node, f"operands {x}, {w} do not form a parallel matmul")


@register(aten.matmul.default, aten.bmm.default)
def batched_matmul_rule(node: Node, pls: list, rc: RuleContext):
    a, b = pls
    nd = ndim_of(node)
    if isinstance(a, Shard) and isinstance(b, Shard):
        da, db = a.dim + nd - ndim_of(node.args[0]), b.dim + nd - ndim_of(node.args[1])
        if da == db and da < nd - 2:
            return Shard(da)
    if isinstance(a, Shard) and isinstance(b, Replicate) and a.dim + nd - ndim_of(node.args[0]) < nd - 1:
        return Shard(a.dim + nd - ndim_of(node.args[0]))
    raise rc.fail(node, f"operands {a}, {b} are not sharded on a common batch dim")


@register(aten.scaled_dot_product_attention.default, RNG.attention)
def sdpa_rule(node: Node, pls: list, rc: RuleContext):
    q, k, v = pls[:3]
    nd = ndim_of(node)
    heads = nd - 3
    if all(isinstance(p, Shard) and p.dim == heads for p in (q, k, v)):
        for mask, pl in zip(node.args[3:4], pls[3:4]):
            if isinstance(pl, Replicate) and shape_of(mask)[heads - (nd - ndim_of(mask))] not in (1,):
                raise rc.fail(node, "the attention mask has one entry per head; heads are sharded")
        return Shard(heads)
    if all(isinstance(p, Replicate) for p in pls):
        return R
    if all(isinstance(p, Shard) and p.dim == 0 for p in (q, k, v)):
        return Shard(0)
    raise rc.fail(node, f"q/k/v placements {q}, {k}, {v}; expected all sharded on the heads dim {heads}")


@register(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(node: Node, pls: list, rc: RuleContext):
    x = pls[0]
    if isinstance(x, Replicate) and all(isinstance(p, Replicate) for p in pls):
        return R
    num_norm = len(node.args[1])
    if isinstance(x, Shard) and x.dim < ndim_of(node.args[0]) - num_norm and all(
            isinstance(p, Replicate) for p in pls[1:]):
        return x
    raise rc.fail(node, f"normalisation of an input placed {x} (weights {pls[1:]})")


@register(C.local_shard)
def local_shard_rule(node: Node, pls: list, rc: RuleContext):
    return Shard(node.args[1]) if node.args[2] == rc.axis else pls[0]


@register(aten.embedding.default)
def embedding_rule(node: Node, pls: list, rc: RuleContext):
    w, ids = pls[:2]
    if isinstance(w, Replicate) and not isinstance(ids, Partial):
        return ids
    raise rc.fail(node, f"embedding with weight {w} and indices {ids}",
                  "The TP pass replaces vocabulary-sharded embeddings with vocab_parallel_embedding.")


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(node: Node, pls: list, rc: RuleContext):
    if all(isinstance(p, Replicate) for p in pls):
        return R
    raise rc.fail(node, f"cross-entropy of {pls[0]} logits",
                  "Vocabulary-sharded logits are handled by the TP pass; sequence-sharded logits are not supported.")


@register(aten.sym_size.int)
def sym_size_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, Shard) and _norm(node.args[1], ndim_of(node.args[0])) == pl.dim:
        rc.local_syms.setdefault(node, set()).add(rc.axis)
    return None


@register(operator.getitem)
def getitem_rule(node: Node, pls: list, rc: RuleContext):
    src = pls[0]
    if isinstance(src, (tuple, list)):
        return src[node.args[1]]
    return src


# --- autopar runtime ops ----------------------------------------------------------------

def _axis_of(node: Node) -> str:
    return node.kwargs.get("axis") or next(a for a in node.args if isinstance(a, str))


@register(C.all_gather)
def all_gather_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) != rc.axis:
        return pls[0]
    dim = _norm(node.args[1], ndim_of(node))
    if pls[0] != Shard(dim):
        raise rc.fail(node, f"all-gather on dim {dim} of an input placed {pls[0]}")
    return R


@register(C.reduce_scatter)
def reduce_scatter_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) != rc.axis:
        return pls[0]
    if not isinstance(pls[0], Partial):
        raise rc.fail(node, f"reduce-scatter of an input placed {pls[0]}, expected a partial sum")
    return Shard(_norm(node.args[1], ndim_of(node)))


@register(C.all_reduce)
def all_reduce_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) != rc.axis:
        return pls[0]
    if not isinstance(pls[0], Partial):
        raise rc.fail(node, f"all-reduce of an input placed {pls[0]}, expected a partial sum")
    return R


@register(C.region_entry)
def region_entry_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) == rc.axis and not isinstance(pls[0], Replicate):
        raise rc.fail(node, f"tensor-parallel region entered with an input placed {pls[0]}")
    return pls[0]


@register(C.vocab_parallel_embedding)
def vocab_embedding_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) != rc.axis:
        return pls[1]
    if pls[0] != Shard(0) or not isinstance(pls[1], Replicate):
        raise rc.fail(node, f"vocab-parallel embedding with weight {pls[0]} and ids {pls[1]}")
    return P


@register(C.vocab_parallel_cross_entropy)
def vocab_ce_rule(node: Node, pls: list, rc: RuleContext):
    if _axis_of(node) != rc.axis:
        return pls[0]
    if pls[0] != Shard(ndim_of(node.args[0]) - 1) or not isinstance(pls[1], Replicate):
        raise rc.fail(node, f"vocab-parallel cross-entropy of logits {pls[0]} and target {pls[1]}")
    return R
