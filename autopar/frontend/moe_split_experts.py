"""Stacked experts run slice by slice on rows split by per-expert counts (JetMoE's ParallelExperts).

Part of the MoE analysis (:mod:`autopar.frontend.analyze_moe` calls :func:`split_bodies` for
stacked experts).  Besides a grouped matmul over rows sorted by expert, stacked ``[E, ...]``
weights are also applied expert by expert::

    sizes = counts.tolist()                       # counts[e]: the rows routed to expert e
    out = torch.cat([F.linear(x_e, W[e]) for e, x_e in enumerate(rows.split(sizes))])

In the traced graph ``sizes`` are unbacked symbols (``item`` of each count), the split a
``split_with_sizes`` into ``E`` chunks, and each chunk's computation a copy whose only difference
is the slice ``select(W, 0, e)`` it reads.  What is proven, by dataflow, before the block is
rewritten:

- the rows are the tokens gathered in expert order (``x[sort(idx.flatten()).indices // k]``) and
  ``counts`` is the number of (token, slot) pairs per expert (the column sums of a one-hot of the
  top-k ids, which are distinct per token), so chunk ``e`` holds exactly expert ``e``'s rows;
- chunk ``e``'s computation is chunk 0's, node for node, with slice ``e`` of the same stacked
  parameters where chunk 0 reads slice 0, and nothing of it is used outside it but its output,
  which the ``cat`` takes in expert order;
- the work between the expert layers (JetMoE's ``chunk``, ``silu``, ``mul`` between its two
  ParallelExperts) is row-wise, so it may run on any subset of the rows.

The cut-out body (:func:`split_body`) then runs, for each local expert ``j`` of a rank, chunk 0's
code on that expert's rows with slice ``j`` of the rank's shard of each stacked parameter (the
user's ``W[e]``), so ep runs exactly the user's expert computation on the rows routed to it.
Experts whose halves run around other work (JetMoE's attention experts: a scatter back to token
order and attention between the two ParallelExperts) fail the row-wise proof and are refused.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import nn
from torch.fx import Graph, GraphModule, Node

from autopar.compat import sym_expr
from autopar.errors import AutoparError, describe_node
from autopar.frontend.moe_bodies import ancestors as _before, descendants as _after, order as _order
from autopar.frontend.moe_bodies import param_only as _from_params

__all__ = ["SplitExperts", "split_bodies", "split_body", "run_experts", "expert_counts"]

aten = torch.ops.aten

# Work that maps each row of its operands to the same row of its output (checked between expert
# layers): element-wise ops, casts, and pieces taken along a dim other than the rows.
_ELEMENTWISE = frozenset({
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.silu.default, aten.gelu.default,
    aten.relu.default, aten.tanh.default, aten.sigmoid.default, aten.exp.default, aten.pow.Tensor_Scalar,
    aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.clone.default, aten.contiguous.default,
    aten.alias.default})
_PIECES = frozenset({aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor})
_ITEMS = frozenset({aten.item.default, aten._local_scalar_dense.default})
_CASTS = frozenset({aten.to.dtype, aten._to_copy.default, aten.type_as.default})
_FILLS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})


@dataclasses.dataclass
class SplitGroup:
    """One expert layer: ``cat([expert(chunk_e, W[e]) for e])`` over ``split(x, sizes)``."""

    split: Node
    cat: Node
    chunk: Node  # expert 0's chunk
    members: list[Node]  # expert 0's computation in graph order, its output last
    slices: list[Node]  # the select(W, 0, 0) expert 0 reads, one per stacked parameter W
    shared: list[Node]  # parameters expert 0 reads whole
    every: set[Node]  # every expert's computation (the body runs expert 0's for each)


@dataclasses.dataclass
class SplitExperts:
    rows: Node  # the tokens gathered in expert order
    counts: Node  # [E] rows per expert
    out: Node  # the last per-row value before the weighting
    groups: list[SplitGroup]
    nodes: list[Node]  # what the body computes besides the groups' insides: row-wise work and the cats


def _shape(node) -> tuple:
    v = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(v, torch.Tensor):
        return ()
    return tuple(sym_expr(s) if isinstance(s, torch.SymInt) else int(s) for s in v.shape)


def _refuse(block, what: str) -> AutoparError:
    return AutoparError(
        f"autopar: the stacked experts of '{block.module}', routed at {describe_node(block.index)}, run expert "
        f"by expert on rows split by per-expert counts, but {what}. Expected each expert's rows in a chunk of "
        "its own, the same code on every chunk with that expert's slice of the weights, and only row-wise work "
        "between the expert layers (experts whose halves run around other work, such as JetMoE's attention "
        "experts, are not split). Use a plan with ep=1 and tp=1 for this model.")


def _dim(node: Node) -> int:
    """The dim a split, chunk or slice cuts (``slice.Tensor(x, dim, ..)``, the others ``(x, n, dim)``)."""
    at = 1 if node.target is aten.slice.Tensor else 2
    return node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)


def _counts_of(split: Node, num_experts: int) -> Node | None:
    """``C`` when ``split`` cuts its rows by ``[C[0].item(), .., C[E-1].item()]`` along dim 0."""
    if split.target is not aten.split_with_sizes.default or len(split.args[1]) != num_experts \
            or _dim(split) % len(_shape(split.args[0])) != 0:
        return None
    sizes = split.args[1]
    found = set()
    for e, size in enumerate(sizes):
        src = size.args[0] if isinstance(size, Node) and size.target in _ITEMS else None
        if src is not None and src.target is operator.getitem and src.args[0].target is aten.unbind.int \
                and src.args[1] == e and src.args[0].args[1:] in ((), (0,)):
            found.add(src.args[0].args[0])
        elif src is not None and src.target is aten.select.int and src.args[1:] == (0, e):
            found.add(src.args[0])
        else:
            return None
    return found.pop() if len(found) == 1 else None


def _one_hot_counts(counts: Node, index: Node, num_experts: int) -> bool:
    """``zeros([T, E]).scatter(1, idx, 1)`` (cast), summed over the tokens: pairs per expert, when
    ``idx`` are a top-k's indices (distinct per token, so no pair is scattered onto another)."""
    if counts.target is not aten.sum.dim_IntList or list(counts.args[1]) not in ([0], [-2]):
        return False
    hot = counts.args[0]
    while hot.target in _CASTS:
        hot = hot.args[0]
    topk = index.args[0] if index.target is operator.getitem and index.args[1] == 1 else None
    return (hot.target is aten.scatter.value and hot.args[1] in (1, -1) and hot.args[2] is index
            and hot.args[3] == 1 and hot.args[0].target in _FILLS and _shape(hot)[1:] == (num_experts,)
            and topk is not None and topk.target is aten.topk.default)


def _rows_in_expert_order(rows: Node, index: Node, top_k: int) -> bool:
    """``x[positions // k]`` where ``positions`` ascending-sorts the flattened top-k ids (the
    positions are not negative, so a truncating division is the floor)."""
    pick = rows.args[1][0] if len(rows.args[1]) == 1 else None
    if not (isinstance(pick, Node) and pick.args[1:2] == (top_k,) and (
            pick.target is aten.floor_divide.default
            or pick.target is aten.div.Tensor_mode and pick.kwargs.get("rounding_mode") in ("floor", "trunc"))):
        return False
    positions = pick.args[0]
    sort = positions.args[0] if positions.target is operator.getitem and positions.args[1] == 1 else None
    if sort is None or sort.target not in (aten.sort.default, aten.sort.stable):
        return False
    descending = sort.args[2] if sort.target is aten.sort.default and len(sort.args) > 2 \
        else sort.kwargs.get("descending", False)
    flat = sort.args[0]
    return not descending and flat.target in (aten.flatten.using_ints, aten.view.default, aten.reshape.default) \
        and flat.args[0] is index and len(_shape(flat)) == 1


def _slice_of(node: Node, num_experts: int) -> tuple[Node, int] | None:
    """``(W, e)`` for ``select(W, 0, e)`` of a stacked ``[E, ...]`` parameter."""
    if node.target is aten.select.int and node.args[0].op == "get_attr" and node.args[1] == 0 \
            and _shape(node.args[0])[:1] == (num_experts,):
        return node.args[0], int(node.args[2])
    return None


def _expert(block, chunk: Node, result: Node, cat: Node):
    """The nodes from ``chunk`` to ``result`` (one expert's computation), the slices and whole
    parameters it reads; refused when it reads anything else or is used outside itself."""
    members, slices, shared, todo = {result}, [], [], [result]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a is chunk or a in members or a in slices or a in shared:
                continue
            if _slice_of(a, block.num_experts) is not None:
                slices.append(a)
            elif a.op == "get_attr":
                shared.append(a)
            elif a.op == "call_function" and (chunk in _before(a) or _from_params(a)):
                members.add(a)
                todo.append(a)
            else:
                raise _refuse(block, f"the expert at {describe_node(result)} also reads '{a.name}'")
    if chunk not in _before(result):
        raise _refuse(block, f"the expert output {describe_node(result)} does not depend on the expert's rows")
    leak = [u for n in members | {chunk} for u in n.users if u not in members and u is not cat]
    if leak or list(chunk.users) and not set(chunk.users) <= members:
        raise _refuse(block, f"{describe_node(leak[0] if leak else chunk)} uses an expert's values outside it")
    return sorted(members, key=_order), sorted(slices, key=_order), sorted(shared, key=_order)


def _same(a, b, expert: int, pairs: dict, num_experts: int) -> bool:
    """Whether ``a`` (in expert ``expert``'s computation) is ``b`` (in expert 0's), op for op,
    reading slice ``expert`` of each stacked parameter where ``b`` reads slice 0."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same(x, y, expert, pairs, num_experts) for x, y in zip(a, b))
    if not isinstance(a, Node) or not isinstance(b, Node):
        return not isinstance(a, Node) and not isinstance(b, Node) and type(a) is type(b) and a == b
    if a in pairs or b in pairs.values():
        return pairs.get(a) is b
    sa, sb = _slice_of(a, num_experts), _slice_of(b, num_experts)
    if sa is not None or sb is not None:
        same = sa is not None and sb is not None and sa == (sb[0], expert) and sb[1] == 0
    elif a.op == "get_attr" or b.op == "get_attr":
        same = a is b
    else:
        same = a.op == b.op == "call_function" and a.target == b.target and a.kwargs.keys() == b.kwargs.keys() \
            and _same(list(a.args), list(b.args), expert, pairs, num_experts) \
            and _same([a.kwargs[k] for k in a.kwargs], [b.kwargs[k] for k in a.kwargs], expert, pairs, num_experts)
    if same:
        pairs[a] = b
    return same


def _group(block, split: Node) -> SplitGroup:
    num_experts = block.num_experts
    chunks = [next((u for u in split.users if u.target is operator.getitem and u.args[1] == e), None)
              for e in range(num_experts)]
    cats = sorted((u for u in _after([c for c in chunks if c is not None]) if u.target is aten.cat.default
                   and len(u.args[0]) == num_experts and (len(u.args) < 2 or u.args[1] == 0)), key=_order)
    if None in chunks or len(split.users) != num_experts or not cats:
        raise _refuse(block, f"the chunks of {describe_node(split)} are not concatenated back, one per expert")
    cat = cats[0]
    members, slices, shared = _expert(block, chunks[0], cat.args[0][0], cat)
    every = set(members)
    for e in range(1, num_experts):
        every.update(_expert(block, chunks[e], cat.args[0][e], cat)[0])
        if not _same(cat.args[0][e], cat.args[0][0], e, {chunks[e]: chunks[0]}, num_experts):
            raise _refuse(block, f"expert {e}'s computation {describe_node(cat.args[0][e])} is not expert 0's "
                                 "with its own slice of the same stacked weights")
    return SplitGroup(split, cat, chunks[0], members, slices, shared, every)


def _rowwise(node: Node, body: set[Node]) -> bool:
    """Whether ``node`` maps each row of its body operands to its own row (other operands are
    parameters broadcast along the rows, or numbers)."""
    args = node.all_input_nodes
    if node.target is operator.getitem:
        return node.args[0] in body and node.args[0].target in _PIECES
    if node.target in _PIECES:
        return args == [node.args[0]] and node.args[0] in body and _dim(node) % len(_shape(node.args[0])) != 0
    return node.target in _ELEMENTWISE and all(
        a in body or a.op == "get_attr" and len(_shape(a)) < len(_shape(node)) for a in args)


def _body(block, rows: Node, groups: list[SplitGroup]) -> tuple[Node, list[Node]]:
    """The expert output (the last float row of the experts before the weighting) and the nodes
    the body computes outside the groups, each proven row-wise."""
    weighted = _after([block.weights])
    size = _shape(groups[-1].cat)[0]
    outs = [n for n in block.region if _shape(n) == (size, block.hidden) and n not in weighted
            and n.meta["val"].dtype.is_floating_point]
    if not outs:
        raise _refuse(block, f"no [routed rows, {block.hidden}] output precedes the weighting")
    out = max(outs, key=_order)
    body = (_after([rows]) & _before(out)) | {out}
    inside = {n for g in groups for n in [g.split, *g.split.users, *g.every]}
    nodes = sorted(body - inside, key=_order)
    for n in nodes:
        if n not in (g.cat for g in groups) and not _rowwise(n, body | {rows}):
            raise _refuse(block, f"{describe_node(n)} runs between the expert layers and is not row-wise")
    if any(g.split.args[0] not in body and g.split.args[0] is not rows for g in groups):
        raise _refuse(block, "an expert layer splits rows that do not come from the sorted tokens")
    return out, nodes


def split_bodies(block, stacked: list[Node]) -> bool:
    """Fill ``block`` (``split``, ``expert_params``, ``body_io``) when its stacked experts run one
    slice at a time on rows split by per-expert counts; False when they do not (no such split)."""
    splits = [n for n in block.region if _counts_of(n, block.num_experts) is not None]
    rows = [n for n in block.region if n.target is aten.index.Tensor and n.args[0] is block.tokens]
    if not splits or len(rows) != 1:
        return False
    rows, counts = rows[0], {_counts_of(s, block.num_experts) for s in splits}
    if len(counts) != 1 or not _one_hot_counts(next(iter(counts)), block.index, block.num_experts):
        raise _refuse(block, f"the split sizes of {describe_node(splits[0])} are not the number of "
                             "(token, slot) pairs per expert (the sum over tokens of a one-hot of the top-k ids)")
    if not _rows_in_expert_order(rows, block.index, block.top_k):
        raise _refuse(block, f"the rows {describe_node(rows)} are not the tokens sorted by expert")
    groups = [_group(block, s) for s in splits]
    weights = {s.args[0] for g in groups for s in g.slices}
    if weights != set(stacked):
        raise _refuse(block, f"the experts read slices of {sorted(w.target for w in weights)}, not of every "
                             f"stacked weight {sorted(w.target for w in stacked)}")
    out, nodes = _body(block, rows, groups)
    block.split = SplitExperts(rows, next(iter(counts)), out, groups, nodes)
    block.expert_params = [[p.target for p in sorted(stacked, key=_order)]]
    block.body_io = [(rows, block.split.counts, out)]
    # Every expert's slices die with the region: under ep a rank's shard has only its own slices.
    every_slice = {u for w in stacked for u in w.users if _slice_of(u, block.num_experts) is not None}
    block.region = sorted(set(block.region) | every_slice, key=_order)
    return True


def expert_counts(offsets: torch.Tensor) -> list[int]:
    """Rows per local expert from their end offsets (what ``moe_experts`` hands a stacked body)."""
    return torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()


def run_experts(expert: nn.Module, rows: torch.Tensor, counts: list[int], stacked: list[torch.Tensor],
                shared: list[torch.Tensor]) -> torch.Tensor:
    """Local expert ``j`` on its rows with slice ``j`` of each stacked parameter (the user's ``W[e]``
    on expert ``e``'s rows), concatenated in expert order."""
    if any(w.shape[0] != len(counts) for w in stacked):
        raise AutoparError(f"autopar: {len(counts)} local experts but stacked weights of "
                           f"{[w.shape[0] for w in stacked]} experts; expected one slice per local expert.")
    return torch.cat([expert(chunk, *(w[j] for w in stacked), *shared)
                      for j, chunk in enumerate(rows.split(counts))])


def _copy(graph: Graph, nodes: list[Node], env: dict) -> None:
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        env[n].meta.pop("_autopar_order", None)


def _template(group: SplitGroup) -> GraphModule:
    """Expert 0's computation: its chunk, then its slices and whole parameters, as placeholders."""
    graph = Graph()
    env = {group.chunk: graph.placeholder("rows")}
    env.update({s: graph.placeholder(f"w{i}") for i, s in enumerate(group.slices)})
    env.update({p: graph.placeholder(f"shared{i}") for i, p in enumerate(group.shared)})
    _copy(graph, group.members, env)
    graph.output(env[group.members[-1]])
    return GraphModule(nn.Module(), graph)


def split_body(split: SplitExperts) -> tuple[GraphModule, list[str]]:
    """The experts as a stacked body (placeholders: the rows, their per-expert end offsets, then the
    returned parameters): the row-wise work copied, each expert layer one :func:`run_experts` call of
    expert 0's code (submodule ``expert_<i>``) over the local experts."""
    params: list[Node] = []
    for n in split.nodes:
        params += [a for a in n.all_input_nodes if a.op == "get_attr" and a not in params]
    for g in split.groups:
        params += [p for p in [s.args[0] for s in g.slices] + g.shared if p not in params]
    graph, root = Graph(), nn.Module()
    env = {split.rows: graph.placeholder("tokens")}
    offsets = graph.placeholder("offsets")
    env.update({p: graph.placeholder(f"p{i}") for i, p in enumerate(params)})
    counts = graph.call_function(expert_counts, (offsets,))
    layers = {g.cat: (i, g) for i, g in enumerate(split.groups)}
    for n in split.nodes:
        if n not in layers:
            _copy(graph, [n], env)
            continue
        i, g = layers[n]
        root.add_module(f"expert_{i}", _template(g))
        env[n] = graph.call_function(run_experts, (graph.get_attr(f"expert_{i}"), env[g.split.args[0]], counts,
                                                   [env[s.args[0]] for s in g.slices], [env[p] for p in g.shared]))
    graph.output(env[split.out])
    return GraphModule(root, graph), [p.target for p in params]
