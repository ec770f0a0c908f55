"""Recognise mixture-of-experts blocks in a traced graph, by dataflow and module structure.

Part of the analysis stage (:mod:`autopar.frontend.analyze` calls :func:`find_moe_blocks`).  A MoE
block computes ``y[t] = sum_k w[t, k] * expert[idx[t, k]](x[t])``.  What is found, never by
model or module names:

- the *routing* (:mod:`autopar.frontend.moe_routing`): ids ``idx [T, k]`` proven indices over a
  router's ``E`` outputs (an ``aten.topk``'s, or max picks per slot concatenated), and the float
  ``[T, k]`` tensor the experts are weighted with, ``w`` (softmax before or after top-k, optionally
  renormalised: whatever the graph computes);
- the *experts region*: every node that depends on ``idx`` up to the first ``[T, h]`` node
  ``y`` that all experts feed; the region's float ``[T, h]`` input is the tokens ``x``;
- the *experts*, in one of two styles:
  * ``stacked``: 3-D parameters ``[E, ...]`` used by a grouped matmul on tokens sorted by
    expert with per-expert offsets (transformers 5.x Mixtral / Qwen-MoE), or applied slice by
    slice to those tokens split by per-expert counts (JetMoE: :mod:`.moe_split_experts`);
  * ``modulelist``: ``E`` numbered child modules, each an MLP run on the tokens routed to it.

For each style the per-expert computation (the *body*) is cut out of the region as its own
small graph (:mod:`autopar.frontend.moe_bodies`), so the EP pass (``passes/expert_parallel.py``)
can run exactly the user's expert code on the tokens that reach a rank, while the routing glue
around it (sorting, gathering, weighting, summing) is replaced by :mod:`autopar.ops.moe`.  The
routings are found by :mod:`autopar.frontend.moe_routing`; experts applied slice by slice on rows
split by counts by :mod:`autopar.frontend.moe_split_experts`.
"""
from __future__ import annotations

import dataclasses
import operator
import re

import torch
from torch.fx import GraphModule, Node

from autopar.frontend.fx_utils import module_path, within as _within
from autopar.frontend.moe_bodies import ancestors as _ancestors, descendants, extract_body
from autopar.frontend.moe_bodies import order as _order, walk_inputs as _walk_inputs
from autopar.frontend.moe_routing import in_module, is_float as _is_float, node_shape as _shape
from autopar.frontend.moe_routing import remapped_index as _remapped_index, routings as _routings
from autopar.frontend.moe_split_experts import SplitExperts, split_bodies
from autopar.frontend.op_sets import PROJECTION_OPS, RESHAPE_OPS
from autopar.errors import AutoparError, describe_node

aten = torch.ops.aten

__all__ = ["MoEBlock", "DenseExperts", "find_moe_blocks", "find_moe", "expert_width", "in_module"]



@dataclasses.dataclass
class MoEBlock:
    module: str  # module holding the routing (for messages)
    style: str  # "stacked" | "modulelist"
    num_experts: int
    top_k: int
    router: Node | None  # the linear producing the router logits
    index: Node  # idx [T, k], int64
    weights: Node  # w [T, k], float
    tokens: Node  # x [T, h]
    output: Node  # y [T, h]
    region: list[Node]  # the nodes the EP pass replaces, in graph order
    expert_params: list[list[str]]  # modulelist: per expert; stacked: one list of [E, ...] params
    expert_modules: list[str]  # modulelist: module path of each expert
    body_io: list[tuple[Node, Node | None, Node]]  # per body: (tokens in, offsets in, output)
    expert_ids: Node | None = None  # stacked: the expert of each sorted row, read by per-expert tables
    split: SplitExperts | None = None  # stacked experts run slice by slice on rows split by counts
    expert_numel: int = 0  # parameter elements of one expert
    shared_numel: int = 0  # parameter elements of the block's always-on (shared) experts and their gates

    @property
    def param_names(self) -> list[str]:
        return [p for group in self.expert_params for p in group]

    @property
    def hidden(self) -> int:
        return int(self.tokens.meta["val"].shape[-1])


@dataclasses.dataclass
class DenseExperts:
    """A top-k routing whose stacked experts all run on every row (Llama 4: the tokens repeated per
    expert, scaled by the router scores, a batched matmul over all ``E`` experts).  Nothing is routed:
    without ep the block runs as traced and placement propagation proves it op by op on token shards;
    under ep (``passes/dense_expert_parallel.py``) the computation from ``tokens`` and ``scores`` to
    ``output`` is cut out and run on each rank's experts for the ep group's tokens.  A capacity has no
    routed rows to drop and is refused."""

    module: str  # module holding the routing
    num_experts: int
    node: Node  # the first batched matmul over every expert (for messages)
    params: list[str]  # the stacked [E, ...] parameters
    width: int = 0  # an expert's intermediate width: its first matmul's output width (halved when gated)
    tokens: Node | None = None  # x [T, h], every expert's input (None: not found, ep refused)
    scores: Node | None = None  # the router's scores [T, E] (zero off the top-k) the experts read
    output: Node | None = None  # y [T, h]: the sum over the experts


def _stacked_params(gm: GraphModule, scoped: list[Node], num_experts: int | None) -> list[Node]:
    """3-D ``[E, ...]`` parameters that scoped nodes use, directly or through views (``num_experts``
    None: of any one leading size, when every such parameter has the same)."""
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    found: list[Node] = []
    for n in scoped:
        for a in n.all_input_nodes:
            while a.op == "call_function" and len(a.all_input_nodes) == 1 and a not in scoped:
                a = a.all_input_nodes[0]
            if a.op == "get_attr" and a.target in params and len(_shape(a)) == 3 \
                    and (num_experts is None or int(_shape(a)[0]) == num_experts) and a not in found:
                found.append(a)
    if num_experts is None and len({int(_shape(a)[0]) for a in found}) != 1:
        return []
    return found


def _numbered_experts(scoped: list[Node], scope: str, num_experts: int) -> list[str]:
    """Paths ``<prefix>.0 .. <prefix>.E-1`` of child modules (inside ``scope``) that routed tokens reach."""
    by_prefix: dict[str, set[int]] = {}
    for n in scoped:
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            m = re.match(r"^(.*)\.(\d+)$", path)
            if m and _within(m.group(1), scope):
                by_prefix.setdefault(m.group(1), set()).add(int(m.group(2)))
    for prefix, idx in by_prefix.items():
        if idx == set(range(num_experts)):
            return [f"{prefix}.{i}" for i in range(num_experts)]
    return []


def _weights(region: set[Node], index: Node, topk: Node) -> Node | None:
    """The float [T, k] tensor the region weights expert outputs with (found through reshapes)."""
    num_tokens, k = _shape(index)
    values = descendants([topk])
    for n in sorted(region, key=_order):
        for a in n.all_input_nodes:
            if a in region or not _is_float(a) or (a not in values and a is not topk and not _ones(a)):
                continue
            while _shape(a) != (num_tokens, k) and a.op == "call_function" and a.target in RESHAPE_OPS:
                a = a.args[0]
            if _shape(a) == (num_tokens, k):
                return a
    return None


def _ones(node: Node) -> bool:
    """A fill of ones, through reshapes: unit weights (Ergo weights each (token, slot) row after its
    experts, so the routed block itself weights every row 1)."""
    while node.op == "call_function" and node.target in RESHAPE_OPS:
        node = node.args[0]
    return node.op == "call_function" and node.target in (aten.new_ones.default, aten.ones.default,
                                                          aten.ones_like.default)


def _gathered_weights(region: set[Node], index: Node, needed: set[Node]) -> Node | None:
    """The float [T, k] tensor inside ``region`` that no expert computation feeds: routing weights
    gathered from the router's scores at the top-k indices (``scores.gather(1, idx)``), then
    normalised and scaled.  The last such node before the experts use it."""
    num_tokens, k = _shape(index)
    found = [n for n in region if n.op == "call_function" and _is_float(n) and _shape(n) == (num_tokens, k)
             and (_ancestors(n) | {n}).isdisjoint(needed)]
    if not found or not any(n.target is aten.gather.default for n in found):
        return None
    return max(found, key=_order)


def _first_users_in(node: Node, region: set[Node]) -> set[Node]:
    """The first nodes of ``region`` that ``node`` reaches (through nodes outside it)."""
    found, seen, todo = set(), set(), [node]
    while todo:
        for u in todo.pop().users:
            if u in region:
                found.add(u)
            elif u not in seen:
                seen.add(u)
                todo.append(u)
    return found


def _router(topk: Node) -> Node | None:
    seen, todo = set(), [topk]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.target in PROJECTION_OPS:
            return n
        for a in n.all_input_nodes:
            if a not in seen and a.op == "call_function":
                seen.add(a)
                todo.append(a)
    return None


def find_moe_blocks(gm: GraphModule) -> list[MoEBlock]:
    """Every MoE block of the graph, in graph order (see the module docstring)."""
    return find_moe(gm)[0]


def find_moe(gm: GraphModule) -> tuple[list[MoEBlock], list[DenseExperts], list[AutoparError]]:
    """Every routed MoE block and every block of dense experts (:class:`DenseExperts`), in graph order,
    and why each routing whose experts could not be cut out was not (JetMoE's attention experts: the
    expert outputs feed attention before they are weighted).  Those run as traced on the rank's tokens,
    proven op by op like any other node; a plan that must rewrite them is refused with their error."""
    for i, n in enumerate(gm.graph.nodes):
        n.meta["_autopar_order"] = i
    blocks, dense, unsplit = [], [], []
    for topk, index, width in _routings(gm):
        try:
            block = _block(gm, topk, index, width)
        except AutoparError as exc:
            unsplit.append(exc)
            continue
        if isinstance(block, DenseExperts):
            dense.append(block)
        elif block is not None:
            blocks.append(block)
    return blocks, dense, unsplit


def _dense_experts(scope: str, stacked: list[Node], index: Node, down: set[Node], num_experts: int) \
        -> DenseExperts | None:
    """The stacked experts as :class:`DenseExperts` when every parameter meets the routed values first
    in a batched matmul whose batch is the ``E`` experts (``bmm([E, n, h], [E, h, f])``: each expert
    on the same ``n`` rows, no per-expert offsets); None otherwise."""
    firsts = [(p, u) for p in stacked for u in _first_users_in(p, down)]
    def batched_over_experts(p: Node, u: Node) -> bool:
        rows, weight = u.args[0], u.args[1]
        return (u.target is aten.bmm.default and (weight is p or p in _ancestors(weight))
                and p not in _ancestors(rows) | {rows} and _shape(rows)[:1] == (num_experts,))

    if not firsts or not all(batched_over_experts(p, u) for p, u in firsts):
        return None
    first = min((u for _, u in firsts), key=_order)
    out_width = int(_shape(first)[-1])
    gated = any(u.target is aten.chunk.default or u.target is aten.split.Tensor for u in first.users)
    return DenseExperts(module=scope, num_experts=num_experts, node=first, params=[p.target for p in stacked],
                        width=out_width // 2 if gated else out_width,
                        **_dense_io(index, down, stacked, num_experts))


def _dense_io(index: Node, down: set[Node], stacked: list[Node], num_experts: int) -> dict:
    """``tokens``, ``scores`` and ``output`` of dense experts, by dataflow: the output is the first
    float ``[T, .]`` node (``T`` the routed tokens) that every stacked parameter reaches; the scores
    the last float ``[T, E]`` value of the routing (descending from the top-k indices) it reads; the
    tokens the ``[T, h]`` value outside the routing where a walk back from the output, stopping at
    the scores and the parameters, first meets such a value.  Empty when the block does not have that form."""
    num_tokens = _shape(index)[0]
    needed = set(stacked)
    output = next((n for n in sorted(descendants(stacked), key=_order) if n.op == "call_function"
                   and _is_float(n) and len(_shape(n)) == 2 and _shape(n)[0] == num_tokens
                   and needed <= _ancestors(n)), None)
    if output is None:
        return {}
    above = _ancestors(output)
    scores = [n for n in down & above if _is_float(n) and _shape(n) == (num_tokens, num_experts)]
    if not scores:
        return {}
    score = max(scores, key=_order)
    tokens, seen, todo = set(), {score}, [output]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a in seen or a.op == "get_attr":
                continue
            seen.add(a)
            if a not in down and _is_float(a) and _shape(a) == _shape(output):
                tokens.add(a)
            elif a.op == "call_function":
                todo.append(a)
    if len(tokens) != 1:
        return {}
    return {"tokens": tokens.pop(), "scores": score, "output": output}


_SCATTERS = (aten.index.Tensor, aten.index_add.default, aten.index_add_.default, aten.index_put.default,
             aten.index_put_.default, aten.index_copy.default, aten.scatter_add.default)


def _back_in_token_order(node: Node, down: set[Node]) -> bool:
    """With top-1 the rows sorted by expert are ``[T, h]`` like the block's output: a candidate is the
    output only once routed float rows were moved back by routing indices (``y[inverse]``, an
    ``index_add`` at the tokens): an index op among its routed ancestors that moves routed floats."""
    return any(a.target in _SCATTERS and any(_is_float(b) and b in down for b in a.all_input_nodes)
               for a in (_ancestors(node) | {node}) & down)


def _block(gm: GraphModule, topk: Node, index: Node, width: int) -> MoEBlock | DenseExperts | None:
    num_experts, k = width, int(_shape(index)[-1])
    down = descendants([index])
    mod = module_path(topk)
    for scope in (mod, mod.rsplit(".", 1)[0] if "." in mod else ""):
        scoped = [n for n in down if n.op == "call_function" and in_module(n, scope)]
        stacked = _stacked_params(gm, scoped, num_experts)
        remapped = _remapped_index(index, down, scope)
        if remapped is not None:  # ids computed from the top-k's: fewer experts (zero experts), one per row
            stacked = stacked or _stacked_params(gm, scoped, None)
            if stacked:
                index, num_experts, k = remapped, int(_shape(stacked[0])[0]), int(_shape(remapped)[1])
                down = descendants([index])
                scoped = [n for n in down if n.op == "call_function" and in_module(n, scope)]
        if len(_shape(index)) != 2:  # a [b, s, k] top-k is a routing once the block flattens its ids
            continue
        experts = [] if stacked else _numbered_experts(scoped, scope, num_experts)
        if stacked or experts:
            break
    else:
        return None
    if stacked and (dense := _dense_experts(scope or mod, stacked, index, down, num_experts)) is not None:
        return dense
    if stacked:
        needed = {c for p in stacked for c in _first_users_in(p, down)}
    else:
        needed = {n for n in scoped if any(in_module(n, e) for e in experts)}
    output = next((n for n in sorted(down, key=_order)
                   if n.op == "call_function" and _is_float(n) and len(_shape(n)) == 2
                   and _shape(n)[0] == _shape(index)[0] and needed <= (_ancestors(n) | {n})
                   and (k > 1 or _back_in_token_order(n, down))), None)
    if output is None:
        raise AutoparError(f"autopar: found a routing at {describe_node(topk)} with {num_experts} experts "
                           "but no [tokens, hidden] output that combines every expert; expected "
                           "y[t] = sum_k w[t, k] * expert[idx[t, k]](x[t]). Use a plan with ep=1 and tp=1 "
                           "for this model, or report the MoE layout.")
    region = (down & _ancestors(output)) | {output}
    # Asserts and size checks on the routed token counts die with the region.
    after = descendants([output])
    for n in sorted(down - region - after, key=_order, reverse=True):
        if all(u in region for u in n.users):
            region.add(n)
    tokens = next((a for n in sorted(region, key=_order) for a in n.all_input_nodes
                   if a not in region and _is_float(a) and _shape(a) == _shape(output)), None)
    weights = _weights(region, index, topk)
    if weights is None:  # gathered from the scores by the indices (DeepSeek's sigmoid routing)
        weights = _gathered_weights(region, index, needed)
        if weights is not None:  # the routing arithmetic is the router's, not the experts'
            region -= _ancestors(weights) | {weights}
    if tokens is None or weights is None:
        raise AutoparError(f"autopar: the experts region ending at {describe_node(output)} has no "
                           f"{'[tokens, hidden] input' if tokens is None else '[tokens, top-k] weight input'}; "
                           "expected y[t] = sum_k w[t, k] * expert[idx[t, k]](x[t]). Use a plan with ep=1 and tp=1.")
    router = _router(topk) or _router(weights)  # a table lookup's router only scores: it feeds the weights
    block = MoEBlock(module=scope or mod, style="stacked" if stacked else "modulelist", num_experts=num_experts,
                     top_k=k, router=router, index=index, weights=weights, tokens=tokens, output=output,
                     region=sorted(region, key=_order), expert_params=[], expert_modules=experts, body_io=[])
    if stacked:
        if not split_bodies(block, stacked):  # JetMoE: one slice per chunk of the rows, not a grouped matmul
            _stacked_bodies(block, stacked)
    else:
        _modulelist_bodies(block)
    _count_params(gm, block, stacked)
    return block


def _count_params(gm: GraphModule, block: MoEBlock, stacked: bool) -> None:
    """An expert's parameter count, and the block's parameters outside its experts and router
    (shared experts, their gate), from the parameters the block's nodes read."""
    numel = sum(gm.get_parameter(p).numel() for p in block.expert_params[0])
    block.expert_numel = numel // block.num_experts if stacked else numel
    owned = set(block.param_names) | ({block.router.args[1].target} if block.router is not None else set())
    params = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    shared = {a.target for n in gm.graph.nodes if n.op == "call_function" and in_module(n, block.module)
              for a in n.all_input_nodes if a.op == "get_attr" and a.target in params and a.target not in owned}
    block.shared_numel = sum(gm.get_parameter(p).numel() for p in shared)


def _stacked_bodies(block: MoEBlock, stacked: list[Node]) -> None:
    region = set(block.region)
    x_rows = [n for n in block.region if n.target == aten.index.Tensor and n.args[0] is block.tokens]
    if len(x_rows) != 1:
        raise AutoparError(f"autopar: the stacked experts at {describe_node(block.output)} gather the tokens "
                           f"{len(x_rows)} times; expected one gather of the tokens sorted by expert.")
    rows = x_rows[0]
    weighted = descendants([block.weights])
    outs = [n for n in block.region if _shape(n)[:1] == _shape(rows)[:1] and len(_shape(n)) == 2
            and _shape(n)[1] == block.hidden and n not in weighted and n is not rows and _is_float(n)]
    if not outs:
        raise AutoparError(
            f"autopar: the stacked experts of '{block.module}', routed at {describe_node(block.index)}, have no "
            f"per-row output [routed rows, {block.hidden}] before the weighting; expected experts that map each "
            "routed row to a row of the hidden size (experts whose halves run around other work, such as "
            "JetMoE's attention experts, are not split). Use a plan with ep=1 and tp=1 for this model.")
    out = max(outs, key=_order)
    stops = [a for a in _walk_inputs(out, rows) if a in region and rows not in _ancestors(a) | {a}]
    ids = _sorted_expert_ids(block, rows)
    tables = [a for a in stops if ids is not None and _expert_table_read(a, ids, block.num_experts)]
    offsets = [a for a in stops if a not in tables]
    if len(offsets) != 1 or _shape(offsets[0]) != (block.num_experts,):
        raise AutoparError(f"autopar: the stacked experts at {describe_node(out)} depend on "
                           f"{[o.name for o in offsets]} besides the sorted tokens, the parameters and "
                           "per-expert parameters read at the sorted expert ids; expected one per-expert "
                           "offsets tensor. Use a plan with ep=1 and tp=1.")
    block.expert_ids = ids if tables else None
    _, used = extract_body(rows, offsets[0], out, ids=block.expert_ids)
    stacked = stacked + [t.args[0] for t in tables if t.args[0] not in stacked]
    if set(used) != {p.target for p in stacked}:
        raise AutoparError(f"autopar: the expert output {describe_node(out)} (the last per-row value before the "
                           f"routing weights) uses {sorted(used)}, not every stacked expert weight "
                           f"{sorted(p.target for p in stacked)}; expected the weights applied after the experts. "
                           "Use a plan with ep=1 and tp=1 for this model.")
    block.expert_params = [[p.target for p in sorted(stacked, key=_order)]]
    block.body_io = [(rows, offsets[0], out)]


def _sorted_expert_ids(block: MoEBlock, rows: Node) -> Node | None:
    """The expert of each sorted row, when the graph proves it: ``ids, order = sort(idx.flatten())``
    ascending, and the rows are ``x[order // k]``, so row ``r`` is token ``order[r] // k`` and
    its expert is ``idx.flatten()[order[r]] = ids[r]``.  Whatever order the sort gives equal keys,
    ``ids`` is the sorted key sequence, so the rewritten dispatch (its own stable sort, split over
    ranks) has the same ids per row: ``repeat_interleave(arange(E_local), counts)``."""
    pick = rows.args[1][0] if len(rows.args[1]) == 1 else None
    if not (isinstance(pick, Node) and pick.target in (aten.floor_divide.default, aten.div.Tensor_mode)
            and pick.args[1] == block.top_k and (pick.target is aten.floor_divide.default
                                                  or pick.kwargs.get("rounding_mode") == "floor")):
        return None
    positions = pick.args[0]
    if not (positions.target is operator.getitem and positions.args[1] == 1):
        return None
    sort = positions.args[0]
    if sort.target not in (aten.sort.default, aten.sort.stable) or _sort_descending(sort):
        return None
    flat = sort.args[0]
    if not (flat.target in RESHAPE_OPS and flat.args[0] is block.index and len(_shape(flat)) == 1):
        return None
    return next((u for u in sort.users if u.target is operator.getitem and u.args[1] == 0), None)


def _sort_descending(sort: Node) -> bool:
    """Whether an ``aten.sort`` sorts descending (``sort.default(x, dim, descending)``,
    ``sort.stable(x, *, stable, dim, descending)``)."""
    if sort.target is aten.sort.default and len(sort.args) > 2:
        return bool(sort.args[2])
    return bool(sort.kwargs.get("descending", False))


def _expert_table_read(node: Node, ids: Node, num_experts: int) -> bool:
    """``p[ids]``: a parameter of ``num_experts`` rows (a per-expert bias) read at the sorted
    rows' expert ids, so row ``r`` gets its own expert's row."""
    if node.target is not aten.index.Tensor or len(node.args[1]) != 1 or node.args[1][0] is not ids:
        return False
    table = node.args[0]
    return table.op == "get_attr" and len(_shape(table)) >= 1 and _shape(table)[0] == num_experts


def _modulelist_bodies(block: MoEBlock) -> None:
    for path in block.expert_modules:
        members = [n for n in block.region if in_module(n, path)]
        ins = {a for n in members for a in n.all_input_nodes if a not in members and a.op != "get_attr"}
        outs = [n for n in members if any(u not in members for u in n.users)]
        params = []
        for n in members:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and a.target not in params:
                    params.append(a.target)
        if len(ins) != 1 or len(outs) != 1:
            raise AutoparError(f"autopar: expert module '{path}' takes {len(ins)} tensors and returns {len(outs)}; "
                               "expected an expert that maps its tokens [n, hidden] to [n, hidden].")
        block.expert_params.append(params)
        block.body_io.append((next(iter(ins)), None, outs[0]))


def expert_width(block: MoEBlock) -> tuple[int, bool]:
    """(intermediate width, gated) of one expert, from its parameter count and its body's ops:
    a gated expert multiplies two projections of its tokens (``act(gate(x)) * up(x)``).  Per-expert
    tables read at the rows' expert ids (biases) are left out of the width."""
    body, _ = extract_body(*block.body_io[0], ids=block.expert_ids)
    gated = any(n.target == aten.mul.Tensor and all(isinstance(a, Node) and a.op != "get_attr" and
                                                   "offsets" not in a.name for a in n.args)
                for n in body.graph.nodes if n.op == "call_function")
    tables = {u.args[0] for u in (block.expert_ids.users if block.expert_ids is not None else ())
              if u.target is aten.index.Tensor and u.args[0].op == "get_attr"}
    table_numel = sum(t.meta["val"].numel() for t in tables) // block.num_experts
    return (block.expert_numel - table_numel) // ((3 if gated else 2) * block.hidden), gated
