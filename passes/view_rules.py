"""Sharding rules for the view family: view/reshape, flatten, expand, transpose, slicing.

These ops move a sharded dim to a new position, and the ones with explicit sizes must have
those sizes rewritten to the local shard (``view(x, [b, s, 4, 16])`` becomes
``view(x, [b, s, 2, 16])`` under tp=2).  Sizes are compared as sympy expressions so the
same rules work on graphs traced with symbolic batch and sequence sizes.  On a data-sharded
axis (cp: sizes already local) sizes stay, and a reshape keeps the tokens in the dim that
keeps the sequence length.

Splits and concatenations are ``passes/join_rules.py``.  Registered in the one registry of
``passes/rules.py``; the propagation loop is
``passes/shard_propagation.py``.
"""
from __future__ import annotations

import functools
import math

import sympy
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import Node

from autopar.frontend.op_sets import SIZED_RESHAPE_OPS
from .block_layout import BLOCKS_KEY, EVERY_KEY, WHOLE_KEY
from .rules import R, RuleContext, canonical_dim, ndim_of, register, shape_of, size_expr

aten = torch.ops.aten

__all__ = ["dim_groups", "view_rule", "block_edges"]

_INT_MAX = 2**62


def dim_groups(in_shape: tuple, out_shape: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims whose products are equal."""
    groups = _dim_groups(tuple(size_expr(s) for s in in_shape), tuple(size_expr(s) for s in out_shape))
    return [(list(gi), list(gj)) for gi, gj in groups]


@functools.lru_cache(maxsize=4096)
def _dim_groups(a: tuple, b: tuple) -> tuple:
    # Cached: every layer reshapes the same shapes, and each sympy.simplify costs milliseconds.
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gi, gj, pa, pb = [], [], sympy.Integer(1), sympy.Integer(1)
        if i < len(a):
            gi.append(i); pa *= a[i]; i += 1
        if j < len(b):
            gj.append(j); pb *= b[j]; j += 1
        while True:
            ratio = sympy.simplify(pa / pb)
            if ratio == 1:
                break
            num, den = sympy.fraction(ratio)
            grow_out = (num.free_symbols and not den.free_symbols) or (ratio.is_number and ratio > 1)
            if grow_out and j < len(b):
                gj.append(j); pb *= b[j]; j += 1
            elif i < len(a):
                gi.append(i); pa *= a[i]; i += 1
            elif j < len(b):
                gj.append(j); pb *= b[j]; j += 1
            else:
                break
        groups.append((tuple(gi), tuple(gj)))
    return tuple(groups)


def _first_nonunit(dims: list[int], shape: tuple) -> int | None:
    for d in dims:
        if size_expr(shape[d]) != 1:
            return d
    return None


def _mapped_dim(node: Node, src: Node, shard: Shard, rc: RuleContext) -> int:
    in_shape, out_shape = shape_of(src), shape_of(node)
    for gi, gj in dim_groups(in_shape, out_shape):
        if shard.dim in gi:
            out = _first_nonunit(gj, out_shape)
            if out is None:
                raise rc.fail(node, f"the sharded dim {shard.dim} disappears")
            if _first_nonunit(gi, in_shape) != shard.dim:
                run_dim = None if src.meta.get(BLOCKS_KEY) else _run_dim(node, shard.dim, gi, gj, rc.size)
                if run_dim is None:
                    raise rc.fail(node, f"the sharded dim {shard.dim} is merged behind another dim of "
                                        f"{tuple(in_shape)}", "Sharding must stay on the outermost dim of a "
                                        "merged group, or the merged dims must become one dim.")
                return run_dim
            return out
    raise rc.fail(node, f"cannot map sharded dim {shard.dim} from {tuple(in_shape)} to {tuple(out_shape)}")


def _run_dim(node: Node, dim: int, gi: list[int], gj: list[int], num_ranks: int) -> int | None:
    """Input dim ``dim``, split evenly, merged behind other dims (``gi``) into the output dims ``gj``:
    the output dim holding its outermost factor, where the rank then holds its share of every run of
    that factor's elements (``autopar_every`` when the dim has more in front: a gated norm's
    ``gate.reshape(-1, head_dim)`` of [b, s, heads * head_dim] gives [b * s * heads, head_dim], runs
    of ``heads``); None where the factor does not lie within one output dim, or the ranks do not split
    it evenly."""
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    trailing = math.prod((size_expr(in_shape[d]) for d in gi if d >= dim), start=sympy.Integer(1))
    inner = sympy.Integer(1)
    for j in reversed(gj):
        run = sympy.simplify(trailing / inner)
        prefix = sympy.simplify(size_expr(out_shape[j]) / run)
        if sympy.fraction(run)[1] == 1 and sympy.fraction(prefix)[1] == 1:
            if run.is_number and run % num_ranks:  # (a sequence's run is split evenly by the plan's checks)
                return None
            if prefix != 1:
                node.meta[EVERY_KEY] = run
            return j
        inner *= size_expr(out_shape[j])
    return None


def _rewrite_sizes(node: Node, arg_index: int, out_dim: int, rc: RuleContext, offset: int = 0) -> None:
    sizes = list(node.args[arg_index])
    sizes[out_dim - offset] = rc.local_size(node, sizes[out_dim - offset])
    args = list(node.args)
    args[arg_index] = sizes
    node.args = tuple(args)


def _token_shard(node: Node, rc: RuleContext) -> Shard:
    """On a data-sharded axis (cp) a reshape of this rank's tokens holds them in the dim that keeps
    the sequence length, merged with others or not: every op across that dim is refused
    elsewhere, so the local order of the merged elements never matters."""
    dim = rc.token_dim(node)
    if dim is None:
        raise rc.fail(node, f"a reshape to {shape_of(node)} loses the sequence dim")
    return Shard(dim)


def _on_shard(rule):
    """A rule that only moves a sharded dim, called as ``rule(node, shard, rc)`` with the input's
    ``Shard``; a replicated or partial input passes through as it is (the op keeps either)."""
    @functools.wraps(rule)
    def on_placements(node: Node, pls: list, rc: RuleContext):
        return rule(node, pls[0], rc) if isinstance(pls[0], Shard) else pls[0]
    return on_placements


@register(*SIZED_RESHAPE_OPS)
@_on_shard
def view_rule(node: Node, pl: Shard, rc: RuleContext):
    if rc.local_sizes:
        return _token_shard(node, rc)
    every = node.args[0].meta.get(EVERY_KEY)
    out = _stacked_dim(node, pl) if every is None else None
    if out is None:
        out = _mapped_dim(node, node.args[0], pl, rc) if every is None else _unmerged_dim(node, pl, every, rc)
        _viewed_blocks(node, pl, out, rc)
    _rewrite_sizes(node, 1, out, rc)
    return Shard(out)


def _viewed_blocks(node: Node, pl: Shard, out: int, rc: RuleContext) -> None:
    """A view of a tensor laid out by blocks (each block split over the axis, the rank's shares side by
    side) that keeps its sharded dim outermost in its group: the output is laid out by the same blocks,
    scaled by the ratio of the two dims' sizes (a column whose heads fall into groups, ``[b, s, F]``
    viewed as ``[b, s, heads, head_dim]``: blocks of ``F / head_dim`` heads; merged back, blocks of
    features).  Splitting the dim must leave every block whole units of the new dim, the rank's share
    of each too, or the local elements would not be its share of the blocks: refused.  A value the TP
    pass marked itself (a fused projection's chain) keeps its layout."""
    src = node.args[0]
    blocks = src.meta.get(BLOCKS_KEY)
    if not blocks or node.meta.get(BLOCKS_KEY) or src.meta.get(WHOLE_KEY):
        return
    before, after = size_expr(shape_of(src)[pl.dim]), size_expr(shape_of(node)[out])
    ratio = sympy.simplify(after / before)
    scaled = [sympy.simplify(b * ratio) for b in blocks]
    if not all(b.is_Integer and b > 0 and b % rc.size == 0 for b in scaled) or sum(scaled) != after:
        raise rc.fail(node, f"views a dim laid out by blocks {tuple(blocks)} (each split over the axis) as "
                            f"{tuple(shape_of(node))}, which cuts a block or this rank's share of one",
                      "Each block's share must be whole units of the new dim; report the model.")
    node.meta[BLOCKS_KEY] = tuple(int(b) for b in scaled)


def _stacked_dim(node: Node, pl: Shard) -> int | None:
    """A dim laid out by equal blocks (a fused projection's parts, each split over the axis) viewed as
    ``(number of blocks, block)``: the rank holds its share of every block, so the block dim is an
    even shard (Moshi's ``fc1(x).view(b, s, 2, -1)``); None for any other view."""
    blocks = node.args[0].meta.get(BLOCKS_KEY)
    if not blocks or len(set(blocks)) != 1 or node.args[0].meta.get(WHOLE_KEY):
        return None
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    d = pl.dim
    if len(out_shape) == len(in_shape) + 1 and size_expr(out_shape[d]) == len(blocks) and \
            size_expr(out_shape[d + 1]) == blocks[0] and tuple(out_shape[:d]) == tuple(in_shape[:d]):
        node.meta.pop(BLOCKS_KEY, None)  # the TP pass marks the projection's whole chain; here it ends
        return d + 1
    return None


def _unmerged_dim(node: Node, pl: Shard, inner, rc: RuleContext) -> int:
    """A view of a dim that holds the rank's share of every run of ``inner`` elements (a dim merged
    behind others, ``passes/block_layout.py``), with any whole dims behind it: kept whole, the layout
    stays; split back so that the dims from one on multiply to the run (``inner`` times the whole
    dims), that dim is an even shard again; anything else is refused."""
    in_shape, out_shape = shape_of(node.args[0]), shape_of(node)
    for gi, gj in dim_groups(in_shape, out_shape):
        dims = [d for d in gi if size_expr(in_shape[d]) != 1]
        if pl.dim not in gi or dims[0] != pl.dim:
            continue
        # whole dims merged behind the runs (a gated norm's [b*s*heads, head_dim] viewed back as
        # [b, s, heads*head_dim]) lengthen each run: the rank holds its share of runs of them all
        run = inner * math.prod((size_expr(in_shape[d]) for d in dims[1:]), start=sympy.Integer(1))
        if len(gj) == 1:
            node.meta[EVERY_KEY] = run
            return gj[0]
        for j in gj:
            if math.prod((size_expr(out_shape[k]) for k in gj if k >= j), start=sympy.Integer(1)) == run:
                return j
    raise rc.fail(node, f"reshapes dim {pl.dim}, which holds this rank's share of every {inner} elements (heads "
                        f"merged behind other dims), to {tuple(out_shape)} other than back to those dims")


@register(aten.flatten.using_ints, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
          aten.squeeze.default)
def reshape_like_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if not isinstance(pl, Shard):
        return pl
    if rc.local_sizes:
        return _token_shard(node, rc)
    return Shard(_mapped_dim(node, node.args[0], pl, rc))


@register(aten.reshape_as.default, aten.view_as.default)
def reshape_as_rule(node: Node, pls: list, rc: RuleContext):
    """``x.reshape_as(other)``: the sizes come from ``other`` at run time, so nothing is rewritten;
    the output's placement is the view's (``x`` to ``other``'s shape), and it must be ``other``'s,
    or the local ``other`` would not have the local sizes that view needs."""
    pl, other = pls[0], pls[1] if len(pls) > 1 else R
    if not isinstance(pl, Shard):
        if isinstance(other, Shard):
            raise rc.fail(node, f"reshapes a {pl} tensor like one placed {other}")
        return pl
    out = _token_shard(node, rc) if rc.local_sizes else Shard(_mapped_dim(node, node.args[0], pl, rc))
    if other != out:
        raise rc.fail(node, f"reshapes a tensor placed {pl} to {out}, like one placed {other}")
    return out


@register(aten.repeat_interleave.self_int)
@_on_shard
def repeat_interleave_rule(node: Node, pl: Shard, rc: RuleContext):
    """``x.repeat_interleave(r, dim)``: each element repeated ``r`` times in place along ``dim``
    (interleaved rotary tables: ``cos.repeat_interleave(2, dim=-1)``).  A shard on another dim
    stays, and the op is linear, so a partial sum passes too.  Along the sharded dim of an even
    shard each rank's elements repeated in place are its even shard of the result (a mixer's key
    heads repeated to its value heads: ``q.repeat_interleave(nv // nk, dim=2)``); on a data axis the
    repeated tokens would no longer be one per position, and a tensor laid out by blocks would not
    stay even, so those are refused."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        raise rc.fail(node, "repeat_interleave without a dim flattens a sharded tensor")
    if canonical_dim(dim, ndim_of(node.args[0])) == pl.dim and (
            rc.local_sizes or not isinstance(node.args[1], int) or node.args[0].meta.get("autopar_blocks")):
        raise rc.fail(node, f"repeats the elements of the sharded dim {pl.dim}")
    return pl


@register(aten.unflatten.int)
@_on_shard
def unflatten_rule(node: Node, pl: Shard, rc: RuleContext):
    if rc.local_sizes:
        return _token_shard(node, rc)
    out = _mapped_dim(node, node.args[0], pl, rc)
    dim = node.args[1] % ndim_of(node.args[0])
    if dim <= out < dim + len(node.args[2]):
        _rewrite_sizes(node, 2, out, rc, offset=dim)
    return Shard(out)


@register(aten.expand.default, aten.broadcast_to.default)
def expand_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, Replicate) and rc.local_sizes:
        # broadcast along this rank's tokens (a mask expanded to the batch): the same values at
        # every token, so exactly this rank's part of the global expand
        dim = rc.token_dim(node)
        return pl if dim is None else Shard(dim)
    if not isinstance(pl, Shard):
        return pl
    out = pl.dim + ndim_of(node) - ndim_of(node.args[0])
    if node.args[1][out] != -1:
        _rewrite_sizes(node, 1, out, rc)
    return Shard(out)


@register(aten.expand_as.default)
def expand_as_rule(node: Node, pls: list, rc: RuleContext):
    """``x.expand_as(other)``: the sizes come from ``other`` at run time, so the output is placed
    like ``other``.  A sharded ``x`` must be sharded on the same (right-aligned) dim; a replicated
    ``x`` broadcasts along a size-1 dim, and is sliced to this rank's part where it has the full
    size (no communication)."""
    pl, other = pls[0], pls[1] if len(pls) > 1 else R
    if not isinstance(other, Shard):
        if isinstance(pl, Shard):
            raise rc.fail(node, f"expands a tensor placed {pl} like one placed {other}")
        return pl  # replicated, or a partial sum (expanding is linear)
    d = other.dim - (ndim_of(node) - ndim_of(node.args[0]))
    if isinstance(pl, Shard):
        if pl.dim != d:
            raise rc.fail(node, f"expands a tensor placed {pl} like one placed {other}")
    elif isinstance(pl, Replicate):
        if rc.local_sizes:
            return other
        if d >= 0 and size_expr(shape_of(node.args[0])[d]) != 1:
            rc.shard_operand(node, node.args[0], d)
    else:
        raise rc.fail(node, f"expands a tensor placed {pl} like one placed {other}")
    return other


@register(aten.view_as_complex.default, aten.view_as_real.default)
@_on_shard
def complex_view_rule(node: Node, pl: Shard, rc: RuleContext):
    """Pairs of the last dim read as one complex number, or back: every other dim is kept, so a
    shard on one of them stays; the pairs' own dim is never split."""
    last = ndim_of(node.args[0]) - 1
    if node.target is aten.view_as_complex.default and pl.dim % (last + 1) == last:
        raise rc.fail(node, "reads pairs of the sharded last dim as complex numbers")
    return pl


@register(aten.transpose.int)
@_on_shard
def transpose_rule(node: Node, pl: Shard, rc: RuleContext):
    nd = ndim_of(node)
    d0, d1 = node.args[1] % nd, node.args[2] % nd
    return Shard(d1 if pl.dim == d0 else d0 if pl.dim == d1 else pl.dim)


@register(aten.t.default, aten.numpy_T.default)
def t_rule(node: Node, pls: list, rc: RuleContext):
    """``t`` (at most 2-D) and ``numpy_T`` (``x.T``: every dim reversed)."""
    pl = pls[0]
    if isinstance(pl, Shard) and ndim_of(node) >= 2:
        return Shard(ndim_of(node) - 1 - pl.dim)
    return pl


@register(aten.permute.default)
@_on_shard
def permute_rule(node: Node, pl: Shard, rc: RuleContext):
    dims = [d % ndim_of(node) for d in node.args[1]]
    return Shard(dims.index(pl.dim))


def block_edges(node: Node, blocks, rc: RuleContext) -> tuple[list, list, tuple]:
    """Global and local offsets of a fused projection's blocks, which are whole on every rank (a KV head)."""
    whole = node.args[0].meta.get("autopar_whole") or (False,) * len(blocks)
    local = [b if w else rc.local_size(node, b) for b, w in zip(blocks, whole)]
    return ([sum(blocks[:i]) for i in range(len(blocks) + 1)], [sum(local[:i]) for i in range(len(local) + 1)],
            tuple(whole))


def _size_of(a):
    """A slice bound as a sympy expression (an int or a size node's value), or None."""
    val = a.meta.get("val") if isinstance(a, Node) else a
    return size_expr(val) if isinstance(val, (int, torch.SymInt)) else None


@register(aten.slice.Tensor)
@_on_shard
def slice_rule(node: Node, pl: Shard, rc: RuleContext):
    nd = ndim_of(node)
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if dim != pl.dim:
        return pl
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    size = size_expr(shape_of(node.args[0])[dim])
    full_end = end is None or (isinstance(end, int) and end >= _INT_MAX) or _size_of(end) == size
    # x[:, -s:] of s positions (a router's last s tokens) keeps them all too: each rank slices its own
    # s (a size read from its tensors) or a larger global size, which Python's slicing clamps
    if (start in (0, None) or _size_of(start) == -size) and full_end and step == 1:
        return pl
    blocks = node.args[0].meta.get("autopar_blocks")
    if blocks and step == 1:  # one part of a fused projection sharded block by block (Phi-3's qkv)
        edges, local, whole = block_edges(node, blocks, rc)
        lo = start or 0
        hi = edges[-1] if full_end else end
        if lo in edges and hi in edges and edges.index(hi) == edges.index(lo) + 1:
            args = list(node.args) + [None] * (4 - len(node.args))
            args[2], args[3] = local[edges.index(lo)], local[edges.index(hi)]
            node.args = tuple(args[:4]) + tuple(node.args[4:])
            return R if whole[edges.index(lo)] else pl
    raise rc.fail(node, f"slices the sharded dim {dim}",
                  "Slicing along a sharded dim is only supported when it keeps the whole dim, or takes one "
                  "whole part of a fused projection that the TP pass sharded part by part.")


@register(aten.select.int)
@_on_shard
def select_rule(node: Node, pl: Shard, rc: RuleContext):
    dim = node.args[1] % ndim_of(node.args[0])
    if dim == pl.dim:
        raise rc.fail(node, f"selects along the sharded dim {dim}")
    return Shard(pl.dim - (1 if dim < pl.dim else 0))


@register(aten.index.Tensor)
def index_rule(node: Node, pls: list, rc: RuleContext):
    """``x[..., idx, ...]`` with replicated integer indices on dims other than the sharded one:
    the sharded dim moves where advanced indexing puts it.  A gather is linear, so a partial
    sum stays partial."""
    pl, index_pls = pls[0], pls[1:]
    indices = list(node.args[1])
    at = [i for i, idx in enumerate(indices) if idx is not None]
    sharded = [p for p in index_pls if isinstance(p, Shard)]
    if isinstance(pl, Replicate) and len(sharded) == 1 and len(at) == 1 and \
            all(isinstance(p, (Shard, Replicate)) for p in index_pls) and \
            indices[at[0]].meta["val"].dtype not in (torch.bool, torch.uint8):
        # a replicated table read at sharded indices (positions' rows of a rotary table): the
        # result holds the index's dims where the indexed dim was, sharded as the index is
        return Shard(at[0] + sharded[0].dim)
    if any(not isinstance(p, Replicate) for p in index_pls):
        raise rc.fail(node, f"indexes with index tensors placed {index_pls}",
                      "Only replicated index tensors (constants, or computed from replicated values) are supported.")
    if not isinstance(pl, Shard):
        return pl
    masked = _masked_dim(node, indices, at, pl, rc)
    if masked is not None:
        return Shard(masked)
    if pl.dim in at:
        raise rc.fail(node, f"indexes along the sharded dim {pl.dim}")
    num_index_dims = max(len(shape_of(indices[i])) for i in at)
    if at != list(range(at[0], at[-1] + 1)):  # separated advanced indices: their dims come first
        return Shard(num_index_dims + sum(1 for d in range(pl.dim) if d not in at))
    if pl.dim < at[0]:
        return pl
    return Shard(pl.dim - len(at) + num_index_dims)


def _is_mask(index) -> bool:
    return index is not None and index.meta["val"].dtype in (torch.bool, torch.uint8)


def _masked_dim(node: Node, indices: list, at: list[int], pl: Shard, rc: RuleContext) -> int | None:
    """Where a boolean mask (replicated: every rank picks the same elements) puts sharded dim
    ``pl.dim``: the mask's dims become one dim of the picked elements, the others stay whole (XMOD's
    ``h[lang_ids == i]`` picks rows of the batch from a tensor sharded on the sequence).  None
    without a mask; refused where the mask covers the sharded dim, or comes with other indices."""
    if not any(_is_mask(indices[i]) for i in at):
        return None
    mask_ndim = len(shape_of(indices[at[0]]))
    if len(at) != 1 or at[0] <= pl.dim < at[0] + max(1, mask_ndim):
        raise rc.fail(node, f"indexes a tensor sharded on dim {pl.dim} with a boolean mask over that dim "
                            "(or beside other indices)")
    return pl.dim if pl.dim < at[0] else pl.dim - mask_ndim + 1


@register(aten.index_put.default, aten.index_put_.default)
def index_put_rule(node: Node, pls: list, rc: RuleContext):
    """``x[mask] = v`` with a replicated boolean mask over dims ``x`` is not sharded on: every rank
    writes the same elements of its shard of ``x``, which ``v`` must hold sharded where the indexing
    puts ``x``'s sharded dim (XMOD's ``out[lang_ids == i] = adapter(h[lang_ids == i])``).  A
    replicated ``x`` takes replicated values.  Refused otherwise (integer indices into a shard, a
    partial sum, a sharded index)."""
    dest, value = pls[0], pls[-1]
    indices = list(node.args[1])
    at = [i for i, idx in enumerate(indices) if idx is not None]
    index_pls = pls[1:-1]
    if any(not isinstance(p, Replicate) for p in index_pls) or not isinstance(dest, (Shard, Replicate)):
        raise rc.fail(node, f"writes into a {dest} tensor at indices placed {index_pls}")
    if isinstance(dest, Replicate):
        if not isinstance(value, Replicate):
            raise rc.fail(node, f"writes {value} values into a replicated tensor")
        return dest
    masked = _masked_dim(node, indices, at, dest, rc)
    if masked is None:
        raise rc.fail(node, f"writes at integer indices into a tensor sharded on dim {dest.dim}",
                      "Only writes by a boolean mask over other dims are supported; use a plan without "
                      "this dimension for this model, or report it.")
    # the values broadcast against x[mask], whose one mask dim replaces the mask's dims
    picked_ndim = ndim_of(node.args[0]) - len(shape_of(indices[at[0]])) + 1
    expected = Shard(masked + ndim_of(node.args[2]) - picked_ndim)
    if value != expected:
        raise rc.fail(node, f"writes values placed {value} into a tensor sharded on dim {dest.dim}; expected "
                            f"them {expected}")
    return dest


@register(aten.repeat.default)
def repeat_rule(node: Node, pls: list, rc: RuleContext):
    """``x.repeat(r0, r1, ...)``: tiles ``x`` ``r_d`` times along each dim (new leading dims for extra
    repeats).  A shard stays where its dim is repeated once.  Tiling the sharded dim puts ``r`` copies
    of the rank's part side by side: the rank's share of every copy.  A static dim (heads) is then laid
    out by blocks, one per copy (``autopar_blocks``: differential attention's value halves); a dim of
    tokens by runs of the input's size (Llama 4's tokens repeated per expert), like a dim merged behind
    others (``autopar_every``, ``passes/block_layout.py``), so only a view back to ``(r, size)`` makes
    it an even shard; a dim laid out by blocks already is refused.  On a data axis (cp) the copies are of the rank's own tokens,
    which is what a reshape there keeps.  Linear, so a partial sum stays partial."""
    pl = pls[0]
    if not isinstance(pl, Shard):
        return pl
    reps = list(node.args[1])
    out = pl.dim + len(reps) - ndim_of(node.args[0])
    if reps[out] == 1 or rc.local_sizes:  # on a data axis the graph reads the rank's own token counts
        return Shard(out)
    src = node.args[0]
    if src.meta.get(BLOCKS_KEY) or src.meta.get(WHOLE_KEY):
        raise rc.fail(node, f"tiles the sharded dim {pl.dim} {reps[out]} times, which is laid out by blocks")
    # each rank's part tiled is its share of every copy, side by side: a static dim (heads: differential
    # attention's value halves repeated, ``v.repeat(1, 2, 1, 1)``) is laid out by blocks, one per copy;
    # a dim of tokens (Llama 4's tokens repeated per expert) by runs of the input's size
    size, run = shape_of(src)[pl.dim], src.meta.get(EVERY_KEY)
    if run is None and isinstance(size, int):
        node.meta[BLOCKS_KEY] = (size,) * reps[out]
    else:
        node.meta[EVERY_KEY] = run if run is not None else size_expr(size)
    return Shard(out)


@register(aten.index_select.default)
def index_select_rule(node: Node, pls: list, rc: RuleContext):
    """``x.index_select(dim, idx)``: row ``i`` along ``dim`` is ``x``'s row ``idx[i]``.  Replicated ``x``
    read at sharded indices (a sinusoidal table at this rank's positions) is sharded on ``dim``; indices
    replicated keep ``x``'s placement off ``dim`` (a gather is linear: a partial sum stays partial)."""
    pl, idx = pls
    dim = node.args[1] % ndim_of(node.args[0])
    if isinstance(idx, Shard) and isinstance(pl, Replicate):
        return Shard(dim)
    if isinstance(idx, Replicate) and not (isinstance(pl, Shard) and pl.dim == dim):
        return pl
    raise rc.fail(node, f"selects rows of a tensor placed {pl} at indices placed {idx} along dim {dim}")


@register(aten.copy_.default)
def copy_rule(node: Node, pls: list, rc: RuleContext):
    """``dst.copy_(src)`` (DeepSeek's keys written into two slices of an empty tensor): exact when
    ``src`` is placed like ``dst`` after broadcasting; ``dst`` keeps its placement.  Two more
    cases are exact: a replicated ``src`` written into a sharded ``dst`` (each rank writes its
    slice of it), and a sharded ``src`` written into slices of a fresh fill that nothing read
    yet: the fill is then sharded like ``src`` (:func:`_shard_fill`)."""
    dst, src = pls[0], pls[1]
    offset = ndim_of(node.args[0]) - ndim_of(node.args[1])
    if isinstance(src, Shard):
        src = Shard(src.dim + offset)
        if isinstance(dst, Replicate) and not rc.local_sizes and _shard_fill(node, node.args[0], src.dim, rc):
            return src
    if src == dst or (isinstance(dst, Replicate) and isinstance(src, Replicate)):
        return dst
    if isinstance(dst, Shard) and isinstance(src, Replicate) and not rc.local_sizes:
        d = dst.dim - offset
        if d >= 0 and size_expr(shape_of(node.args[1])[d]) != 1:  # a size-1 dim broadcasts: no slice
            rc.shard_operand(node, node.args[1], d, f"this rank's slice of replicated {node.args[1].name}, "
                                                   f"copied into a tensor sharded on dim {dst.dim}")
        return dst
    raise rc.fail(node, f"copies a value placed {pls[1]} into a tensor placed {dst}",
                  "An in-place copy must keep the destination's placement; build the tensor from its parts "
                  "(torch.cat) instead, or use a plan without this dimension.")


# fills whose size list is their argument 1 (``x.new_empty(size)``) or 0 (``torch.empty(size)``)
_FILL_SIZES = {aten.new_empty.default: 1, aten.new_zeros.default: 1, aten.empty.memory_format: 0,
               aten.zeros.default: 0}


def _shard_fill(node: Node, dst: Node, dim: int, rc: RuleContext) -> bool:
    """Place on ``Shard(dim)`` a constant fill that ``dst`` slices (through ``aten.slice`` on other
    dims only) when the first write into it, ``node``, brings a value sharded on ``dim`` and nothing
    else has used the fill yet: each rank then allocates and fills its shard.  Re-places the fill
    and the slices (their placements were decided before the write); False when the pattern differs."""
    chain, fill = [], dst
    while fill.op == "call_function" and fill.target == aten.slice.Tensor:
        if canonical_dim(fill.args[1], ndim_of(fill.args[0])) == dim:
            return False
        chain.append(fill)
        fill = fill.args[0]
    if fill.op != "call_function" or fill.target not in _FILL_SIZES or rc.placements is None:
        return False
    placed_users = {u for n in [fill, *chain] for u in n.users if u in rc.placements}
    if not placed_users <= set(chain):  # something read or viewed the fill before this write
        return False
    index = _FILL_SIZES[fill.target]
    sizes = list(fill.args[index])
    sizes[dim] = rc.local_size(fill, sizes[dim])
    args = list(fill.args)
    args[index] = sizes
    fill.args = tuple(args)
    for n in [fill, *chain]:
        rc.placements[n] = Shard(dim)
    return True
