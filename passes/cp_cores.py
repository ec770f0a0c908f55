"""Context parallelism over eager attention and sequence mixers: the cores that mix positions run whole.

Eager attention (``softmax(q @ k.T * scale + mask) @ v`` in aten ops, with soft-capping, sinks, ALiBi
or a relative bias between) has values whose shape holds the sequence length twice: the scores
``[b, h, s, s]``, the mask, a position bias.  Each query row of them reads every key, which
another rank holds.  :mod:`passes.context_parallel` replaces ``scaled_dot_product_attention`` by
ring or all-gather attention; for these it runs the *core* as one device does:

- the core is every node whose value holds the sequence in two dims (*pairwise*), the nodes
  between them in the same module (a row maximum subtracted from the scores, a cast), and the
  nodes reading a pairwise value (the probabilities' product with ``v``).  A sequence mixer seeds
  a core the same way: a convolution along the sequence, and a value whose length is the
  sequence shifted, padded or rounded (``s - 1``, ``m * ceil(s / m)`` chunks, ``min(w, s)``
  blocks: a chunked scan's), with the nodes between seeds in the mixer's module;
- every tensor entering the core with the sequence in one dim (q, k, v; position ids, already this
  rank's global positions; a padding mask) is all-gathered over ``cp`` into global order
  (:func:`autopar.ops.cp_attention.cp_gather_sequence`, whose backward reduce-scatters); sizes in
  the core's arguments that are the local sequence length become the global one (``s * cp``);
- every value leaving the core keeps this rank's rows of the global result
  (:func:`~autopar.ops.cp_attention.cp_table_rows` at this rank's positions; backward: the
  gradient at those rows, summed over ranks by the gather's reduce-scatter).

Every core value is the one-device value, so the program is exact whatever the core computes; a
value leaving the core that does not hold the sequence in exactly one dim (a reduction over the
positions, the scores themselves), a size in the core that is not a sum, product, min, max or
floor division of the sequence length and constants, and a write in place across the core's edge
are refused, naming the node.  Gathers go before their first reader in the core and cuts before
the first reader outside, so writes in place on either side (keys copied into an empty tensor)
come first.  The cost: each rank computes the whole attention
(``cp`` times its FLOPs and its ``s x s`` scores); the rest of the model stays on sequence shards.
Models with ``scaled_dot_product_attention`` take the ring.

Called by :func:`passes.context_parallel.context_parallel_pass` after the position rewrites; shard
propagation then places the core replicated (:func:`core_placement`).
"""
from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr
from autopar.errors import AutoparError, describe_node
from autopar.frontend.fx_utils import module_path, within
from autopar.ops import cp_attention
from .context import META_KEY, COPIED_META, PassContext, provenance
from .rules import R, size_expr, tensor_inputs
from .shard_propagation import BY_RULES

aten = torch.ops.aten

__all__ = ["whole_cores", "core_placement"]

_PASS = "context_parallel_pass"
_DROPOUTS = (aten.dropout.default, aten.native_dropout.default)


def _seq_dims(node, seq) -> list[int]:
    """The dims of ``node``'s value that hold positions: a size a whole multiple of the sequence
    length (``s``; XLNet's ``2 s`` relative positions), not one padded to chunks or divided into them
    (a chunked scan's, which is a sequence mixer, not attention)."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return []
    dims = []
    for d, size in enumerate(val.shape):
        expr = size_expr(size)
        if seq in expr.free_symbols and (expr / seq).is_Rational:
            dims.append(d)
    return dims


def _offset(node, seq) -> bool:
    """``node``'s value has a dim whose size is the sequence length shifted, padded or rounded: ``s - 1``
    (a token shifted by one), ``s + k - 1`` (a convolution's padded output), ``m * ceil(s / m)`` and
    ``ceil(s / m)`` (a chunked scan's padded length and its chunks), ``min(w, s)`` (a block).  Sizes
    that also hold the batch (``b * s`` tokens flattened) are not."""
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return False
    for size in val.shape:
        expr = size_expr(size)
        if expr.free_symbols == {seq} and not (expr / seq).is_Rational:
            return True
    return False


def _convolves_positions(node: Node, seq) -> bool:
    """``node`` is a convolution along the sequence (a causal depthwise conv1d of a sequence
    mixer: each position reads its kernel's neighbours)."""
    if node.target is not aten.conv1d.default:
        return False
    val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    return isinstance(val, torch.Tensor) and size_expr(val.shape[-1]) == seq


def _feeds(node: Node, seeds: set[Node], depth: int = 64) -> bool:
    """A seed is reached from ``node`` within ``depth`` uses inside ``node``'s module."""
    scope, todo, seen = module_path(node), [(node, 0)], {node}
    while todo:
        current, level = todo.pop()
        for user in current.users:
            if user in seeds:
                return True
            if user not in seen and level + 1 < depth and within(module_path(user), scope):
                seen.add(user)
                todo.append((user, level + 1))
    return False


def _sizes_only(gm: GraphModule) -> set[Node]:
    """The tensors computed from sizes and parameters alone, the same on every rank at any length: a
    causal mask, its position ids, a relative position embedding projected by a weight (XLNet)."""
    out: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is aten.sym_size.int:
            continue
        if all(a in out or a.op == "get_attr" or (a.op == "call_function" and isinstance(a.meta.get("val"), torch.SymInt))
               for a in node.all_input_nodes):  # sizes: sym_size of any tensor, and arithmetic on them
            out.add(node)
    return out


def _reads_length(node: Node, seq, sized: set[Node], memo: dict | None = None) -> bool:
    """Size-only ``node`` depends on the sequence length: a size argument or an input's shape holds it."""
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = bool(_seq_dims(node, seq)) or any(
            (isinstance(a.meta.get("val"), torch.SymInt) and seq in size_expr(a.meta["val"]).free_symbols)
            or (a in sized and _reads_length(a, seq, sized, memo)) for a in node.all_input_nodes)
    return memo[node]


def _ancestors(nodes: set[Node], among: set[Node]) -> set[Node]:
    found, todo = set(), list(nodes)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in among and a not in found:
                found.add(a)
                todo.append(a)
    return found


def _find_cores(gm: GraphModule, seq) -> set[Node]:
    pairwise = {n for n in gm.graph.nodes if n.op == "call_function" and len(_seq_dims(n, seq)) >= 2}
    # a sequence mixer's: its convolution along the positions, a shift, its scan's chunks
    seeds = pairwise | {n for n in gm.graph.nodes if n.op == "call_function"
                        and (_convolves_positions(n, seq) or _offset(n, seq))}
    if not seeds:
        return set()
    # a mask built from the sizes is built again at the global length, with the positions it derives
    # (what does not depend on the length at all, a parameter's cast, is the same either way)
    sized = _sizes_only(gm)
    core = seeds | {n for n in _ancestors(seeds, sized) if _reads_length(n, seq, sized)}
    for node in gm.graph.nodes:  # graph order: a node's inputs are decided before it
        if node in core or node.op != "call_function":
            continue
        val = node.meta.get("val")
        if not isinstance(val, (torch.Tensor, tuple, list, torch.SymInt)):  # a tensor, several outputs, a size
            continue
        inputs = [a for a in node.all_input_nodes if a in core]
        # in the core: what feeds the core again (a row maximum), and what reads a core value that
        # cannot leave it (the probabilities' product with v; an item of an op of several outputs)
        if inputs and (any(len(_seq_dims(a, seq)) != 1 for a in inputs) or _feeds(node, seeds)):
            core.add(node)
    return core


def _refuse(node: Node, what: str) -> AutoparError:
    return AutoparError(f"autopar: context parallelism runs eager attention whole, but {describe_node(node)} "
                        f"{what}. Load the model with attn_implementation='sdpa' where it allows it, or use a "
                        "plan without cp.")


class _Rewriter:
    def __init__(self, gm: GraphModule, ctx: PassContext, core: set[Node]):
        self.gm, self.ctx, self.core, self.seq = gm, ctx, core, ctx.seq_symbol
        self.n = ctx.axis_sizes["cp"]
        self.gathered: dict[Node, Node] = {}
        self.sizes: dict[Node, Node] = {}
        self._local_len: Node | None = None
        self.global_len: Node | None = None

    @property
    def local_len(self) -> Node:
        """A ``sym_size`` node of the local sequence length (dim 1 of the first input), made once."""
        if self._local_len is None:
            first = next(p for p in self.gm.graph.nodes if p.op == "placeholder")
            with self.gm.graph.inserting_after(first):
                self._local_len = self.gm.graph.call_function(aten.sym_size.int, (first, 1))
            self._local_len.meta["val"] = first.meta["val"].shape[1]
        return self._local_len

    def gather(self, arg: Node, user: Node) -> Node:
        dims = _seq_dims(arg, self.seq)
        if len(dims) != 1 or size_expr(arg.meta["val"].shape[dims[0]]) != self.seq:
            raise _refuse(user, f"reads {arg.name} of shape {tuple(arg.meta['val'].shape)}, whose sequence is not "
                                "one whole dim")
        if arg not in self.gathered:
            # Before its first reader in the core, not after ``arg``: the model may still write into it
            # in place (DeepSeek's keys copied into an empty tensor).
            with self.gm.graph.inserting_before(user):
                node = self.gm.graph.call_function(cp_attention.cp_gather_sequence,
                                                   (arg, dims[0], "cp", f"cp whole core {arg.name}"))
            node.meta.update({k: arg.meta[k] for k in COPIED_META if k in arg.meta})
            provenance(node, _PASS, "cp", "the whole sequence, in global order, for eager attention run whole")
            itemsize = arg.meta["val"].element_size()
            numel = size_expr(arg.meta["val"].numel())
            node.meta[META_KEY].bytes = {"fwd": ("all_gather", (self.n - 1) * numel * itemsize),
                                         "bwd": ("reduce_scatter", (self.n - 1) * numel * itemsize)}
            self.gathered[arg] = node
        return self.gathered[arg]

    def size(self, arg: Node, user: Node) -> Node:
        """``arg``'s size expression at the global length: built again from the local length's node."""
        if arg not in self.sizes:
            expr = sym_expr(arg.meta["val"])
            with self.gm.graph.inserting_before(user):  # core nodes come in graph order: before every later user
                built = self._build(expr, user, arg)
            self.sizes[arg] = built
        return self.sizes[arg]

    def _build(self, expr, user: Node, arg: Node):
        """FX nodes computing sympy ``expr`` with the sequence symbol at ``s * cp`` (sums, products,
        min / max, floor division: a sparse indexer's ``min(top_k, s)``)."""
        if expr == self.seq:
            if self.global_len is None:
                self.global_len = self.gm.graph.call_function(operator.mul, (self.local_len, self.n))
                self.global_len.meta["val"] = self.local_len.meta["val"] * self.n
            return self.global_len
        if expr.is_Integer:
            return int(expr)
        name = type(expr).__name__
        fn = {"Add": operator.add, "Mul": operator.mul, "Min": torch.sym_min, "Max": torch.sym_max,
              "FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod}.get(name)
        if fn is None or (name in ("FloorDiv", "Mod", "PythonMod") and len(expr.args) != 2):
            raise _refuse(user, f"takes the size {expr} of the sequence ({arg.name}), which it cannot make global")
        args = [self._build(a, user, arg) for a in expr.args]
        out = args[0]
        for a in args[1:]:
            if isinstance(out, int) and isinstance(a, int):
                out = fn(out, a)
                continue
            val = fn(*(x.meta["val"] if isinstance(x, Node) else x for x in (out, a)))
            out = self.gm.graph.call_function(fn, (out, a))
            out.meta["val"] = val
        return out

    def argument(self, a, user: Node):
        if isinstance(a, (list, tuple)):
            return type(a)(self.argument(x, user) for x in a)
        if not isinstance(a, Node) or a in self.core:
            return a
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt) and self.seq in size_expr(val).free_symbols:
            return self.size(a, user)
        if isinstance(val, torch.Tensor) and _seq_dims(a, self.seq):
            return self.gather(a, user)
        return a

    def leave(self, node: Node) -> None:
        """This rank's rows of core value ``node`` for each of its users outside the core."""
        outside = [u for u in node.users if u not in self.core]
        if not outside:
            return
        dims = _seq_dims(node, self.seq)
        if isinstance(node.meta.get("val"), torch.SymInt):
            raise _refuse(node, f"gives {outside[0].name} a size computed at the global length, which it reads "
                                "at the local one")
        if len(dims) != 1:
            shape = getattr(node.meta.get("val"), "shape", None)
            raise _refuse(node, f"leaves the core with shape {tuple(shape) if shape is not None else '(several values)'}"
                                f" to {outside[0].name} (not the sequence in "
                                "exactly one dim: each rank would hold values of other ranks' tokens)")
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        with self.gm.graph.inserting_before(min(outside, key=order.__getitem__)):  # after any write in place
            rows = self.gm.graph.call_function(cp_attention.cp_table_rows, (node, dims[0], self.local_len, "cp"))
        rows.meta.update({k: node.meta[k] for k in COPIED_META if k in node.meta})
        provenance(rows, _PASS, "cp", "this rank's rows of eager attention run whole")
        for user in outside:
            user.replace_input_with(node, rows)


def _written(node: Node) -> list[Node]:
    """The arguments ``node`` writes in place (an aten op whose schema marks them written)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [a for a, arg in zip(node.args, schema.arguments)
            if isinstance(a, Node) and arg.alias_info is not None and arg.alias_info.is_write]


def _check_writes(gm: GraphModule, core: set[Node]) -> None:
    """A write in place across the core's edge would reach only one side's copy: refused."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for target in _written(node):
            if (node in core) != (target in core):
                raise _refuse(node, f"writes {target.name} in place across the edge of the attention run whole "
                                    "(one side would not see the write)")


def whole_cores(gm: GraphModule, ctx: PassContext) -> set[Node]:
    """Rewrite the graph's eager attention cores to run whole (module doc); returns the nodes shard
    propagation places replicated: the cores and the gathers into them."""
    core = _find_cores(gm, ctx.seq_symbol)
    if not core:
        return set()
    _check_writes(gm, core)
    rewriter = _Rewriter(gm, ctx, core)
    for node in [n for n in gm.graph.nodes if n in core]:
        if node.target in _DROPOUTS and (node.args[1] if len(node.args) > 1 else 0.0):
            raise _refuse(node, "applies dropout to attention, whose draws no rank can make as one device does")
        node.args = rewriter.argument(node.args, node)
        node.kwargs = {k: rewriter.argument(v, node) for k, v in node.kwargs.items()}
    for node in [n for n in gm.graph.nodes if n in core]:
        rewriter.leave(node)
    return core | set(rewriter.gathered.values())


def core_placement(whole: set[Node], rc):
    """Shard propagation's shortcut for :func:`whole_cores`' nodes: a gather of this rank's tokens,
    and core nodes of replicated inputs, are replicated (every rank holds the one-device value)."""
    def place(node: Node):
        if node not in whole:
            return BY_RULES
        pls = [rc.placements.get(a, R) for a in tensor_inputs(node)]
        if node.target is cp_attention.cp_gather_sequence:
            if pls[0] != Shard(node.args[1]):
                raise rc.fail(node, f"gathers the sequence of a value placed {pls[0]}")
            return R
        flat = [q for p in pls for q in (p if isinstance(p, (tuple, list)) else (p,))]  # items of an op's outputs
        wrong = [p for p in flat if not isinstance(p, Replicate)]
        if wrong:
            raise rc.fail(node, f"eager attention run whole reads inputs placed {wrong}, not replicated")
        return tuple(R for _ in node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else R
    return place
