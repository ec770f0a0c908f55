"""The sharding-rule registry: one table keyed by op, the context a rule works in, shared helpers.

A rule receives a node and the placements of its tensor inputs on one mesh axis, and
returns the placement of the node's output (a tuple for multi-output ops).  Rules that
change local sizes (views, expands, splits) rewrite the node's shape arguments to local
sizes through :class:`RuleContext`.  An op without a rule whose inputs are sharded is an
error that names the node, its module and its source line; an op whose inputs are all
replicated needs no rule.

Placements are PyTorch's own ``Replicate``, ``Shard(dim)`` and ``Partial`` from
``torch.distributed.tensor``.  The rules are written by family, each module registering into
this one table with :func:`register`:

- ``passes/pointwise_rules.py``: element-wise ops, partial values on a data-sharded axis
  (shares of a batch statistic), constant fills;
- ``passes/reduction_rules.py``: reductions, softmax, histograms, differences and cumulative
  sums along a dim, normalisation layers, the cross-entropy loss;
- ``passes/matmul_rules.py``: linear, addmm, mm, batched matmul, outer products, attention,
  a depthwise convolution, the embedding lookup;
- ``passes/view_rules.py``: views, reshapes, transposes, slices;
- ``passes/join_rules.py``: splits and concatenations (a tensor laid out by blocks:
  ``passes/block_layout.py``);
- ``passes/moe_rules.py``: MoE routing and the EP operators;
- ``passes/draw_rules.py``: random draws from the default generator (on dp also a token-order rule:
  a draw over the rank's rows, made for the whole batch by ``passes/random_draws.py``);
- ``passes/op_rules.py``: autopar's own operators (collectives, CP attention and positions,
  the vocabulary-parallel embedding and loss);
- ``passes/token_order_rules.py`` and ``token_order_rowwise.py`` (data axes only, asked first,
  :func:`register_token_order`): a rank's tokens regrouped in a rank-local order by an MoE
  block run as traced, their counts, and the way back (placements: ``passes/token_order.py``);
- here: the graph's plumbing (``sym_size``, ``getitem``).

``passes/shard_propagation.py``, the registry's one reader, imports every family, so a lookup
made through it sees them all; the op sets the families register are
:mod:`autopar.frontend.op_sets` and ``passes/op_sets.py``.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Callable

import sympy
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Node

from autopar.compat import sym_expr
from autopar.ops import collectives
from autopar.ops.whole_rows import local_blocks, local_runs
from autopar.errors import AutoparError, describe_node
from .context import provenance

aten = torch.ops.aten

__all__ = ["is_seq_size", "seq_size_dims", "RuleContext", "register", "lookup", "register_token_order", "lookup_token_order", "TokenOrder",
           "ShardingError", "is_sharded", "is_loss_share", "tensor_inputs", "axis_of", "shape_of", "ndim_of",
           "size_expr", "canonical_dim", "R", "P", "sym_size_rule", "getitem_rule"]

R = Replicate()
P = Partial()

_REGISTRY: dict[Any, Callable] = {}
# Data axes only (``RuleContext.local_sizes``): rules that follow this rank's tokens through a
# rank-local order (passes/token_order.py), asked before the op's rule in _REGISTRY.  Keyed by op,
# or by an op's qualified name for a library's custom op (``transformers::grouped_mm_fallback``).
_TOKEN_ORDER: dict[Any, Callable] = {}


class TokenOrder:
    """A data axis's placement of this rank's tokens in a rank-local order, or counted
    (passes/token_order.py): neither Shard nor Partial, and refused by every rule but its own."""


class ShardingError(AutoparError):
    pass


def _registrar(table: dict):
    def register_ops(*ops):
        def deco(fn):
            for op in ops:
                table[op] = fn
            return fn

        return deco

    return register_ops


register = _registrar(_REGISTRY)
register_token_order = _registrar(_TOKEN_ORDER)


def lookup(op) -> Callable | None:
    return _REGISTRY.get(op)


def lookup_token_order(op) -> Callable | None:
    rule = _TOKEN_ORDER.get(op)
    name = getattr(op, "name", None)  # an op overload's qualified name
    if rule is None and callable(name):
        rule = _TOKEN_ORDER.get(name())
    return rule


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
    return isinstance(p, (Shard, Partial, TokenOrder))


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
    # the placements found so far (set by ``propagate``): a rule that rewrites the sizes of nodes
    # before it places them anew there (KV-head replication's broadcast, passes/matmul_rules.py)
    placements: dict | None = None
    # global sizes the axis splits unevenly, padded to ceil(size / axis size) per rank: a vocabulary
    # tp does not divide (the parameters laid out with ``ParamShard.size``)
    uneven: frozenset = frozenset()
    # parameters laid out by blocks on the axis (``ParamShard.blocks``): name -> (blocks, whole)
    param_blocks: dict = dataclasses.field(default_factory=dict)

    def fail(self, node: Node, found: str, hint: str = "") -> ShardingError:
        return ShardingError(
            f"autopar: cannot shard {describe_node(node)} on mesh axis '{self.axis}': {found}. "
            + (hint or f"Try a plan without this dimension (e.g. drop {_PLAN_TOKENS.get(self.axis, self.axis)}) "
                       "for this model, or report the op.")
        )

    def shard_operand(self, node: Node, arg: Node, dim: int, why: str = "") -> Node:
        """Replace ``node``'s replicated input ``arg`` by this rank's slice along ``dim`` (``why``:
        the provenance's reason, by default a generic one)."""
        if self.local_sizes:  # the graph's sizes are local: a replicated operand this long is not a slice
            raise self.fail(node, f"replicated {arg.name} meets this rank's tokens along dim {dim}")
        run = self.operand_run(node, arg, dim)
        blocks, whole = (None, None) if run is not None else self.operand_blocks(node, arg, dim) or (None, None)
        call = ((local_runs, (arg, dim, run, self.axis)) if run is not None else
                (local_blocks, (arg, dim, list(blocks), self.axis, list(whole) if whole else None)) if blocks else
                (collectives.local_shard, (arg, dim, self.axis)))
        with self.gm.graph.inserting_before(node):
            part = self.gm.graph.call_function(*call)
        part.meta["val"] = arg.meta.get("val")
        part.meta["autopar_placement"] = {self.axis: Shard(dim)}
        if blocks:
            part.meta["autopar_blocks"] = blocks
            if whole:
                part.meta["autopar_whole"] = whole
        if run is not None:
            part.meta["autopar_every"] = run
        provenance(part, self.pass_name, self.axis,
                   why or f"take this rank's slice of replicated {arg.name} (no communication)")
        node.replace_input_with(arg, part)
        return part

    def operand_run(self, node: Node, arg: Node, dim: int) -> int | None:
        """The run (``autopar_every``: the rank holds its share of every run of that many elements) of
        the inputs of ``node`` sharded beside replicated ``arg``, which ``arg``'s slice must follow
        (:func:`~autopar.ops.whole_rows.local_runs`); None when none is laid out by runs; refused when
        they disagree, or the run is not a number that ``arg``'s dim repeats."""
        sharded = [a for a in tensor_inputs(node) if a is not arg and isinstance((self.placements or {}).get(a), Shard)]
        runs = {a.meta.get("autopar_every") for a in sharded}
        if runs <= {None}:
            return None
        (run,) = runs if len(runs) == 1 else (None,)
        size = size_expr(shape_of(arg)[dim])
        if run is None or not sympy.sympify(run).is_Integer or sympy.fraction(sympy.simplify(size / run))[1] != 1:
            raise self.fail(node, f"replicated {arg.name} meets inputs holding their share of runs {sorted(map(str, runs))} "
                                  f"along its dim {dim} of size {size}")
        return int(run)

    def operand_blocks(self, node: Node, arg: Node, dim: int) -> tuple | None:
        """``(blocks, whole)``: the blocks (``autopar_blocks``: parts each split over the axis, side by
        side; ``whole``, per block, kept whole on every rank, or None) of the inputs of ``node``
        sharded beside replicated ``arg``: ``arg``'s slice must be cut block by block too
        (:func:`~autopar.ops.whole_rows.local_blocks`).  None when no input is laid out by blocks;
        refused when the inputs disagree or ``arg``'s dim is not their concatenation."""
        sharded = [a for a in tensor_inputs(node) if a is not arg and isinstance((self.placements or {}).get(a), Shard)]
        found = {(tuple(a.meta["autopar_blocks"]), tuple(a.meta.get("autopar_whole") or ()) or None)
                 if a.meta.get("autopar_blocks") else None for a in sharded}
        if found <= {None} and all(a.meta.get("autopar_every") is None for a in sharded):
            return None
        (layout,) = found if len(found) == 1 else (None,)
        if layout is None or size_expr(shape_of(arg)[dim]) != sum(layout[0]):
            raise self.fail(node, f"replicated {arg.name} meets inputs sharded block by block {sorted(found, key=str)} "
                                  f"along its dim {dim}")
        return layout

    def token_dim(self, node: Node, val: Any = None) -> int | None:
        """Under ``local_sizes``: the dim of ``node``'s value whose size holds the sequence symbol
        (None without one); refused when several do or the symbol is split across dims."""
        val = node.meta.get("val") if val is None else val
        if not isinstance(val, torch.Tensor) or not self.token_symbols:
            return None
        dims = [d for d, s in enumerate(val.shape) if size_expr(s).free_symbols & self.token_symbols]
        if not dims:
            return None
        if len(dims) > 1:
            raise self.fail(node, f"its shape {tuple(val.shape)} holds the sequence length in dims {dims}: "
                                  "it relates positions to positions (scores or a mask over the sequence)",
                            f"{self.axis} needs attention through scaled_dot_product_attention and "
                            f"position-wise work elsewhere; use a plan without {self.axis} for this model.")
        size = size_expr(val.shape[dims[0]])
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
            if dim is None or p == Shard(dim) or (isinstance(p, TokenOrder) and getattr(p, "dim", None) == dim):
                continue  # this rank's tokens, in their order or a rank-local one (passes/token_order.py)
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
            if elem % self.size and elem in self.uneven:
                return -(-elem // self.size)
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


def size_expr(size: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression in the traced batch and sequence symbols."""
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


def canonical_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from the front (``-1`` of a 3-D tensor is 2); a 0-D tensor's stays."""
    return dim % ndim if ndim else dim


# --- the graph's plumbing: sizes and items of multi-output ops ------------------------

@register(aten.sym_size.int)
def sym_size_rule(node: Node, pls: list, rc: RuleContext):
    pl = pls[0]
    if isinstance(pl, Shard) and canonical_dim(node.args[1], ndim_of(node.args[0])) == pl.dim:
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


def is_seq_size(size, seq) -> bool:
    """``size`` is the sequence length ``seq`` at every length the program runs at.  A scan that
    pads the sequence to whole chunks of ``m`` and was traced at a multiple of ``m`` keeps the padded
    length, ``m * ceil(s / m)``: that is the length at every multiple of ``m``, and at any other
    length the chunking view of the traced program fails (it was traced without the padding)."""
    expr = size if isinstance(size, sympy.Basic) else size_expr(size)
    if expr == seq:
        return True
    if not isinstance(seq, sympy.Symbol) or seq not in expr.free_symbols:
        return False
    # torch's shape symbols use their own Mod (torch.utils._sympy.functions), not sympy.Mod
    moduli = [m.args[1] for m in expr.atoms(sympy.Mod, sympy.Function) if type(m).__name__ in ("Mod", "PythonMod")
              and len(m.args) == 2 and m.args[0] == seq and m.args[1].is_Integer]
    if not moduli:
        return False
    k, m = sympy.Symbol("k", integer=True, positive=True), math.lcm(*(int(x) for x in moduli))
    return sympy.simplify(expr.subs(seq, m * k) - m * k) == 0


def seq_size_dims(node, seq) -> list[int]:
    """The dims of ``node``'s value whose size is the sequence length ``seq`` (:func:`is_seq_size`)."""
    shape = tuple(getattr(node.meta.get("val"), "shape", ())) if hasattr(node, "meta") else ()
    return [d for d, size in enumerate(shape) if seq is not None and is_seq_size(size, seq)]
