"""Find the structure of a traced decoder: embedding, layers, attention, MLP, norms, head, loss.

Second stage of the pipeline.  Recognition goes by the ops and the dataflow, helped by
``node.meta['nn_module_stack']``, never by model or module names:

- an *attention region* is the innermost module that holds an attention op
  (``scaled_dot_product_attention``); a softmax between two matmuls (eager attention) gives
  the model's heads (frontend/attention_dims.py) while its projections form an MLP-shaped region;
- an *MLP region* is a module outside attention whose linears form two levels: linears
  fed from outside the module (column-parallel candidates) and a linear fed by them;
- in every region the first-level linears are *columns* and the linears that consume
  them and write back to the residual stream are *rows*; a module whose linears have no
  rows (BERT's ``attention.self``, ``intermediate``) widens to the modules enclosing it, up to
  the layer, until they do (``attention``, the layer); a module inside the region's that makes a
  region of its own, one of whose columns would be a row of the outer region, is left to its own
  (Zamba2's hybrid layer's ``linear`` and its Mamba mixer);
- an ``einsum`` of an activation with a ``[h, n, d]`` parameter is a linear (XLNet's projections to
  heads and back), named after its parameter in its module;
- heads that the attention module splits into equal groups again (differential attention's head
  pairs) are recorded per column (``LinearInfo.head_groups``), for the TP pass to lay out by them;
- a column whose output is split into several parts (``split``/``split_with_sizes``/
  ``chunk`` on the feature dimension) is a *fused* projection (QKV, gate/up);
- the *LM head* is the linear outside every region whose output width is the vocabulary.

Linear layers are ``aten.linear`` (weight ``[out, in]``), ``aten.addmm`` with a
``[in, out]`` weight (Conv1D style), or ``matmul(x, w.T)`` with a ``[out, in]`` weight and its
bias added after it; :class:`LinearInfo` records which (``bias_in_op``).

Neighbours: :mod:`autopar.frontend.trace` produces the graph; ``passes/tensor_parallel.py`` consumes
:class:`ModelStructure`; :mod:`autopar.frontend.model_dims` turns it into ``autopar.cost.ModelSpec``'s fields.
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import Any

import torch
from torch.fx import GraphModule, Node

from autopar.errors import AutoparError
from autopar.frontend.analyze_moe import find_moe
from autopar.frontend.attention_dims import attention_dims, eager_attention_dims
from autopar.frontend.fx_utils import fused_chain_dim, module_path, reshape_chain, value_users, within as _within
from autopar.frontend.loss import LossReduction, logits_loss, loss_reduction
from autopar.frontend.op_sets import ATTENTION_OPS, CAST_OPS, RESHAPE_OPS, SPLIT_OPS

aten = torch.ops.aten

__all__ = ["LinearInfo", "Region", "ModelStructure", "analyze", "module_path",
           "reshape_chain"]

_NORM_OPS = {aten.rsqrt.default, aten.layer_norm.default, aten.native_layer_norm.default, aten.rms_norm.default}


@dataclasses.dataclass
class LinearInfo:
    node: Node
    weight: str  # get_attr target (graph parameter name)
    bias: str | None
    in_out: bool  # True for Conv1D-style addmm with a [in, out] weight
    in_features: int
    out_features: int
    module: str
    split_sizes: list[int] | None = None  # fused projection: sizes of its parts
    # per part: kept whole on every tp rank, shared by all heads (a Mamba-2 mixer's B and C groups)
    whole_parts: tuple[bool, ...] | None = None
    # the heads it projects fall into this many equal groups that the attention module splits apart
    # again (differential attention's head pairs: ``chunk(heads, 2)``); tp splits each group
    head_groups: int = 1
    # an ``einsum`` with a parameter ``[h, n, d]`` (XLNet's ``ibh,hnd->ibnd`` projections to heads and
    # ``ibnd,hnd->ibh`` back): as a column its output features are the weight's dims after the first
    einsum: bool = False

    @property
    def bias_in_op(self) -> bool:
        """Is the bias an argument of the op (linear, addmm), not an add after it (``x @ w.T + b``)?"""
        return self.node.target in (aten.linear.default, aten.addmm.default)

    @property
    def input(self) -> Node:
        if self.einsum:
            return self.node.args[1][0]
        return self.node.args[1] if self.in_out else self.node.args[0]

    @property
    def out_dim(self) -> int:
        """The weight's dim of output features (split by a column): 0 for ``[out, in]``, 1 for ``[in, out]``
        and for an einsum's ``[h, n, d]`` (the heads ``n``)."""
        return 1 if self.in_out or self.einsum else 0

    @property
    def in_dim(self) -> int:
        """The weight's dim of input features (split by a row): 1 for ``[out, in]`` and for an einsum's
        ``[h, n, d]`` (the heads ``n``, contracted with ``d``), 0 for ``[in, out]``."""
        return 0 if self.in_out else 1


@dataclasses.dataclass
class Region:
    kind: str  # "attention" | "mlp"
    module: str
    columns: list[LinearInfo]
    rows: list[LinearInfo]
    attention: Node | None = None
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0


@dataclasses.dataclass
class ModelStructure:
    embeddings: list[Node]
    layers: list[str]
    regions: list[Region]
    norm_weights: list[str]
    lm_head: LinearInfo | None
    loss: Node | None
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    tied_embeddings: bool
    moe: list = dataclasses.field(default_factory=list)  # autopar.frontend.analyze_moe.MoEBlock per MoE layer
    norm_biases: bool = False  # the layers' norms are LayerNorms with a bias (GPT-2, OPT, Falcon)
    latent: dict = dataclasses.field(default_factory=dict)  # MLA's ModelSpec fields (_latent_dims)
    moe_error: AutoparError | None = None  # a top-k routing whose experts were not recognised
    # analyze_moe.DenseExperts per block whose experts all run on every token (Llama 4), run as traced
    dense_moe: list = dataclasses.field(default_factory=list)
    loss_reduction: LossReduction | None = None  # how the loss splits over tokens (frontend/loss.py)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return self.moe[0].num_experts if self.moe else 0

    def summary(self) -> str:
        lines = [
            f"layers={self.num_layers} hidden={self.hidden} heads={self.num_heads} "
            f"kv_heads={self.num_kv_heads} head_dim={self.head_dim} ffn={self.ffn} vocab={self.vocab} "
            f"tied={self.tied_embeddings}"
        ]
        for r in self.regions:
            cols = ", ".join(c.module + (f" (fused {c.split_sizes})" if c.split_sizes else "")
                             + (f" ({c.head_groups} head groups)" if c.head_groups > 1 else "") for c in r.columns)
            rows = ", ".join(c.module for c in r.rows)
            lines.append(f"  {r.kind:9s} {r.module}: columns [{cols}] rows [{rows}]")
        for b in self.moe:
            lines.append(f"  moe       {b.module}: {b.style} experts, E={b.num_experts}, top-{b.top_k}")
        if self.lm_head is not None:
            lines.append(f"  lm_head   {self.lm_head.module}")
        return "\n".join(lines)


def _attr(node: Any, casts: bool = False) -> str | None:
    """The parameter ``node`` is; with ``casts``, also through casts (a linear's weight cast to the
    compute dtype, ``CAST_OPS``: Ergo's ``F.linear(x.float(), self.weight.float())``; the TP pass
    shards the parameter by name and shard propagation places the cast like it)."""
    while casts and isinstance(node, Node) and node.op == "call_function" and node.target in CAST_OPS \
            and len(node.all_input_nodes) == 1:
        node = node.args[0]
    return node.target if isinstance(node, Node) and node.op == "get_attr" else None


def _linear_info(node: Node) -> LinearInfo | None:
    if node.target == aten.linear.default:
        weight = _attr(node.args[1], casts=True)
        if weight is None:
            return None
        bias = _attr(node.args[2], casts=True) if len(node.args) > 2 else None
        out_f, in_f = node.args[1].meta["val"].shape
        return LinearInfo(node, weight, bias, False, int(in_f), int(out_f), module_path(node))
    if node.target == aten.addmm.default:
        weight = _attr(node.args[2])
        if weight is None:
            return None
        in_f, out_f = node.args[2].meta["val"].shape
        return LinearInfo(node, weight, _attr(node.args[0]), True, int(in_f), int(out_f), module_path(node))
    if node.target == aten.matmul.default and isinstance(node.args[1], Node) and _transposed(node.args[1]):
        # ``x @ w.T`` with a [out, in] parameter (Falcon's FalconLinear); a bias is a later add
        weight = _attr(node.args[1].args[0])
        out_f, in_f = node.args[1].args[0].meta["val"].shape
        return LinearInfo(node, weight, _trailing_bias(node, int(out_f)), False, int(in_f), int(out_f),
                          module_path(node))
    if node.target == aten.einsum.default:
        return _einsum_info(node)
    return None


def _einsum_info(node: Node) -> LinearInfo | None:
    """An ``einsum`` of an activation with a 3-D parameter ``[h, n, d]`` that projects like a linear:
    a column ``...h,hnd->...nd`` (the last input letter contracted with the weight's first, its other
    letters appended: features to heads), or a row ``...nd,hnd->...h`` (the input's last letters
    contracted with the weight's last, its first appended: heads back to features).  XLNet's
    attention is written so.  Shard propagation places the einsum by its letters either way."""
    if len(node.args) != 2 or not isinstance(node.args[0], str) or len(node.args[1]) != 2:
        return None
    x, w = node.args[1]
    weight = _attr(w)
    lhs, _, out = node.args[0].replace(" ", "").partition("->")
    operands = lhs.split(",")
    if weight is None or not isinstance(x, Node) or "." in lhs or len(operands) != 2 or len(operands[1]) != 3:
        return None
    xs, ws = operands
    h, n, d = w.meta["val"].shape
    # named after its parameter inside the module that holds it, so the region is that module
    module = f"{module_path(node)}.{weight.rsplit('.', 1)[-1]}"
    if len(set(xs)) != len(xs) or len(set(ws)) != 3:
        return None
    if xs[-1] == ws[0] and ws[1] not in xs and ws[2] not in xs and out == xs[:-1] + ws[1:]:
        return LinearInfo(node, weight, None, False, int(h), int(n * d), module, einsum=True)
    if xs[-2:] == ws[1:] and ws[0] not in xs and out == xs[:-2] + ws[0]:
        return LinearInfo(node, weight, None, False, int(n * d), int(h), module, einsum=True)
    return None


def _transposed(node: Node) -> bool:
    """Is ``node`` a 2-D parameter transposed (``w.T``, ``w.t()``, ``w.permute(1, 0)``)?"""
    if node.op != "call_function" or not isinstance(node.args[0], Node) or _attr(node.args[0]) is None:
        return False
    if node.args[0].meta["val"].dim() != 2:
        return False
    return node.target in (aten.numpy_T.default, aten.t.default) or (
        node.target == aten.permute.default and [d % 2 for d in node.args[1]] == [1, 0]) or (
        node.target == aten.transpose.int and {d % 2 for d in node.args[1:3]} == {0, 1})


def _trailing_bias(node: Node, out_features: int) -> str | None:
    """The 1-D parameter added to ``node``'s output by its only user, if any."""
    users = list(node.users)
    if len(users) != 1 or users[0].target != aten.add.Tensor or users[0].args[0] is not node:
        return None
    bias = _attr(users[0].args[1])
    val = users[0].args[1].meta.get("val") if bias else None
    return bias if val is not None and tuple(val.shape) == (out_features,) else None


def _ancestors(node: Node, stop: set[Node]) -> set[Node]:
    """Nodes in ``stop`` reachable backwards from ``node`` (not through other ``stop`` nodes)."""
    found: set[Node] = set()
    seen: set[Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in stop:
            found.add(n)
            continue
        todo.extend(n.all_input_nodes)
    return found


def _split_sizes(linear: Node) -> list[int] | None:
    """Sizes of the parts if ``linear``'s output is split along its features (fused projection)."""
    stacked = _stacked_parts(linear) or _head_split_parts(linear)
    if stacked is not None:
        return stacked
    chain, dim = fused_chain_dim(linear)
    last = chain[-1]
    # Parts of the projection's own output only: slices of a per-head view (GPT-J's rotary part,
    # q[..., :rotary_dim]) cut every head alike and are not parts of the weight.
    if dim < 0 or last.meta["val"].shape[dim] != linear.meta["val"].shape[-1]:
        return None
    last, dim = _through_channels(last, dim)
    users = value_users(last)
    if users and all(u.target is aten.slice.Tensor for u in users):
        return _slice_sizes(last, dim, users)
    if len(users) != 1 or users[0].target not in SPLIT_OPS:
        return None
    return _split_parts(users[0], last, dim, int(linear.meta["val"].shape[-1]))


def _split_parts(split: Node, last: Node, dim: int, width: int) -> list[int] | None:
    """Sizes of the parts ``split`` cuts ``last``'s features (dim ``dim``, ``width`` of them) into."""
    ndim = last.meta["val"].dim()
    at = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    if at % ndim != dim:
        return None
    if split.target == aten.split_with_sizes.default:
        return [int(s) for s in split.args[1]]
    if split.target == aten.chunk.default:
        return [width // int(split.args[1])] * int(split.args[1])
    size = int(split.args[1])
    return [size] * (width // size)


def _inner_parts(linear: Node, sizes: list[int]) -> tuple[list[int], tuple[bool, ...] | None]:
    """A fused projection's parts, each split again after channel-wise ops (a Mamba-2 mixer's
    ``z | xBC | dt``, whose ``xBC`` is split into ``x | B | C`` after its depthwise convolution),
    refined into the inner parts; and per part whether it is shared by every head (read through a
    ``repeat_interleave`` over the heads: B and C per group), which the TP pass keeps whole on every
    rank.  Shard propagation checks the layout either way."""
    chain, dim = fused_chain_dim(linear)
    last, dim = _through_channels(chain[-1], dim)
    if len(value_users(last)) != 1 or value_users(last)[0].target not in SPLIT_OPS:
        return sizes, None  # parts cut by slices
    split = value_users(last)[0]
    items = {u.args[1]: u for u in split.users if u.target is operator.getitem}
    out, whole = [], []
    for i, size in enumerate(sizes):
        inner = None
        if i in items:
            end, inner_dim = _through_channels(items[i], dim)
            users = value_users(end)
            if len(users) == 1 and users[0].target in SPLIT_OPS:
                inner = _split_parts(users[0], end, inner_dim, size)
        if inner is None or sum(inner) != size or len(inner) < 2:
            out.append(size)
            whole.append(False)
            continue
        parts = {u.args[1]: u for u in users[0].users if u.target is operator.getitem}
        out.extend(inner)
        whole.extend(j in parts and _shared_by_heads(parts[j]) for j in range(len(inner)))
    return out, (tuple(whole) if any(whole) else None)


def _shared_by_heads(part: Node, depth: int = 8) -> bool:
    """``part`` reaches a ``repeat_interleave`` (a group's values repeated for each of its heads)
    through views and casts only."""
    node = part
    for _ in range(depth):
        users = value_users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node.target in (aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor):
            return True
        if node.target not in RESHAPE_OPS and node.target not in _CHANNEL_WISE and node.target not in _PIECES:
            return False
    return False


# Ops taking pieces of the tokens (a scan's ``tensor_split`` of the sequence) and their items.
_PIECES = frozenset({aten.tensor_split.indices, aten.tensor_split.sections, operator.getitem, *SPLIT_OPS})


# Ops that keep every feature of their input in its own channel: the parts of a fused projection
# pass through them whole (shard propagation carries the layout: passes/block_layout.py).
_CHANNEL_WISE = frozenset({aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default,
                           aten.tanh.default, aten._to_copy.default, aten.to.dtype, aten.contiguous.default,
                           aten.clone.default})


# Element-wise ops with a second operand (Falcon-H1's ``in_proj(x) * mup_vector``, a per-feature
# multiplier): the parts still pass through whole; the operand is cut at the parts by the rules.
_SCALED = frozenset({aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor})


def _through_channels(last: Node, dim: int) -> tuple[Node, int]:
    """From a fused projection's chain, the single-user ops that keep its features channel by channel
    (a linear-attention mixer's ``silu(conv1d(qkv.transpose(1, 2))[..., :seq]).transpose(1, 2)``
    before the split of q|k|v): the node before the split and its feature dim."""
    while len(value_users(last)) == 1:
        user = value_users(last)[0]
        ndim = user.meta["val"].dim() if isinstance(user.meta.get("val"), torch.Tensor) else 0
        if not ndim or user.args[0] is not last:
            break
        if user.target is aten.transpose.int:
            a, b = user.args[1] % ndim, user.args[2] % ndim
            dim = b if dim == a else a if dim == b else dim
        elif user.target is aten.slice.Tensor and user.args[1] % ndim == dim:
            break
        elif user.target is aten.conv1d.default:
            groups = user.args[6] if len(user.args) > 6 else user.kwargs.get("groups", 1)
            if dim != 1 or groups != last.meta["val"].shape[1]:  # depthwise over the features only
                break
        elif user.target not in _CHANNEL_WISE and user.target not in _SCALED and user.target is not aten.slice.Tensor:
            break
        last = user
    return last, dim


def _stacked_parts(linear: Node) -> list[int] | None:
    """Parts stacked by a view: the features viewed as ``(k, rest)`` in the last two dims and each of
    the ``k`` read by a ``select`` (Moshi's gating MLP: ``fc1(x).view(b, s, 2, -1)``, then
    ``[..., 0, :]`` and ``[..., 1, :]``): ``k`` parts of ``rest``."""
    view = reshape_chain(linear)[-1]
    features, shape = linear.meta["val"].shape[-1], tuple(view.meta["val"].shape)
    if view is linear or len(shape) != linear.meta["val"].dim() + 1 or not isinstance(shape[-2], int) \
            or shape[-2] * shape[-1] != features:
        return None
    k, picks = shape[-2], list(view.users)
    if not picks or any(u.target is not aten.select.int or u.args[1] % len(shape) != len(shape) - 2 for u in picks) \
            or {u.args[2] % k for u in picks} != set(range(k)):
        return None
    return [int(shape[-1])] * k


def _head_split_parts(linear: Node) -> list[int] | None:
    """Parts split by heads after a view: the features viewed as ``(heads, d)`` in the last two dims,
    then split along the heads (Ergo's ``qkv(x).view(b, s, -1, d).split((q, kv, kv), dim=-2)``, in
    counts of heads): parts of ``count * d`` features."""
    view = reshape_chain(linear)[-1]
    features, shape = linear.meta["val"].shape[-1], tuple(view.meta["val"].shape)
    if view is linear or len(shape) != linear.meta["val"].dim() + 1 or not isinstance(shape[-2], int) \
            or not isinstance(shape[-1], int) or shape[-2] * shape[-1] != features:
        return None
    users = value_users(view)
    if len(users) != 1 or users[0].target not in SPLIT_OPS:
        return None
    parts = _split_parts(users[0], view, len(shape) - 2, int(shape[-2]))
    return [int(p) * int(shape[-1]) for p in parts] if parts and sum(parts) == shape[-2] else None


def _slice_sizes(last: Node, feature_dim: int, slices: list[Node]) -> list[int] | None:
    """Sizes of the parts when ``slices`` cut the features (dim ``feature_dim``) of ``last`` into
    consecutive pieces that cover them exactly (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q + kv]``,
    ``qkv[..., q + kv:]``)."""
    val = last.meta["val"]
    ndim, width = val.dim(), int(val.shape[feature_dim])
    ranges = []
    for sl in slices:
        given = list(sl.args[1:5])
        dim, start, end, step = given + [0, 0, None, 1][len(given):]
        if not isinstance(dim, int) or dim % ndim != feature_dim or step != 1:
            return None
        start, end = start or 0, width if end is None else end
        if not isinstance(start, int) or not isinstance(end, int):
            return None
        ranges.append((start, min(end, width)))
    ranges.sort()
    edges = [0] + [end for _, end in ranges]
    if len(ranges) < 2 or any(start != edges[i] for i, (start, _) in enumerate(ranges)) or edges[-1] != width:
        return None
    return [end - start for start, end in ranges]


def normalised_whole(column: LinearInfo, depth: int = 6) -> bool:
    """Is ``column``'s whole output reduced over its last dim (an RMSNorm's mean of squares) a few
    elementwise ops after it, before any reshape into heads?  For the cost model's ``qk_norm``;
    whether the program is exact under tp is decided by shard propagation."""
    return _normalised_over(column, column.out_features, depth, views=False)


def normalised_per_head(column: LinearInfo, head_dim: int, depth: int = 6) -> bool:
    """Is ``column``'s output, reshaped into heads, RMS-normalised over the head dim (Qwen3's q/k
    norms)?  For the cost model's ``qk_head_norm`` (replicated norm weights of the head dim)."""
    return head_dim != column.out_features and _normalised_over(column, head_dim, depth, views=True)


def _normalised_over(column: LinearInfo, width: int, depth: int, views: bool) -> bool:
    """A mean over a last dim of ``width`` a few ops after ``column`` (through reshapes if ``views``)."""
    todo, seen = [(column.node, 0)], set()
    while todo:
        node, level = todo.pop()
        for user in node.users:
            if user in seen or level >= depth:
                continue
            seen.add(user)
            if user.target is aten.mean.dim:
                val = user.args[0].meta["val"]
                if int(val.shape[-1]) == width and [d % val.dim() for d in user.args[1]] == [val.dim() - 1]:
                    return True
            if views or user.target not in RESHAPE_OPS:
                todo.append((user, level + 1))
    return False


def _regions(gm: GraphModule, linears: dict[Node, LinearInfo], exclude: set[Node],
             layers: list[str] = ()) -> list[Region]:
    regions: list[Region] = []
    claimed: set[Node] = set()
    attention_ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    # (kind, module, attention op, the node whose call of the module the region is: a module called
    # several times, HRM's recurrent blocks, makes a region per call)
    groups: list[tuple[str, str, Node | None, Node]] = [("attention", module_path(op), op, op) for op in attention_ops]
    def in_layer(path: str) -> bool:
        return any(_within(path, l) for l in layers)

    def covers(scope: str, module: str) -> bool:  # a scope outside the layers covers no layer's linear
        return _within(module, scope) and (in_layer(scope) or not in_layer(module))

    for info in linears.values():
        parent = info.module.rsplit(".", 1)[0] if "." in info.module else ""
        if not any(covers(g[1], info.module) and _same_call(g[3], info.node, g[1]) for g in groups) and parent:
            if not any(g[1] == parent and _same_call(g[3], info.node, parent) for g in groups):
                groups.append(("mlp", parent, None, info.node))
    stop = set(linears)
    i = 0
    while i < len(groups):  # an inner module's region set aside below is grouped after the others
        kind, path, op, anchor = groups[i]
        i += 1
        # A region split over sibling modules (BERT's attention.self and attention.output,
        # intermediate and output) is the enclosing module's, never above the layer.
        for scope in _enclosing(path, layers):
            # A linear outside every layer (ELECTRA's and RoFormer's embedding projection, in the
            # module that also holds the layers) makes no region with the layers' linears, nor
            # with another linear on the far side of the layers (ELECTRA's generator head).
            if not in_layer(scope) and any(_within(l, scope) for l in layers):
                continue
            members = [n for n, i in linears.items() if covers(scope, i.module) and n not in claimed | exclude
                       and _same_call(anchor, n, scope)]
            for inner, nodes in _inner_regions(members, scope, linears, stop).items():
                members = [n for n in members if n not in nodes]
                if not any(g[1] == inner and _same_call(g[3], next(iter(nodes)), inner) for g in groups):
                    groups.append(("mlp", inner, None, next(iter(nodes))))
            member_set = set(members)
            columns = [n for n in members if not _ancestors(n, stop) & member_set]
            if len(members) >= 2 and len(columns) < len(members):
                break
        else:
            continue
        rows = [n for n in members if n not in columns]
        region = Region(kind, scope, [linears[n] for n in columns], [linears[n] for n in rows], op)
        for c in region.columns:
            c.split_sizes = _split_sizes(c.node)
            if c.split_sizes and not _stacked_parts(c.node):
                c.split_sizes, c.whole_parts = _inner_parts(c.node, c.split_sizes)
        if op is not None:
            region.num_heads, region.num_kv_heads, region.head_dim = attention_dims(op)
            _mark_head_groups(gm, region)
        claimed |= member_set
        regions.append(region)
    return regions


def _call_key(node: Node, scope: str) -> str | None:
    """The key of ``node``'s ``nn_module_stack`` entry for module ``scope``: torch.export suffixes it
    with ``@k`` for the module's ``k``-th call."""
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        if value[0] == scope:
            return key
    return None


def _same_call(a: Node, b: Node, scope: str) -> bool:
    """Do ``a`` and ``b`` run in the same call of module ``scope`` (or does either not record it)?"""
    ka, kb = _call_key(a, scope), _call_key(b, scope)
    return ka is None or kb is None or ka == kb


def _inner_regions(members: list[Node], scope: str, linears: dict[Node, LinearInfo],
                   stop: set[Node]) -> dict[str, set[Node]]:
    """The linears of ``members`` that belong to a module inside ``scope`` which makes a region of its
    own (a column and a row among its own linears), where one of that module's columns would be a row
    of ``scope``'s region (it reads another of ``members``): set aside, by module, for that module's
    region.  Zamba2's hybrid layer applies its own ``linear`` to the shared transformer's output and
    feeds its Mamba mixer; taken together, the mixer's ``in_proj`` would be a row of ``linear``."""
    member_set = set(members)
    by_module: dict[str, set[Node]] = {}
    for n in members:
        parent = linears[n].module.rsplit(".", 1)[0]
        if parent != scope and _within(parent, scope):
            by_module.setdefault(parent, set()).add(n)
    out = {}
    for module, nodes in by_module.items():
        own = [n for n in nodes if not _ancestors(n, stop) & nodes]
        if len(nodes) >= 2 and len(own) < len(nodes) and any(_ancestors(n, stop) & member_set for n in own):
            out[module] = nodes
    return out


def _head_groups(gm: GraphModule, region: Region) -> int:
    """The number of equal groups the heads of attention ``region`` are split into again inside its
    module (DiffLlama's differential attention: ``chunk(v, 2, dim=1)`` of the value heads and
    ``chunk(out, 2, dim=2)`` of the output heads, each query head paired with the head ``heads / 2``
    further on); 1 when none.  A candidate: a split into equal parts, in the region's module, of a
    value computed from its columns, along a dim that is not the last and has the size of the heads
    or the KV heads.  Only a proposal: shard propagation proves the layout or refuses it."""
    sizes = {region.num_heads, region.num_kv_heads} - {0, 1, region.head_dim}
    columns = {c.node for c in region.columns}
    found = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in SPLIT_OPS or not _within(module_path(node), region.module):
            continue
        val = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % val.dim()
        if dim == val.dim() - 1 or not isinstance(val.shape[dim], int) or val.shape[dim] not in sizes:
            continue  # heads are a static dim (a data-dependent split of routed rows is not)
        parts = [p.shape[dim] for p in node.meta["val"]]
        if all(isinstance(p, int) for p in parts) and len(set(parts)) == 1 and len(parts) > 1 \
                and _ancestors(node, columns):
            found.add(len(parts))
    return found.pop() if len(found) == 1 else 1


def _mark_head_groups(gm: GraphModule, region: Region) -> None:
    """Give the region's columns that project its heads (no fused parts) their :func:`_head_groups`."""
    groups = _head_groups(gm, region)
    if groups > 1:
        for c in region.columns:
            if not c.split_sizes and c.out_features % (groups * region.head_dim) == 0:
                c.head_groups = groups


def _enclosing(path: str, layers: list[str]) -> list[str]:
    """``path`` and the modules around it up to the decoder layer that holds it (only ``path``
    outside every layer)."""
    layer = next((l for l in layers if _within(path, l)), None)
    out = [path]
    while layer is not None and out[-1] != layer and "." in out[-1]:
        out.append(out[-1].rsplit(".", 1)[0])
    return out


def _layers(gm: GraphModule, experts: set[str] = frozenset()) -> list[str]:
    paths: dict[str, set[int]] = {}
    for n in gm.graph.nodes:
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            m = re.match(r"^(.*)\.(\d+)$", path)
            if m and path not in experts:
                paths.setdefault(m.group(1), set()).add(int(m.group(2)))
    if not paths:
        return []
    prefix, idx = max(paths.items(), key=lambda kv: len(kv[1]))
    return [f"{prefix}.{i}" for i in sorted(idx)]


def analyze(gm: GraphModule) -> ModelStructure:
    """Recognise the decoder structure of a traced training graph."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    linears = {n: info for n in nodes if (info := _linear_info(n)) is not None}
    embeddings = [n for n in nodes if n.target == aten.embedding.default and _attr(n.args[0])]
    vocab = int(embeddings[0].args[0].meta["val"].shape[0]) if embeddings else 0
    hidden = int(embeddings[0].args[0].meta["val"].shape[1]) if embeddings else 0
    # The LM head: the last linear from the hidden size to the vocabulary.
    lm_head = None
    for n, info in linears.items():
        if vocab and info.out_features == vocab and info.in_features == hidden:
            lm_head = info
    if lm_head is None and hidden:  # a head narrower than the table (Moshi's extra padding row): the
        for n, info in linears.items():  # linear from the hidden size whose logits the loss reads
            if info.in_features == hidden and logits_loss(n) is not None:
                lm_head = info
    if lm_head is None and vocab:  # a head from another width (RemBERT's decoupled output embedding)
        for n, info in linears.items():
            if info.out_features == vocab and logits_loss(n) is not None:
                lm_head = info
    moe, dense_moe, unsplit = find_moe(gm)
    moe_error = unsplit[0] if unsplit else None  # fatal only for plans that must rewrite those experts
    # Everything of a MoE block (router, experts, shared experts) runs on token shards, not TP-split.
    in_experts = {n for b in moe for n in b.region} | {n for b in moe + dense_moe for n in linears
                                                       if _within(module_path(n), b.module)}
    layers = _layers(gm, {e for b in moe for e in b.expert_modules})
    regions = _regions(gm, linears, ({lm_head.node} if lm_head else set()) | in_experts, layers)
    heads = [r for r in regions if r.kind == "attention"]
    norm_weights: list[str] = []
    norm_modules = {module_path(n) for n in nodes if n.target in _NORM_OPS}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and module_path(next(iter(n.users), n)) in norm_modules:
            if n.target not in norm_weights and n.meta["val"].dim() == 1:
                norm_weights.append(n.target)
    layer_norms = [n for n in nodes if n.target in _NORM_OPS and n.target != aten.rsqrt.default]
    norm_biases = bool(layer_norms) and all(
        n.target in (aten.layer_norm.default, aten.native_layer_norm.default) and len(n.args) > 3
        and _attr(n.args[3]) is not None for n in layer_norms)
    losses = [n for n in nodes if n.target == aten.cross_entropy_loss.default]
    mlps = [r for r in regions if r.kind == "mlp"]
    ffn = max((c.out_features // max(1, len(c.split_sizes or [1])) for r in mlps for c in r.columns), default=0)
    ffn = ffn or max((d.width for d in dense_moe), default=0)
    first = heads[0] if heads else None
    # Without an attention op, the heads of an eager core (a softmax between two matmuls)
    dims = (first.num_heads, first.num_kv_heads, first.head_dim) if first else eager_attention_dims(gm) or (0, 0, 0)
    return ModelStructure(
        embeddings=embeddings,
        layers=layers,
        regions=regions,
        norm_weights=norm_weights,
        lm_head=lm_head,
        loss=losses[-1] if losses else None,
        hidden=hidden or (first.columns[0].in_features if first else 0),
        vocab=vocab,
        num_heads=dims[0],
        num_kv_heads=dims[1],
        head_dim=dims[2],
        ffn=ffn,
        tied_embeddings=bool(lm_head and embeddings and lm_head.weight == embeddings[0].args[0].target),
        norm_biases=norm_biases,
        latent=_latent_dims(first) if first is not None else {},
        moe=moe,
        dense_moe=dense_moe,
        moe_error=moe_error,
        loss_reduction=loss_reduction(gm),
    )


def _latent_dims(region: Region) -> dict:
    """``ModelSpec``'s multi-head latent attention fields when projections of the region's own
    projections feed the attention op (DeepSeek's ``kv_b_proj`` of the ``kv_a_proj`` latent,
    ``q_b_proj`` of the ``q_a_proj`` latent); empty for attention whose rows follow it."""
    op = region.attention
    rows, linears = {r.node: r for r in region.rows}, {c.node for c in region.columns} | {r.node for r in region.rows}
    kv_up = [rows[n] for n in _ancestors(op.args[2], linears) if n in rows]
    if len(kv_up) != 1:
        return {}
    q_up = [rows[n] for n in _ancestors(op.args[0], linears) if n in rows]
    kv_down = [c for c in region.columns if c.node in _ancestors(kv_up[0].node, linears)]
    if len(kv_down) != 1 or len(q_up) > 1:
        return {}
    return {"kv_lora_rank": kv_up[0].in_features, "q_lora_rank": q_up[0].in_features if q_up else 0,
            "qk_rope_head_dim": kv_down[0].out_features - kv_up[0].in_features,
            "v_head_dim": int(op.args[2].meta["val"].shape[-1])}
