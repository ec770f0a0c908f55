"""Sharding rules, one registry keyed by aten op (and by autopar's own runtime ops).

A rule receives a node and the placements of its tensor inputs on one mesh axis, and
returns the placement of the node's output (a tuple for multi-output ops).  Rules that
change local sizes (views, expands, splits) rewrite the node's shape arguments to local
sizes through :class:`RuleContext`.  An op without a rule whose inputs are sharded is an
error that names the node, its module and its source line; an op whose inputs are all
replicated needs no rule.

Placements are PyTorch's own ``Replicate``, ``Shard(dim)`` and ``Partial`` from
``torch.distributed.tensor``.  Rules of aten ops are written here; view-family rules live in
``passes/view_rules.py``, MoE rules in ``passes/moe_rules.py``, those of autopar's own
operators (collectives, CP attention) in ``passes/op_rules.py``; the propagation loop is
``passes/shard_propagation.py``.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node
from torch.utils._sympy.functions import ToFloat

from autopar.compat import sym_expr
from autopar.ops import collectives as C
from autopar.ops import cp_attention as CPA
from autopar.ops import random as RNG
from autopar.errors import AutoparError, describe_node
from .context import provenance

aten = torch.ops.aten

__all__ = ["RuleContext", "register", "lookup", "ShardingError", "is_sharded", "is_loss_share", "tensor_inputs",
           "axis_of", "R", "P"]

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


def tensor_inputs(node: Node) -> list[Node]:
    """``node``'s tensor-valued inputs in argument order: the order rules get placements in."""
    out: list[Node] = []

    def visit(a: Any) -> None:
        if isinstance(a, Node):
            if isinstance(a.meta.get("val"), (torch.Tensor, tuple, list)) or a.op == "get_attr":
                out.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    visit(node.args)
    visit(tuple(node.kwargs.values()))
    return out


def is_sharded(p: Any) -> bool:
    if isinstance(p, (tuple, list)):
        return any(is_sharded(x) for x in p)
    return isinstance(p, (Shard, Partial))


@dataclasses.dataclass
class RuleContext:
    """What a rule may know and do: the axis, its size, and local-shape rewriting.

    ``local_sizes``: the axis shards the *data* and the graph's sizes are already this rank's
    (context parallelism: ``train_step`` hands each rank its sequence chunks, so the traced
    sequence symbols ``token_symbols`` of the inputs are the local length).  Rules then keep
    size arguments as they are, a sharded dim is the one whose size holds a sequence symbol
    (its *token dim*), and every value whose shape holds one must be placed on it
    (:meth:`check_tokens`)."""

    gm: torch.fx.GraphModule
    axis: str
    size: int
    local_syms: dict[Node, set[str]]  # symint nodes already local on some axes
    local_sizes: bool = False
    token_symbols: frozenset = frozenset()  # under local_sizes: the sequence symbols of the inputs
    pass_name: str = "shard_propagation_pass"
    sum_loss: bool = False  # under local_sizes: the loss is a sum, which the runtime adds over the ranks

    def fail(self, node: Node, found: str, hint: str = "") -> ShardingError:
        return ShardingError(
            f"autopar: cannot shard {describe_node(node)} on mesh axis '{self.axis}': {found}. "
            + (hint or f"Try a plan without this dimension (e.g. drop {_PLAN_TOKENS.get(self.axis, self.axis)}) "
                       "for this model, or report the op.")
        )

    def shard_operand(self, node: Node, arg: Node, dim: int) -> Node:
        """Replace ``node``'s replicated input ``arg`` by this rank's slice along ``dim``."""
        if self.local_sizes:  # the graph's sizes are local: a replicated operand this long is not a slice
            raise self.fail(node, f"replicated {arg.name} meets this rank's tokens along dim {dim}")
        with self.gm.graph.inserting_before(node):
            part = self.gm.graph.call_function(C.local_shard, (arg, dim, self.axis))
        part.meta["val"] = arg.meta.get("val")
        part.meta["autopar_placement"] = {self.axis: Shard(dim)}
        provenance(part, self.pass_name, self.axis,
                   f"take this rank's slice of replicated {arg.name} (no communication)")
        node.replace_input_with(arg, part)
        return part

    def token_dim(self, node: Node, val: Any = None) -> int | None:
        """Under ``local_sizes``: the dim of ``node``'s value whose size holds the sequence symbol
        (None without one); refused when several do or the symbol is split across dims."""
        val = node.meta.get("val") if val is None else val
        if not isinstance(val, torch.Tensor) or not self.token_symbols:
            return None
        dims = [d for d, s in enumerate(val.shape) if _size_expr(s).free_symbols & self.token_symbols]
        if not dims:
            return None
        if len(dims) > 1:
            raise self.fail(node, f"its shape {tuple(val.shape)} holds the sequence length in dims {dims}: "
                                  "it relates positions to positions (scores or a mask over the sequence)",
                            f"{self.axis} needs attention through scaled_dot_product_attention and "
                            f"position-wise work elsewhere; use a plan without {self.axis} for this model.")
        size = _size_expr(val.shape[dims[0]])
        (symbol, *more) = size.free_symbols & self.token_symbols
        ratio = sympy.simplify(size / symbol)
        if more or ratio.has(symbol) or (ratio.is_Rational and not ratio.is_Integer):
            raise self.fail(node, f"dim {dims[0]} of shape {tuple(val.shape)} splits the sequence",
                            f"Reshape only whole sequence dims under {self.axis}.")
        return dims[0]

    def check_tokens(self, node: Node, pl: Any) -> None:
        """Under ``local_sizes``: a value whose shape holds the sequence length must be placed on
        that dim, or it was computed from the local length without this rank's positions."""
        val = node.meta.get("val")
        vals, pls = (val, pl) if isinstance(val, (tuple, list)) else ((val,), (pl,))
        for v, p in zip(vals, pls if isinstance(pls, (tuple, list)) else [pls] * len(vals)):
            dim = self.token_dim(node, v)
            if dim is None or p == Shard(dim):
                continue
            if self.axis == "dp":  # batch rows (passes/batch_propagation.py)
                raise self.fail(node, f"its shape {tuple(v.shape)} has the batch size in dim {dim} but it is "
                                      f"placed {p}, not on this rank's rows: it reduces or mixes the rows of "
                                      "the batch in a way no rule follows",
                                "Keep the batch's rows independent outside sums and means over them, or use "
                                "a plan without dp and micro-batches for this model.")
            raise self.fail(node, f"its shape {tuple(v.shape)} has the sequence length in dim {dim} but it is "
                                  f"placed {p}, not on this rank's tokens: it was computed from the local "
                                  "sequence length without this rank's global positions (or slices, "
                                  "concatenates or reduces along the sequence)",
                            f"{self.axis} rewrites only arange(seq) positions, constant masks, cumulative "
                            "sums and scaled_dot_product_attention over the sequence; use a plan without "
                            f"{self.axis} for this model, or pass position_ids.")

    def local_size(self, node: Node, elem: Any) -> Any:
        """Local value of a global size ``elem`` (int, -1 or symint node) divided by the axis size
        (under ``local_sizes`` the graph's sizes are local already: ``elem`` itself)."""
        if self.local_sizes:
            return elem
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


def _size_expr(size: Any) -> sympy.Expr:
    return sym_expr(size) if isinstance(size, torch.SymInt) else sympy.Integer(int(size))


# The plan token that adds each mesh axis (for "use a plan without ..." hints).
_PLAN_TOKENS = {"tp": "tp/sp", "cp": "cp", "ep": "ep", "dp": "dp"}


def is_loss_share(pl: Any) -> bool:
    """A data-sharded axis's placement of the loss: each rank's mean over its own tokens, which
    the runtime averages over the ranks holding the other tokens (as over dp)."""
    return isinstance(pl, Partial) and pl.reduce_op == "avg"


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
    if rc.local_sizes:
        kind = _on_data_axis(node, tensor_args, pls, partial, rc)
        if kind is not None:
            return kind
        partial = 0  # any partial operand was all-reduced over the tokens: replicated now
    if partial:
        if shard_dim is not None:
            raise rc.fail(node, "mixes a partial sum with a sharded operand")
        kinds = {pl for pl in pls if isinstance(pl, Partial)}
        if len(kinds) > 1:  # a sum of shares and a mean of shares (a loss) do not add up
            raise rc.fail(node, f"combines partial values of different reductions {sorted(map(str, kinds))}")
        (kind,) = kinds
        num_partial_ok = len(tensor_args) if node.target in (aten.add.Tensor, aten.sub.Tensor) else 1
        if node.target in _LINEAR_IN_FIRST and partial == 1 and isinstance(pls[0], Partial):
            return kind
        if node.target in _PARTIAL_SAFE and partial == num_partial_ok:
            return kind
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


# --- partial values on a data-sharded axis (dp, cp) ------------------------------------
# There each rank holds a share of the batch's tokens; a reduction over them leaves a share of
# the batch's value: ``Partial("avg")`` (a mean: the ranks' values average to it) or ``P`` (a
# sum).  Linear use keeps the share; any other use first all-reduces it over the axis
# (``token_all_reduce``), so a statistic of the whole batch (an MoE load-balancing loss, a
# batch norm) is exact, not this rank's.  A size that counts this rank's tokens is a local
# count: a sum divided by it is a share of the batch's mean; other arithmetic with it is refused.

_ZERO_FILLS = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}


def _is_zeros(node: Any) -> bool:
    return isinstance(node, Node) and node.target in _ZERO_FILLS


def _scalar_expr(val: Any) -> sympy.Expr | None:
    """The sympy expression of a symbolic scalar argument (SymInt / SymFloat), else None."""
    if isinstance(val, (torch.SymInt, torch.SymFloat)):
        return val.node.expr.replace(ToFloat, lambda x: x)
    return None


def _token_count(node: Node, rc: RuleContext) -> list[Node]:
    """The scalar arguments of ``node`` whose value counts this rank's tokens (a size holding a
    sequence / batch symbol of the axis); refused when not proportional to one of them."""
    out = []
    for a in node.args:
        expr = _scalar_expr(a.meta.get("val")) if isinstance(a, Node) else None
        if expr is None or not expr.free_symbols & rc.token_symbols:
            continue
        (symbol, *more) = expr.free_symbols & rc.token_symbols
        if more or sympy.simplify(expr / symbol).has(symbol):
            raise rc.fail(node, f"uses the local size {expr}, not proportional to this rank's token count",
                          "Compute sizes from the global batch, or use a plan without this dimension.")
        out.append(a)
    return out


def _all_reduce_tokens(node: Node, arg: Node, pl: Partial, rc: RuleContext) -> None:
    op = "avg" if pl.reduce_op == "avg" else "sum"
    with rc.gm.graph.inserting_before(node):
        total = rc.gm.graph.call_function(C.token_all_reduce, (arg, rc.axis, op, f"{op} {arg.name}"))
    total.meta["val"] = arg.meta.get("val")
    for key in ("nn_module_stack", "stack_trace"):
        if key in node.meta:
            total.meta[key] = node.meta[key]
    provenance(total, rc.pass_name, rc.axis, f"{describe_node(node)} is not linear in {arg.name}, a share of a "
               f"statistic over the batch's tokens: {op} it over the ranks holding the other tokens "
               "(backward: the same all-reduce)", role="token_statistic")
    node.replace_input_with(arg, total)


def _on_data_axis(node: Node, tensor_args: list, pls: list, partial: int, rc: RuleContext):
    """The placement of a pointwise op with ``partial`` partial operands on a data axis, or None
    once every partial operand was all-reduced (the op then runs on replicated values)."""
    counts = _token_count(node, rc)
    if not partial:
        if counts:
            raise rc.fail(node, f"divides or multiplies by this rank's token count {counts[0].name}",
                          "Only a sum over this rank's tokens may be divided by its token count.")
        return None
    kinds = {pl for pl in pls if isinstance(pl, Partial)}
    others = [a for a, pl in zip(tensor_args, pls) if not isinstance(pl, Partial)]
    kind = next(iter(kinds)) if len(kinds) == 1 else None
    target = node.target
    if kind is not None and not counts:
        if target in (aten.add.Tensor, aten.sub.Tensor) and all(isinstance(pl, Replicate) for pl in pls
                                                                 if not isinstance(pl, Partial)):
            # shares add; a replicated term adds once to the mean of shares, a zero to a sum
            if is_loss_share(kind) or all(_is_zeros(a) for a in others):
                return kind
        if target in _PARTIAL_SAFE and partial == 1 and not others:
            return kind
        scaled = target in (aten.mul.Tensor, aten.mul.Scalar) or isinstance(pls[0], Partial)  # x / y: by x only
        if (target in _LINEAR_IN_FIRST and partial == 1 and scaled
                and all(isinstance(pl, (Partial, Replicate)) for pl in pls)):
            return kind
    if (kind == P and len(counts) == 1 and target is aten.div.Tensor and partial == 1 and not others
            and node.args[1] is counts[0]):
        return Partial("avg")  # (sum of this rank's part) / (its token count): a share of the mean
    if counts:
        raise rc.fail(node, f"uses this rank's token count {counts[0].name} with a value placed {sorted(map(str, kinds))}",
                      "Only a sum over this rank's tokens may be divided by its token count.")
    for arg, pl in zip(tensor_args, pls):
        if isinstance(pl, Partial):
            _all_reduce_tokens(node, arg, pl, rc)
    return None


# --- reductions and normalisation ------------------------------------------------------

@register(aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten.var.correction,
          aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int,
          aten.argmax.default)
def reduction_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if not isinstance(pl, Shard):
        if isinstance(pl, Partial):
            raise rc.fail(node, "reduces a partial sum")
        return R
    in_ndim = ndim_of(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or dims == []:
        dims = list(range(in_ndim))
        if node.target not in _SHARE_OF_LOSS:
            raise rc.fail(node, "reduces over all dims of a sharded tensor")
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = [_norm(d, in_ndim) for d in dims]
    keepdim = node.target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                              aten.log_softmax.int)
    if not keepdim:
        keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if pl.dim in dims:
        if rc.local_sizes and node.target in _SHARE_OF_LOSS:
            # this rank's share of a mean over the tokens (the loss, a router's mean probability),
            # its part of a sum: equal token counts per rank make the mean of the means exact
            return _SHARE_OF_LOSS[node.target]
        if not rc.local_sizes and node.target in (aten.mean.dim, aten.sum.dim_IntList):
            return _reduce_across_ranks(node, dims, rc)
        raise rc.fail(node, f"reduces over the sharded dim {pl.dim}",
                      "Only reductions over unsharded dims are supported under this plan.")
    if keepdim:
        return Shard(pl.dim)
    return Shard(pl.dim - sum(1 for d in dims if d < pl.dim))


def _reduce_across_ranks(node: Node, dims: list[int], rc: RuleContext):
    """A sum or mean over dims that include the sharded one (OLMo 2's q/k RMSNorm over the whole
    projection width): this rank's sum is a partial sum; an all-reduce makes it the whole sum,
    which a mean then divides by the global count.  The reduced value then meets this rank's
    shard again (the norm scales it), so its gradient is a partial sum too: a region entry
    after the all-reduce sums it in backward.  Returns the partial placement of ``node`` (now a
    sum); its users read the reduced value, replicated."""
    sizes = [_size_expr(shape_of(node.args[0])[d]) for d in dims]
    count = sympy.prod(sizes)
    if node.target is aten.mean.dim and not count.is_Integer:
        raise rc.fail(node, f"averages over the sharded dim together with dims of symbolic size {sizes}",
                      "Only means over dims of fixed size are reduced across ranks.")
    users = list(node.users)
    graph = rc.gm.graph
    total = _sum_across_ranks(node, rc, "a reduction over a sharded width")
    with graph.inserting_after(total):
        out = graph.call_function(C.region_entry, (total, rc.axis, "reduction"))
    out.meta["val"] = node.meta.get("val")
    provenance(out, rc.pass_name, rc.axis, f"backward: sum the gradient of {node.name}'s all-reduced value, "
               "which each rank's shard contributes to", role="reduction")
    if node.target is aten.mean.dim:
        node.target = aten.sum.dim_IntList  # same arguments: (input, dims, keepdim, dtype=)
        with graph.inserting_after(out):
            out = graph.call_function(aten.div.Tensor, (out, int(count)))
        out.meta["val"] = node.meta.get("val")
    for user in users:
        user.replace_input_with(node, out)
    return P


def _sum_across_ranks(node: Node, rc: RuleContext, why: str) -> Node:
    """An all-reduce of ``node``'s partial value over ``rc.axis``, inserted after it (its users
    are rerouted by the caller)."""
    with rc.gm.graph.inserting_after(node):
        total = rc.gm.graph.call_function(C.all_reduce, (node, rc.axis, "reduction"))
    total.meta["val"] = node.meta.get("val")
    provenance(total, rc.pass_name, rc.axis, f"sum {node.name} over the {rc.axis}-sharded dim across ranks "
               f"({why})", role="reduction")
    return total


@register(aten.histc.default)
def histc_rule(node: Node, pls: list, rc: RuleContext):
    """A histogram of a sharded tensor (an MoE load-balancing loss counting tokens per expert):
    each rank counts its own elements, a part of the whole count.  On a data axis that part is
    the placement (``P``); on a model axis (tp with sp) the counts are summed at once (they
    carry no gradient)."""
    pl = pls[0]
    if isinstance(pl, Replicate):
        return R
    if isinstance(pl, Partial):
        raise rc.fail(node, "a histogram of a partial sum")
    if rc.local_sizes:
        return P
    users = list(node.users)
    total = _sum_across_ranks(node, rc, "a histogram of sharded values")
    for user in users:
        user.replace_input_with(node, total)
    return P


# A reduction of every element over a data-sharded axis (cp): each rank's mean of its own tokens
# is its share of the mean (equal shares), each rank's sum its part of the sum.
_SHARE_OF_LOSS = {aten.mean.dim: Partial("avg"), aten.mean.default: Partial("avg"),
                  aten.sum.dim_IntList: P, aten.sum.default: P}


@register(aten.mean.default, aten.sum.default)
def full_reduction_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, Replicate):
        return R
    if isinstance(pl, Shard) and rc.local_sizes:
        return _SHARE_OF_LOSS[node.target]
    raise rc.fail(node, f"reduces every element of a tensor placed {pl}")


@register(aten.diff.default)
def diff_rule(node: Node, pls: list, rc: RuleContext):
    """Differences of neighbours along a dim other than the sharded one (Hugging Face's packed-
    sequence check on position ids) stay on the shard; along the sharded dim they are refused."""
    x = node.args[0]
    dim = _norm(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), ndim_of(x))
    if len(set(pls)) > 1 or isinstance(pls[0], Partial):
        raise rc.fail(node, f"differences of operands placed {pls}")
    if isinstance(pls[0], Shard) and pls[0].dim == dim:
        raise rc.fail(node, f"differences along the sharded dim {dim}")
    return pls[0]


@register(aten.cumsum.default, CPA.cp_cumsum)
def cumsum_rule(node: Node, pls: list, rc: RuleContext):
    """A cumulative sum along this rank's tokens of a data-sharded axis (cp: OPT's positions from
    the attention mask) becomes :func:`autopar.ops.cp_attention.cp_cumsum`, the same prefix sum
    in global token order; along any other sharded dim it is refused."""
    pl = pls[0]
    x = node.args[0]
    dim = _norm(node.args[1], ndim_of(x))
    if not (isinstance(pl, Shard) and pl.dim == dim):
        if isinstance(pl, Partial):
            raise rc.fail(node, "a cumulative sum of a partial sum")
        return pl
    if node.target is CPA.cp_cumsum:
        return pl
    if not rc.local_sizes:
        raise rc.fail(node, f"a cumulative sum along the sharded dim {dim}")
    if _size_expr(shape_of(x)[dim]) not in rc.token_symbols:
        raise rc.fail(node, f"a cumulative sum along dim {dim} of shape {shape_of(x)}, which merges the "
                            "sequence with other dims")
    dtype = node.kwargs.get("dtype", node.args[2] if len(node.args) > 2 else None)
    node.target, node.args, node.kwargs = CPA.cp_cumsum, (x, dim, rc.axis), {"dtype": dtype}
    provenance(node, rc.pass_name, rc.axis,
               "cumulative sum in global token order: this rank's chunk totals all-gathered as offsets")
    return pl


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
    if isinstance(a, Replicate) and isinstance(b, Shard) and ndim_of(node.args[1]) >= 2 \
            and b.dim == ndim_of(node.args[1]) - 1:  # columns of b: e.g. inv_freq @ positions (RoPE)
        return Shard(nd - 1)
    if isinstance(a, Shard) and isinstance(b, Shard) and not rc.local_sizes and ndim_of(node.args[1]) == 2 \
            and a.dim == ndim_of(node.args[0]) - 1 and b.dim == 0:  # row-parallel ``x @ w.T``: partial sums
        return P
    raise rc.fail(node, f"operands {a}, {b} are not sharded on a common batch dim")


@register(aten.outer.default)
def outer_rule(node: Node, pls: list, rc: RuleContext):
    """``outer(a, b)[i, j] = a[i] * b[j]``: a's shard is the rows, b's the columns (not both)."""
    a, b = pls
    if isinstance(a, Partial) or isinstance(b, Partial):
        if isinstance(a, Replicate) or isinstance(b, Replicate):
            return a if isinstance(a, Partial) else b
        raise rc.fail(node, f"outer product of {a} and {b}")
    if isinstance(a, Shard) and isinstance(b, Shard):
        raise rc.fail(node, "outer product of two sharded vectors")
    return Shard(0) if isinstance(a, Shard) else Shard(1) if isinstance(b, Shard) else R


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


@register(aten.ones.default, aten.zeros.default, aten.full.default, aten.empty.memory_format,
          aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default)
def fill_rule(node: Node, pls: list, rc: RuleContext):
    """A constant fill is the same on every rank; on a data-sharded axis (cp), one as long as the
    sequence is also exactly this rank's part of the global constant (OPT's all-ones mask)."""
    dim = rc.token_dim(node) if rc.local_sizes else None
    return R if dim is None else Shard(dim)


@register(aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default)
def fill_like_rule(node: Node, pls: list, rc: RuleContext):
    """A constant in the shape of a shard is that shard of the constant."""
    return pls[0] if isinstance(pls[0], Shard) else R


@register(aten.embedding.default)
def embedding_rule(node: Node, pls: list, rc: RuleContext):
    w, ids = pls[:2]
    if isinstance(w, Replicate) and not isinstance(ids, Partial):
        return ids
    raise rc.fail(node, f"embedding with weight {w} and indices {ids}",
                  "The TP pass replaces vocabulary-sharded embeddings with vocab_parallel_embedding.")


def _token_loss(node: Node, logits: Any, target: Any, reduction: int, weighted: bool, rc: RuleContext,
                class_dim: int | None = None):
    """Cross-entropy of this rank's tokens on a data-sharded axis (cp): per-token losses stay on
    the tokens, their mean is this rank's share of the mean, their sum its part of the sum."""
    x = node.args[0]
    if class_dim is None:
        class_dim = 1 if ndim_of(x) >= 2 else 0
    if not isinstance(logits, Shard) or logits.dim == class_dim:
        raise rc.fail(node, f"cross-entropy of logits placed {logits}")
    token = logits.dim - (1 if logits.dim > class_dim else 0)
    if target != Shard(token):
        raise rc.fail(node, f"cross-entropy of logits placed {logits} against a target placed {target}")
    if reduction == 0:
        return Shard(token)
    if weighted and reduction == 1:
        raise rc.fail(node, "a class-weighted mean cross-entropy: its denominator is a sum of weights, "
                            "which differs between ranks' tokens", "Use unweighted cross-entropy under this plan.")
    return Partial("avg") if reduction == 1 else P


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(node: Node, pls: list, rc: RuleContext):
    if all(isinstance(p, Replicate) for p in pls):
        return R
    if rc.local_sizes:
        names = ("input", "target", "weight", "reduction")
        bound = {**dict(zip(names, node.args)), **node.kwargs}
        return _token_loss(node, pls[0], pls[1], bound.get("reduction", 1), bound.get("weight") is not None, rc)
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


def axis_of(node: Node) -> str:
    """The mesh axis an autopar runtime op node works on."""
    return node.kwargs.get("axis") or next(a for a in node.args if isinstance(a, str))

