"""Sharding rules of element-wise ops, partial values on a data-sharded axis, and constant fills.

Element-wise ops (arithmetic, activations, comparisons, casts, dropout) keep their operands'
shard; a partial sum passes only through ops linear in it.  On a data-sharded axis (dp, cp) a
partial value is a share of a statistic over the batch's tokens, which linear use keeps and
any other use first all-reduces (``token_all_reduce``).  A constant fill is the same on every
rank, or this rank's part of one as long as the sequence.  Registered in the one registry of
``passes/rules.py``.
"""
from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node
from torch.utils._sympy.functions import ToFloat

from autopar.errors import describe_node
from autopar.ops import collectives
from autopar.ops import rng
from .context import provenance
from .rules import P, R, RuleContext, is_loss_share, ndim_of, register, shape_of

__all__ = ["POINTWISE_OPS", "INPLACE_POINTWISE_OPS", "pointwise_rule", "inplace_pointwise_rule", "fill_rule", "fill_like_rule", "triangle_rule"]

aten = torch.ops.aten


# --- pointwise ------------------------------------------------------------------------

_LINEAR_IN_FIRST = {aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar}
_PARTIAL_SAFE = {
    aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.clone.default, aten.alias.default,
    aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
    aten.detach.default, aten.type_as.default,
}


# The element-wise ops (this rule; the token-order rules of passes/token_order_rules.py read the set too).
POINTWISE_OPS = (
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
    aten.clamp.default, aten.softplus.default, rng.dropout,
    # two-tensor and scalar element-wise forms (a learned-scalar activation's min / max, a where
    # over constants, rounding of positions)
    aten.minimum.default, aten.maximum.default, aten.min.other, aten.max.other, aten.where.Scalar,
    aten.where.ScalarSelf, aten.where.ScalarOther, aten.clamp.Tensor, aten.clamp_min.default,
    aten.clamp_max.default, aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
    aten.sign.default, aten.expm1.default, aten.log1p.default, aten.logical_and.default,
    aten.logical_or.default, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.isnan.default,
    aten.rsub.Scalar, aten.leaky_relu.default, aten.elu.default, aten.hardtanh.default, aten.mish.default,
    # integer arithmetic of indices (LongCat folds its zero experts with ``//``), and more activations
    aten.floor_divide.default, aten.floor_divide.Scalar, aten.remainder.Scalar, aten.remainder.Tensor,
    aten.fmod.Scalar, aten.fmod.Tensor, aten.div.Tensor_mode, aten.div.Scalar_mode, aten.bitwise_xor.Tensor,
    aten.logical_xor.default, aten.log_sigmoid.default, aten.hardsigmoid.default, aten.hardswish.default,
    aten.logit.default, aten.log2.default, aten.log10.default, aten.atan.default, aten.sinh.default,
    aten.cosh.default, aten.tan.default, aten.relu6.default, aten.celu.default, aten.selu.default,
    # complex rotary tables from magnitudes and angles (DeepSeek-V2, Llama 4)
    aten.polar.default,
)


@register(*POINTWISE_OPS)
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


# In-place element-wise ops write their result into their first operand: exact only when that
# operand is already placed as the result is.  (A replicated destination met by a sharded operand
# would have its slice written instead -- a new tensor -- while later readers read it unchanged.)
INPLACE_POINTWISE_OPS = (aten.masked_fill_.Scalar, aten.masked_fill_.Tensor, aten.add_.Tensor, aten.sub_.Tensor,
                         aten.mul_.Tensor, aten.div_.Tensor, aten.mul_.Scalar, aten.div_.Scalar, aten.add_.Scalar,
                         aten.sub_.Scalar, aten.clamp_.default, aten.clamp_min_.default)


@register(*INPLACE_POINTWISE_OPS)
def inplace_pointwise_rule(node: Node, pls: list, rc: RuleContext):
    sharded = [p for p in pls[1:] if isinstance(p, Shard)]
    # checked before the element-wise rule, which would slice a replicated destination
    pl = sharded[0] if sharded and not isinstance(pls[0], Shard) else pointwise_rule(node, pls, rc)
    if pl != pls[0]:
        raise rc.fail(node, f"writes a result placed {pl} into '{node.args[0].name}', placed {pls[0]}",
                      "An in-place op keeps its destination's placement; write it out of place "
                      "(x = x.masked_fill(...)), or use a plan without this dimension.")
    return pl


# --- partial values on a data-sharded axis (dp, cp) -----------------------------------
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
        total = rc.gm.graph.call_function(collectives.token_all_reduce, (arg, rc.axis, op, f"{op} {arg.name}"))
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


# --- constant fills -------------------------------------------------------------------

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


@register(aten.tril.default, aten.triu.default)
def triangle_rule(node: Node, pls: list, rc: RuleContext):
    """``tril`` / ``triu``: zeros by position in the last two dims (a mixer's causal mask within a
    chunk), element-wise elsewhere: a shard of another dim stays, and so does a partial sum (zeros
    are linear); a shard of the last two dims would move the diagonal on each rank: refused."""
    pl = pls[0]
    if isinstance(pl, Shard) and pl.dim >= ndim_of(node) - 2:
        raise rc.fail(node, f"masks a triangle of the last two dims, one of them sharded ({pl})")
    return pl
