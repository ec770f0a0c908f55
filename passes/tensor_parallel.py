"""Tensor parallelism (Megatron style) on the traced graph, axis ``tp``.

For every attention and MLP region found by :mod:`autopar.frontend.analyze`:

- column-parallel projections (q/k/v, gate/up, or the fused QKV / gate-up) keep their
  output features ``1/tp`` per rank; a fused projection is sharded part by part so each
  rank holds its heads of q, of k and of v;
- one ``region_entry`` (identity forward, all-reduce of the input gradient backward) is
  inserted on the region's input;
- row-parallel projections (o, down) keep ``1/tp`` of their input features; their output is
  a partial sum, reduced by an ``all_reduce`` inserted right after them (a bias is moved
  behind the reduction so it is added once).

Where tp does not divide the KV heads (fewer KV heads than tp, multi-query attention's one, or a
count tp does not divide: :func:`autopar.plan_space.kv_replicated`) the KV heads are replicated:
the column projections whose output reaches only the attention op's key and value operands
(found by dataflow) are not split, so every rank computes every KV head; the attention op's rule
(``passes/matmul_rules.py``) then gives this rank the copies of K and V its query heads read
(one KV head: the GQA broadcast makes only those; several: a ``local_shard`` of the broadcast,
no communication either way), and gradient placement finds the K/V weights' gradients partial
over tp, which the DP pass's buckets sum.

The embedding becomes vocabulary-parallel (masked local lookup + all-reduce), the LM head
column-parallel over the vocabulary, and a cross-entropy loss on those logits becomes
``vocab_parallel_cross_entropy`` (the full logits are never gathered).  A vocabulary tp does
not divide is padded (Megatron's padded vocabulary): the embedding and LM head (and its bias)
are laid out with ``ParamShard.size``, ceil(V/tp) rows per rank, the rows past V zero padding
that no id looks up; shard propagation then splits the V-sized dims unevenly
(``RuleContext.uneven``) and the cross-entropy's rule (``passes/op_rules.py``) gives it the
real vocabulary so it leaves the padding columns out of the softmax.  Local sizes in
views are rewritten later by ``passes/shard_propagation.py``; SP (``passes/sequence_parallel.py``)
turns the entry/reduction pairs into all-gather / reduce-scatter.
"""
from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import GraphModule, Node

from autopar.ops import collectives
from autopar.ops.whole_rows import sum_whole_rows
from autopar.frontend.analyze import LinearInfo, ModelStructure
from autopar.frontend.fx_utils import fused_chain, module_path, reshape_chain, within
from autopar.frontend.op_sets import CAST_OPS, RESHAPE_OPS
from autopar.frontend.loss import logits_loss
from autopar.errors import AutoparError, describe_node
from autopar.plan_space import divisors, heads_ok, kv_replicated, padded_vocab
from .context import META_KEY, ParamShard, PassContext, PassResult, provenance
from .gradient_placement import requires_grad_nodes
from .rules import seq_size_dims

aten = torch.ops.aten

__all__ = ["tensor_parallel_pass", "AXIS"]

AXIS = "tp"
_PASS = "tensor_parallel_pass"


def _check_divisible(what: str, value: int, tp: int, node: Node | None = None) -> None:
    if value % tp:
        valid = [d for d in range(1, value + 1) if value % d == 0]
        where = f" ({describe_node(node)})" if node is not None else ""
        raise AutoparError(f"autopar: tp={tp} does not divide the {what} ({value}){where}; "
                           f"valid tp values: {valid}.")


def _insert_after(gm: GraphModule, node: Node, fn, args: tuple, reason: str, role: str) -> Node:
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(fn, args)
    new.meta["val"] = node.meta.get("val")
    new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    new.meta["stack_trace"] = node.meta.get("stack_trace")
    provenance(new, _PASS, AXIS, reason, role=role)
    return new


def _redirect(node: Node, new: Node, only: set[Node] | None = None) -> None:
    for user in list(node.users):
        if user is not new and (only is None or user in only):
            user.replace_input_with(node, new)


def _shard_column(ctx: PassContext, result: PassResult, info: LinearInfo, vocab: int | None = None,
                  whole: tuple[bool, ...] | None = None) -> None:
    """``vocab``: the LM head, whose output features (the vocabulary) tp need not divide: the
    uneven shard is padded to ceil(V/tp) rows per rank (``ParamShard.size``).  ``whole``: per
    part of a fused projection, kept whole on every rank (:func:`_whole_blocks`)."""
    blocks = tuple(info.split_sizes) if info.split_sizes else _head_group_blocks(ctx, info)
    padded = vocab if vocab is not None and not blocks and info.out_features % ctx.axis_sizes[AXIS] else None
    if padded is None:
        for size, kept in zip(blocks or (info.out_features,), whole or (False,) * len(blocks or (0,))):
            if not kept:
                _check_divisible(f"output features of {info.module} ({'part ' if blocks else ''}size {size})",
                                 size, ctx.axis_sizes[AXIS], info.node)
    result.shard_param(info.weight, AXIS, ParamShard(info.out_dim, blocks, size=padded, whole=whole))
    if info.bias:
        result.shard_param(info.bias, AXIS, ParamShard(0, blocks, size=padded, whole=whole))
    if blocks and not info.split_sizes:  # head groups: the views into heads carry the blocks (view_rule)
        info.node.meta["autopar_blocks"] = blocks
    elif blocks:
        for node in fused_chain(info.node):
            if sum(blocks) not in tuple(node.meta["val"].shape):
                break  # viewed into heads (Ergo's qkv split by heads): view_rule scales the blocks
            node.meta["autopar_blocks"] = blocks
            if whole:
                node.meta["autopar_whole"] = whole


def _head_group_blocks(ctx: PassContext, info: LinearInfo) -> tuple[int, ...] | None:
    """A column whose heads fall into ``info.head_groups`` equal groups that its attention splits apart
    again (differential attention's head pairs): laid out by those groups, each split over tp, so every
    rank holds the same heads of every group (its head pairs whole).  Refused where tp does not split
    every group into whole heads."""
    if info.head_groups <= 1:
        return None
    tp, size = ctx.axis_sizes[AXIS], info.out_features // info.head_groups
    heads = size // (ctx.structure.head_dim or size)
    if kv_replicated(tp, ctx.structure.num_kv_heads):
        # the attention rule would cut the replicated K and V evenly, not by the groups
        raise AutoparError(
            f"autopar: tp={tp} does not divide the {ctx.structure.num_kv_heads} KV heads, and {info.module} "
            f"({describe_node(info.node)}) projects heads that its attention splits into {info.head_groups} groups "
            f"again (e.g. differential attention's head pairs); replicated KV heads are not supported with head "
            f"groups. Use {_kv_hint(ctx.structure.num_kv_heads)}.")
    if heads % tp:
        raise AutoparError(
            f"autopar: tp={tp} does not divide the {heads} heads of each of the {info.head_groups} head groups of "
            f"{info.module} ({describe_node(info.node)}), which its attention splits apart again (e.g. differential "
            f"attention's head pairs); every rank must hold whole heads of each group. Use a tp that divides "
            f"{heads}: {divisors(heads)}.")
    return (size,) * info.head_groups


def _shard_row(gm: GraphModule, ctx: PassContext, result: PassResult, info: LinearInfo, region: str,
               role: str = "row_output") -> Node:
    _check_divisible(f"input features of {info.module}", info.in_features, ctx.axis_sizes[AXIS], info.node)
    result.shard_param(info.weight, AXIS, ParamShard(info.in_dim))
    node = info.node
    bias = None
    # add the bias once, after the reduction (a bias added after ``x @ w.T`` already is)
    if info.bias and info.bias_in_op:
        if info.in_out:  # addmm(bias, x, w) -> mm(x, w)
            bias = node.args[0]
            node.target, node.args = aten.mm.default, (node.args[1], node.args[2])
        else:
            bias = node.args[2]
            node.args = node.args[:2]
    # Reduce after the reshapes that follow the projection (Conv1D's view back to
    # [batch, seq, hidden]), so SP can reduce-scatter along the sequence dim.
    last = reshape_chain(node)[-1]
    reduced = _insert_after(gm, last, collectives.all_reduce, (last, AXIS, f"{info.module}: row-parallel output"),
                            f"sum the partial outputs of row-parallel {info.module}", role)
    _redirect(last, reduced)
    out = reduced
    if bias is not None:  # the bias broadcasts over the leading dims of the reshaped output
        with gm.graph.inserting_after(reduced):
            out = gm.graph.call_function(aten.add.Tensor, (reduced, bias))
        out.meta["val"] = last.meta.get("val")
        provenance(out, _PASS, None, f"bias of {info.module}, added after the reduction")
        _redirect(reduced, out)
        out.args = (reduced, bias)
    if role == "row_inner":
        # Its result meets the rank's channels again (a partial gradient, summed by this entry's
        # backward); where gradient placement finds it replicated the entry is removed.
        entry = _insert_after(gm, out, collectives.region_entry, (out, AXIS, f"{info.module}: read by its region"),
                              f"sum the gradient of {info.module}'s output over the rank's channels", "reduction")
        _redirect(out, entry)
        out = entry
    return out


def _sum_whole_blocks(gm: GraphModule, result: PassResult, info: LinearInfo, whole: tuple[bool, ...]) -> None:
    """A fused projection whose KV blocks every rank keeps whole: their rows' gradient is a partial
    sum over tp (each rank's query heads' share), so the weight and the bias enter the projection
    through ``sum_whole_rows``, whose backward sums those rows alone (the query rows are the rank's)."""
    for name, dim in ((info.weight, info.out_dim), (info.bias, 0)):
        param = next((a for a in info.node.all_input_nodes if a.op == "get_attr" and a.target == name), None)
        if name is not None and param is None:  # e.g. ``x @ w.T``: the weight reaches the op through a view
            raise AutoparError(f"autopar: {info.module} ({describe_node(info.node)}) keeps its KV heads whole on "
                               f"every tp rank, but its parameter {name} is not an operand of the projection, so "
                               f"its KV rows' gradient cannot be summed; use {_kv_hint(1)}.")
        if name is None:
            continue
        with gm.graph.inserting_before(info.node):
            new = gm.graph.call_function(sum_whole_rows, (param, dim, list(info.split_sizes), list(whole), AXIS,
                                                          f"{name}: KV rows"))
        for key in ("val", "nn_module_stack", "stack_trace"):
            new.meta[key] = param.meta.get(key) if key == "val" else info.node.meta.get(key)
        provenance(new, _PASS, AXIS, f"sum the KV rows of {name} (kept whole on every rank) over tp in backward",
                   role="whole_rows")
        info.node.replace_input_with(param, new)
        result.notes.append(f"{name}: query rows split by heads, KV rows whole on every tp rank")


def _region_input(node: Node) -> tuple[Node, Node]:
    """(tensor to enter the region with, the user that reads it): step back over a
    single-use reshape (Conv1D's flattening view) so SP gathers along the sequence dim, and over a
    single-use cast that does not narrow the dtype (Ergo's ``x.float()`` in each projection), so the
    columns that cast the same input share one entry, and SP gathers the narrower tensor (a cast down
    to bf16 is entered after it)."""
    x, user = node.input, node.node
    while x.op == "call_function" and len(x.users) == 1 and (
            x.target in RESHAPE_OPS or (x.target in CAST_OPS and _widens(x))):
        x, user = x.args[0], x
    return x, user


def _widens(cast: Node) -> bool:
    """Whether ``cast`` keeps or widens its input's dtype (never narrows it)."""
    src, out = cast.args[0].meta.get("val"), cast.meta.get("val")
    return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and \
        out.dtype.itemsize >= src.dtype.itemsize


def _enter_region(gm: GraphModule, columns: list[LinearInfo], label: str, role: str,
                  constant: Callable[[Node], bool] = lambda x: False) -> None:
    """A region entry on each input of ``columns``, but those ``constant`` says need none: an input
    that no trainable parameter reaches and that holds no sequence (XLNet's relative position
    encoding, ``[2s, b, h]`` from positions alone) is replicated under SP too, and its gradient, the
    entry's backward, is never used."""
    by_input: dict[Node, set[Node]] = {}
    for c in columns:
        x, user = _region_input(c)
        by_input.setdefault(x, set()).add(user)
    for x, users in by_input.items():
        if constant(x):
            continue
        entry = _insert_after(gm, x, collectives.region_entry, (x, AXIS, f"{label}: column-parallel input"),
                              f"enter the tensor-parallel region of {label}", role)
        _redirect(x, entry, only=users)


def _vocab_parallel_embedding(gm: GraphModule, result: PassResult, node: Node, tp: int) -> None:
    weight, ids = node.args[0], node.args[1]
    padding_idx = node.args[2] if len(node.args) > 2 else -1
    rows = int(weight.meta["val"].shape[0])
    # tp need not divide the vocabulary: each rank holds ceil(V/tp) rows, the last ones zero
    # padding that no id looks up (Megatron's padded vocabulary)
    result.shard_param(weight.target, AXIS, ParamShard(0, size=rows if rows % tp else None))
    node.target = collectives.vocab_parallel_embedding
    node.args = (weight, ids, AXIS, padding_idx)
    provenance(node, _PASS, AXIS, "embedding rows sharded over the vocabulary", role="embedding")
    reduced = _insert_after(gm, node, collectives.all_reduce, (node, AXIS, "embedding output"),
                            "sum the vocabulary-parallel embedding lookups", "embedding_output")
    _redirect(node, reduced)


def _vocab_parallel_loss(gm: GraphModule, loss: Node) -> None:
    args = list(loss.args) + [None] * (6 - len(loss.args))
    weight = args[2] if args[2] is not None else loss.kwargs.get("weight")
    reduction = args[3] if args[3] is not None else loss.kwargs.get("reduction", 1)
    ignore_index = args[4] if args[4] is not None else loss.kwargs.get("ignore_index", -100)
    smoothing = args[5] if args[5] is not None else loss.kwargs.get("label_smoothing", 0.0)
    if weight is not None or smoothing:
        raise AutoparError(
            f"autopar: cross-entropy with class weights or label smoothing at {describe_node(loss)} "
            "is not supported vocabulary-parallel; expected plain cross_entropy(logits, target). "
            "Use a plan without tp, or drop the class weights / label smoothing.")
    loss.target = collectives.vocab_parallel_cross_entropy
    loss.args = (loss.args[0], loss.args[1], AXIS, ignore_index, reduction, "vocab-parallel cross-entropy")
    loss.kwargs = {}
    provenance(loss, _PASS, AXIS, "cross-entropy on vocabulary-sharded logits", role="loss")


def _edges_within(start: Node, module: str):
    """Every (node, user) edge the value of ``start`` flows along inside ``module`` (users outside
    it end the walk; each node is walked once)."""
    todo, seen = [start], {start}
    while todo:
        node = todo.pop()
        for user in node.users:
            yield node, user
            if user not in seen and within(module_path(user), module):
                seen.add(user)
                todo.append(user)


def _reaches(start: Node, targets: set[Node], module: str) -> set[Node]:
    """The nodes of ``targets`` that the value of ``start`` reaches, following its uses inside ``module``."""
    return {user for _, user in _edges_within(start, module) if user in targets}


def _latent_projections(region) -> tuple[list[LinearInfo], list[LinearInfo]]:
    """Multi-head latent attention (DeepSeek's MLA): ``(ups, downs)``.  The *ups* are the rows that
    feed the attention op (``q_b_proj``, ``kv_b_proj``: a low-rank latent projected up to the
    heads), split by heads like columns; the *downs* are the columns whose output reaches an up
    (``q_a_proj``, ``kv_a_proj_with_mqa``: hidden to the latent, with the shared rotary key), kept
    whole on every rank: the latent is shared by all heads, so every rank computes it (its weight
    gradients are partial sums over tp, which gradient placement finds and the DP pass sums).
    Both empty for attention whose rows all follow it."""
    if region.attention is None:
        return [], []
    ups = [r for r in region.rows if _reaches(r.node, {region.attention}, region.module)]
    if not ups:
        return [], []
    up_nodes = {u.node for u in ups}
    downs = [c for c in region.columns if _reaches(c.node, up_nodes, region.module)]
    return ups, downs


def _attention_operands(start: Node, region) -> set[int]:
    """Which of the region's attention op's operands (0: query, 1: key, 2: value) the value of
    ``start`` reaches, following its uses inside the region's module."""
    return {i for node, user in _edges_within(start, region.module) if user is region.attention
            for i, a in enumerate(user.args[:3]) if a is node}


def _part_nodes(c: LinearInfo) -> list[list[Node]] | None:
    """The nodes reading each part of fused projection ``c``: the getitems of a split at exactly its
    parts, or the slices that cut them (the analysis checked that those cover it exactly)."""
    last = fused_chain(c.node)[-1]
    users, sizes = list(last.users), list(c.split_sizes)
    edges = [sum(sizes[:i]) for i in range(len(sizes))]
    parts: list[list[Node]] = [[] for _ in sizes]
    if len(users) == 1 and users[0].target is aten.split_with_sizes.default and list(users[0].args[1]) == sizes:
        for item in users[0].users:
            if item.target is not operator.getitem:
                return None
            parts[item.args[1]].append(item)
        return parts
    for sl in users:
        start = (sl.args[2] if len(sl.args) > 2 else 0) or 0
        if sl.target is not aten.slice.Tensor or start not in edges:
            return None
        parts[edges.index(start)].append(sl)
    return parts


def _whole_blocks(c: LinearInfo, region) -> tuple[bool, ...] | None:
    """Per part of a fused QKV projection under KV-head replication: True where the part reaches only
    the key and value operands (kept whole on every rank), False where it reaches only the query
    (split by heads); None when a part reaches both or the parts are not found."""
    parts = _part_nodes(c) if c.split_sizes else None
    whole = []
    for nodes in parts or []:
        operands = set().union(*(_attention_operands(n, region) for n in nodes))
        if not operands or (0 in operands and operands & {1, 2}):
            return None
        whole.append(0 not in operands)
    return tuple(whole) if any(whole) and not all(whole) else None


def _kv_columns(region, tp: int) -> dict[str, tuple[bool, ...] | None]:
    """The columns of an attention region that keep KV heads whole on every rank (KV-head
    replication): those whose output reaches only the key and value operands (None: the whole
    column), and fused QKV projections, whose parts reaching only K and V stay whole while the
    query part is split (the parts per :func:`_whole_blocks`)."""
    if region.attention is None or not kv_replicated(tp, region.num_kv_heads):
        return {}
    kv: dict[str, tuple[bool, ...] | None] = {}
    for c in region.columns:
        operands = _attention_operands(c.node, region)
        if operands and operands <= {1, 2}:
            kv[c.weight] = None
        elif 0 in operands and operands & {1, 2}:
            kv[c.weight] = _whole_blocks(c, region)
            if kv[c.weight] is not None:
                continue
            raise AutoparError(
                f"autopar: tp={tp} does not divide the {region.num_kv_heads} KV heads of {region.module}, so "
                f"every tp rank keeps all of them (KV-head replication), but {c.module} "
                f"({describe_node(c.node)}) projects the query and the key/value heads in one fused weight, "
                "whose parts would need different layouts (the query heads split, the KV heads whole), and no "
                "split of its output at its parts feeds the query alone or the key and value alone; this is not "
                f"supported. Use {_kv_hint(region.num_kv_heads)}.")
    return kv


def _kv_hint(num_kv_heads: int) -> str:
    tps = [d for d in range(2, num_kv_heads + 1) if num_kv_heads % d == 0]
    return (f"a tp that divides the KV heads ({', '.join(map(str, tps))}), or " if tps else "") + \
        "a plan without tp (dp, cp, pp and ZeRO run it)"


def _check_eager_kv(s: ModelStructure, tp: int) -> None:
    """KV-head replication slices K and V at the attention op; an eager core (softmax between
    matmuls) has none to find, so tp must divide its KV heads."""
    if s.num_kv_heads and kv_replicated(tp, s.num_kv_heads) and not any(r.attention is not None for r in s.regions):
        raise AutoparError(
            f"autopar: tp={tp} does not divide the {s.num_kv_heads} KV heads, and KV-head replication needs "
            "attention through scaled_dot_product_attention, which this model does not call (its attention is "
            f"a softmax between matmuls); load it with attn_implementation='sdpa', or use {_kv_hint(s.num_kv_heads)}.")


def tensor_parallel_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    s: ModelStructure = ctx.structure
    tp = ctx.axis_sizes[AXIS]
    result = PassResult(_PASS)
    if not s.regions:
        raise AutoparError(
            "autopar: tensor parallelism found no attention or MLP region in the model (no linear "
            "projections around an attention op or feeding one another inside a module); "
            "use a plan without tp for this model.")
    _check_eager_kv(s, tp)
    needs_grad = requires_grad_nodes(gm)

    def constant(x: Node) -> bool:
        return x not in needs_grad and not seq_size_dims(x, ctx.seq_symbol)

    for region in s.regions:
        if region.kind == "attention" and not heads_ok(tp, region.num_heads, max(region.num_kv_heads, 1)):
            raise AutoparError(f"autopar: tp={tp} does not divide the {region.num_heads} attention heads of "
                               f"{describe_node(region.attention)}; tensor parallelism splits whole heads: "
                               f"valid tp values: {divisors(region.num_heads)}.")
        ups, downs = _latent_projections(region)
        if ups and kv_replicated(tp, region.num_kv_heads):
            raise AutoparError(
                f"autopar: tp={tp} does not divide the {region.num_kv_heads} heads of the latent attention "
                f"{region.module}; expected a tp that divides them. Use {_kv_hint(region.num_kv_heads)}.")
        whole = {c.weight: None for c in downs} or _kv_columns(region, tp)
        for c in region.columns:
            if c.weight in whole and whole[c.weight] is None:
                result.notes.append(f"{c.module}: kept whole on every tp rank " + (
                    "(the latent of multi-head latent attention, shared by all heads)" if downs else
                    f"(KV heads replicated: {region.num_kv_heads} KV heads, tp={tp})"))
                continue
            kept = whole.get(c.weight) or c.whole_parts
            _shard_column(ctx, result, c, whole=kept)
            if kept:
                _sum_whole_blocks(gm, result, c, kept)
        for u in ups:  # the latent's up-projections to the heads: split by heads, as columns
            _shard_column(ctx, result, u)
        _enter_region(gm, region.columns, region.module, "column_input", constant)
        rows = {r.node for r in region.rows}
        for r in region.rows:
            if r not in ups:
                # A row read again inside its region (Mamba's x_proj: the scan's step sizes and B/C,
                # contracted over the rank's channels) is summed whole: SP reduce-scatters only
                # the region's outputs along the sequence.
                inner = bool(_reaches(r.node, rows - {r.node}, region.module))
                _shard_row(gm, ctx, result, r, region.module, "row_inner" if inner else "row_output")
        result.num_rewritten += len(region.columns) + len(region.rows)
    _shard_vocabulary(gm, ctx, result, s, tp)
    _enter_side_inputs(gm, s.regions, ctx)
    return result


def _enter_side_inputs(gm: GraphModule, regions, ctx: PassContext) -> None:
    """Enter a region with every activation of the residual stream that its inner ops read besides
    its columns' input (Gemma 4's ``gate(h) * per_layer_input``): under SP the stream is sequence
    shards, gathered like the columns' input; under tp alone the entry sums the partial gradient
    that the rank's features give it.  The stream: what the reductions after rows and embeddings
    reach (masks and rotary tables, computed from the inputs alone, are not in it)."""
    ends = {"row_output", "embedding_output"}
    stream: set[Node] = set()
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if (meta is not None and meta.role in ends) or any(a in stream for a in node.all_input_nodes):
            stream.add(node)
    for region in regions:
        starts = [c.node for c in region.columns]
        inner = {u for c in starts for _, u in _edges_within(c, region.module)}
        rows = {r.node for r in region.rows}
        inner = {n for n in inner if n in rows or _reaches(n, rows, region.module)}
        for node in [n for n in gm.graph.nodes if n in inner and n not in rows]:
            for arg in node.all_input_nodes:
                val = arg.meta.get("val")
                if arg in inner or arg in starts or arg not in stream or arg.target is collectives.region_entry \
                        or not isinstance(val, torch.Tensor) or not seq_size_dims(arg, ctx.seq_symbol):
                    continue
                entry = _insert_after(gm, arg, collectives.region_entry, (arg, AXIS, f"{region.module}: side input"),
                                      f"enter the tensor-parallel region of {region.module} with a stream "
                                      "activation its inner ops read", "column_input")
                node.replace_input_with(arg, entry)


def _shard_vocabulary(gm: GraphModule, ctx: PassContext, result: PassResult, s: ModelStructure, tp: int) -> None:
    """The embedding and the LM head split by vocabulary rows (padded where tp does not divide the
    vocabulary), and the loss on the head's logits made vocabulary-parallel."""
    for emb in s.embeddings:
        if int(emb.args[0].meta["val"].shape[0]) != s.vocab:
            continue  # e.g. learned position embeddings: stay replicated
        _vocab_parallel_embedding(gm, result, emb, tp)
        rows = padded_vocab(s.vocab, tp)
        if rows * tp != s.vocab:
            result.notes.append(f"vocabulary {s.vocab} padded to {rows * tp} rows ({rows} per tp rank)")
    if s.lm_head is not None:
        _shard_column(ctx, result, s.lm_head, vocab=s.lm_head.out_features)
        _enter_region(gm, [s.lm_head], s.lm_head.module, "lm_head_input")
        loss = logits_loss(s.lm_head.node)
        if loss is not None:
            _vocab_parallel_loss(gm, loss)
        elif s.lm_head.out_features % tp:
            raise AutoparError(
                f"autopar: tp={tp} does not divide the vocabulary size {s.lm_head.out_features}, and the LM head's "
                f"logits ({describe_node(s.lm_head.node)}) reach no cross-entropy loss, so they would be gathered "
                "with their padding columns; padded vocabularies are supported only for a cross-entropy on the "
                f"logits. Use a tp that divides {s.lm_head.out_features}, or a loss of cross_entropy(logits, target).")
        else:
            gathered = _insert_after(gm, s.lm_head.node, collectives.all_gather,
                                     (s.lm_head.node, s.lm_head.node.meta["val"].dim() - 1, AXIS, "logits"),
                                     "gather vocabulary-sharded logits (no cross-entropy loss found)", "logits")
            _redirect(s.lm_head.node, gathered)
            result.notes.append("LM head logits are gathered: no cross-entropy loss consumes them directly")
    result.num_inserted = sum(1 for n in gm.graph.nodes if META_KEY in n.meta and n.meta[META_KEY].pass_name == _PASS)
