"""Tensors laid out block by block on the tensor-parallel axis, and how the layout travels.

A value is laid out *by blocks* when its sharded dim is a concatenation of parts, each split over
the axis, and each rank holds its share of every part side by side: a fused projection's output
(q|k|v rows sharded part by part by ``passes/tensor_parallel.py``, which marks its chain), and a
concatenation of parts each sharded on the joined dim (a linear-attention mixer's
``cat((q, k, v), -1)`` before its depthwise convolution, :func:`cat_blocks`).  The layout is
``node.meta["autopar_blocks"]``: the parts' global sizes along the node's sharded dim.  A sharded
dim merged behind others by a view (a gated norm's ``x.reshape(-1, head_dim)`` of [b, s, heads,
head_dim] sharded on heads) is laid out alike, with runs of equal size: ``autopar_every``, the run's
size (heads x ...), the rank holding its share of each run; only the view back splits it
(``passes/view_rules.py``), and a replicated operand cannot meet it.

Three things read it, and nothing else may treat such a value as an even ``Shard``:

- a split or slice at exactly the parts (``passes/view_rules.py``) gives each part an even shard;
- a replicated operand that meets it (the convolution's weight) is cut block by block
  (:meth:`~passes.rules.RuleContext.operand_blocks`, :func:`autopar.ops.whole_rows.local_blocks`);
- :func:`carry_blocks`, asked by shard propagation after every rule, moves the layout to an op's
  output when the op keeps the sharded dim whole (element-wise ops, transposes, casts, a slice of
  another dim, a per-channel convolution: the output's sharded dim has the parts' total size), and
  refuses an op that meets a value laid out by blocks with one sharded evenly on the same sizes:
  their local elements do not correspond.
"""
from __future__ import annotations

import operator

from torch.distributed.tensor import Shard
from torch.fx import Node

from autopar.frontend.op_sets import SIZED_RESHAPE_OPS
from autopar.ops import collectives

from .rules import R, RuleContext, shape_of, size_expr, tensor_inputs

__all__ = ["BLOCKS_KEY", "WHOLE_KEY", "EVERY_KEY", "LAYOUT_KEYS", "cat_blocks", "carry_blocks"]

BLOCKS_KEY = "autopar_blocks"
WHOLE_KEY = "autopar_whole"  # per block: kept whole on every rank (KV-head replication)
# A dim merged from several with the sharded one not first (``x.reshape(-1, head_dim)`` of
# [b, s, heads, head_dim] sharded on heads): runs of this many elements, of each the rank's share.
EVERY_KEY = "autopar_every"
LAYOUT_KEYS = (BLOCKS_KEY, WHOLE_KEY, EVERY_KEY)  # what a value's layout is kept under
# Operators that move a tensor between ranks, which must see it evenly split.
_COLLECTIVES = {collectives.all_gather, collectives.gather_replicated, collectives.reduce_scatter}


def cat_blocks(node: Node, parts: list, dim: int, rc: RuleContext) -> Shard:
    """Parts each split over the axis, joined along their sharded dim: locally the rank's share of
    each part side by side, laid out by blocks (the parts' global sizes; a part laid out by blocks
    itself gives its own)."""
    blocks = []
    for arg in parts:
        size = shape_of(arg)[dim]
        if arg.meta.get(WHOLE_KEY) or not isinstance(size, int) or size in rc.uneven:
            raise rc.fail(node, f"concatenates {arg.name} (size {size} on the sharded dim {dim}), which is not "
                                "split evenly over the axis")
        rc.local_size(node, size)  # refused where the axis does not divide the part
        blocks.extend(arg.meta.get(BLOCKS_KEY) or (size,))
    node.meta[BLOCKS_KEY] = tuple(blocks)
    return Shard(dim)


def _layout(node: Node, rc: RuleContext):
    if node.op == "get_attr":  # a parameter: as the TP pass laid it out
        blocks = rc.param_blocks.get(node.target)
        return ("blocks", *blocks) if blocks else None
    if node.meta.get(BLOCKS_KEY):
        return "blocks", tuple(node.meta[BLOCKS_KEY]), tuple(node.meta.get(WHOLE_KEY) or ())
    if node.meta.get(EVERY_KEY) is not None:
        return "every", node.meta[EVERY_KEY]
    return None


def carry_blocks(node: Node, pls: list, pl, rc: RuleContext) -> None:
    """After ``node``'s rule placed it ``pl``: refuse inputs laid out differently (by other blocks, or by
    blocks beside one split evenly on the same size: a parameter too, as the TP pass laid it out), and
    a collective or a change of the sharded dim's size on a dim merged behind others; give ``node`` its
    inputs' layout when it is sharded on a dim of the same size.  (The TP pass marks a fused projection
    and its chain itself; views and the rules that set a layout place it themselves.)"""
    if rc.local_sizes or _layout(node, rc) is not None or node.target in SIZED_RESHAPE_OPS:
        return
    inputs = tensor_inputs(node)
    if node.target is operator.getitem and isinstance(node.args[0], Node) and isinstance(pls[0], tuple):
        # an item of an op with several outputs (top-k's values and indices): laid out as its inputs
        inputs = tensor_inputs(node.args[0])
        pls = [rc.placements.get(a, R) for a in inputs]
    placed = {a: p for a, p in zip(inputs, pls) if isinstance(p, Shard)}
    sizes = {a: size_expr(shape_of(a)[p.dim]) for a, p in placed.items()}
    layouts = {(_layout(a, rc), sizes[a]) for a in placed if _layout(a, rc) is not None}
    if not layouts:
        return
    even = [a.name for a in placed if _layout(a, rc) is None and sizes[a] in {size for _, size in layouts}]
    ((layout, size), *more) = layouts
    if more or even:
        raise rc.fail(node, f"it joins values laid out differently ({sorted(map(str, layouts))}"
                            + (f", and {', '.join(even)} split evenly" if even else "") + ")",
                      "Parts of a fused or concatenated tensor must be split at their blocks before they meet "
                      "evenly split values; report the model.")
    same = isinstance(pl, Shard) and size_expr(shape_of(node)[pl.dim]) == size
    if layout[0] == "every" and not same and (isinstance(pl, Shard) or node.target in _COLLECTIVES):
        raise rc.fail(node, f"it changes a dim that holds this rank's share of every {layout[1]} elements (heads "
                            "merged behind other dims), which only a view back to those dims may do")
    if same:
        node.meta.update({BLOCKS_KEY: layout[1], **({WHOLE_KEY: layout[2]} if layout[2] else {})}
                         if layout[0] == "blocks" else {EVERY_KEY: layout[1]})
