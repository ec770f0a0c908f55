"""Pipeline pass: cut the rewritten training graph into ``num_chunks(plan)`` GraphModules.

Runs last (after TP / SP / shard propagation / DP, see ``passes/runner.py``), so every
chunk already carries its tensor-parallel collectives.  The cut follows decoder-layer
boundaries (``ctx.structure.layers``; a node belongs to the layer whose module path is in
its ``nn_module_stack``):

- chunk ``c`` holds a run of consecutive layers; the embedding (everything before the
  first layer that depends on a parameter) goes to chunk 0, the final norm, LM head and
  loss (everything after the last layer) to the last chunk;
- the layer counts per chunk come from the cost model (``cost/pipeline.py``
  ``place_layers``, with the head weighted by ``cost/estimate.py`` ``head_layers``), so
  the runtime and the cost model agree on what each rank holds; a user split overrides;
- values that depend on no parameter (positions, rotary tables, causal masks: functions
  of the input ids' shape and of buffers) are recomputed in every chunk that needs them
  instead of being sent, and values of parameters alone outside the layers (a norm's ``1 + w``)
  are computed in the first chunk that reads them, so only the hidden state crosses a boundary;
- under ZeRO-3 a unit's gather (``passes/zero.py``) and the parameters taken from it are
  treated as parameters: copied into the chunk that reads them, its unit's parameters
  counted as the chunk's;
- every chunk takes the model inputs and the target as keyword arguments
  (``in_0 .. in_{n-1}``, ``loss_target``): ``torch.distributed.pipelining`` passes the same
  keyword micro-batch to every stage, and the last chunk computes the loss in-graph (so a
  vocab-parallel loss keeps working); the schedule's ``loss_fn`` is the identity.

The result's ``pipeline`` is a :class:`PipelineProgram`; the runtime that drives it is
:mod:`autopar.runtime.stepping.pipelined`.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import sympy
import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils._sympy.functions import FloorDiv, Max, Min

from autopar.compat import sym_hint
from autopar.errors import AutoparError, describe_node
from autopar.ops.zero_gather import zero_gather
from autopar.plan import chunk_rank, chunks_per_rank, valid_microbatches
from .context import META_KEY, PassContext, PassResult, provenance

__all__ = ["PipelineChunk", "PipelineProgram", "pipeline_pass", "chunk_layer_counts", "chunk_rank",
           "num_chunks", "valid_microbatches", "TARGET_KWARG", "input_kwarg"]

TARGET_KWARG = "loss_target"  # not "target": schedule.step() takes that name itself


def input_kwarg(i: int) -> str:
    return f"in_{i}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineChunk:
    """One model chunk: layers ``layers`` (model order), run as ``gm(*acts, in_0=..., loss_target=...)``."""

    index: int
    layers: tuple[int, ...]
    gm: GraphModule
    num_act_inputs: int
    num_act_outputs: int  # 0 for the last chunk, which returns the loss
    params: tuple[str, ...]  # graph parameter names the chunk uses


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineProgram:
    schedule: str
    pp: int
    chunks: tuple[PipelineChunk, ...]
    kwarg_names: tuple[str, ...]  # model inputs then the target
    tied: str | None = None  # the embedding weight the LM head shares: used by the first and last chunk

    def chunk_rank(self, c: int) -> int:
        return chunk_rank(c, self.pp, self.schedule)

    def rank_chunks(self, pp_rank: int) -> list[int]:
        """The chunks pipeline rank ``pp_rank`` holds, in model order."""
        return [c for c in range(len(self.chunks)) if self.chunk_rank(c) == pp_rank]

    def param_chunk(self) -> dict[str, int]:
        """Parameter -> the first chunk that uses it (its owner; the tied weight's is chunk 0)."""
        out: dict[str, int] = {}
        for ch in self.chunks:
            for p in ch.params:
                out.setdefault(p, ch.index)
        return out

    def param_pp_ranks(self, name: str) -> tuple[int, ...]:
        """The pipeline ranks holding parameter ``name``: its owner's, and for the tied weight
        the last chunk's too (one rank under the V-shaped schedules, which place both there)."""
        pp_ranks = [self.chunk_rank(ch.index) for ch in self.chunks if name in ch.params]
        return tuple(dict.fromkeys(pp_ranks))

    def tied_pp_ranks(self) -> tuple[int, ...]:
        """The pipeline ranks whose copies of the tied weight sum their gradients (Megatron's
        embedding group); empty without a tied weight or when one rank holds both uses."""
        pp_ranks = self.param_pp_ranks(self.tied) if self.tied else ()
        return pp_ranks if len(pp_ranks) > 1 else ()


def num_chunks(plan) -> int:
    """Model chunks the plan cuts the model into: ``pp`` times the chunks per rank."""
    return plan.pp * chunks_per_rank(plan.schedule, plan.vpp)


# chunk_rank and valid_microbatches (re-exported here) are the shared rules of autopar.plan_space;
# a plan whose schedule does not run its micro-batches does not exist (Plan's construction).


# ---- layer placement ---------------------------------------------------------------------

def _spec(structure):
    """The cost model's view of the traced model (MoE layers included), as ModelSpec.from_module builds it."""
    from autopar.cost.spec import ModelSpec
    from autopar.frontend.model_dims import structure_dims

    dims = structure_dims(structure)
    if not dims["num_heads"]:
        # No SDPA op was found (eager attention: Gemma 2's soft-capped scores, BERT's encoder). The
        # placement only weighs the head against a layer, whose projections cost the same with the
        # hidden width as one head; the s^2 attention term is then left out of the balance.
        dims.update(num_heads=1, num_kv_heads=1, head_dim=dims["hidden"])
    if not dims["ffn"]:  # no MLP region recognised (BERT's is split over two modules): GPT's 4h
        dims["ffn"] = 4 * dims["hidden"]
    return ModelSpec(name="traced", **dims)


def chunk_layer_counts(structure, plan, seq_len: int, split: Sequence[int] | None = None) -> list[int]:
    """Layers per chunk: the user's ``split`` if given, else the cost model's balanced placement."""
    n = num_chunks(plan)
    num_layers = structure.num_layers
    if num_layers < n:
        per_rank = n // plan.pp
        options = []
        if per_rank > 1 and num_layers >= plan.pp:
            options.append(f"pp={plan.pp}:1f1b (one chunk per rank)")
        if num_layers // per_rank >= 2:
            options.append(f"pp={num_layers // per_rank}" + (f" with {per_rank} chunks per rank" if per_rank > 1 else ""))
        options.append("pp=1")
        raise AutoparError(
            f"autopar: plan '{plan}' cuts the model into {n} pipeline chunks but it has only "
            f"{num_layers} decoder layers (pp*chunks must be <= layers); use {' or '.join(options)}, "
            f"or a model with at least {n} layers.")
    if split is not None:
        split = [int(x) for x in split]
        if len(split) != n or sum(split) != num_layers or min(split) < 1:
            even = [num_layers // n] * (n - 1)
            raise AutoparError(
                f"autopar: pipeline split {split} must give each of the {n} chunks at least one layer "
                f"and sum to the model's {num_layers} layers (e.g. {even + [num_layers - sum(even)]}).")
        return split
    from autopar.cost.estimate import head_layers
    from autopar.cost.pipeline import place_layers

    return place_layers(num_layers, n, round(float(head_layers(_spec(structure), seq_len)), 3))


# ---- graph cutting -------------------------------------------------------------------------

def _layer_of(node: Node, layer_index: dict[str, int]) -> int | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in layer_index:
            return layer_index[path]
    return None


def _seq_len(gm: GraphModule) -> int:
    ph = next(n for n in gm.graph.nodes if n.op == "placeholder")
    val = ph.meta.get("val")
    if val is None or val.dim() < 2:
        return 1
    s = val.shape[1]
    return sym_hint(s)


def _gathers_params(n: Node) -> bool:
    """A ZeRO-3 gather of a unit (``passes/zero.py``) or one parameter taken from it."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return isinstance(n.args[0], Node) and _gathers_params(n.args[0])
    return n.target is zero_gather


def _assign(gm: GraphModule, structure, counts: list[int]):
    """(chunk of every non-free node, set of free nodes, param names)."""
    layer_index = {p: i for i, p in enumerate(structure.layers)}
    layer_chunk = [c for c, k in enumerate(counts) for _ in range(k)]
    params = {name for name, _ in gm.named_parameters()}
    free: set[Node] = set()
    chunk: dict[Node, int] = {}
    deferred: list[Node] = []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder" or (n.op == "get_attr" and n.target not in params):
            free.add(n)
            continue
        if n.op == "get_attr" or _gathers_params(n):
            continue  # parameters (ZeRO-3: their gathers) are copied into each chunk that reads them
        inputs = n.all_input_nodes
        if all(i in free for i in inputs):
            free.add(n)
            continue
        ins = [chunk[i] for i in inputs if i in chunk]
        layer = _layer_of(n, layer_index)
        if layer is None and not ins:
            deferred.append(n)  # reads only parameters and free values: placed with its users, below
            continue
        c = layer_chunk[layer] if layer is not None else max(ins)
        if ins and max(ins) > c:
            raise AutoparError(
                f"autopar: node '{n.name}' of layer {layer} reads a value computed in a later pipeline "
                f"chunk; the model's layers are not a chain the pipeline can cut. Use pp=1.")
        chunk[n] = c
    # A value of parameters alone outside the layers (Gemma 2's final-norm weight ``1 + w``) goes to
    # the first chunk that reads it, so that only activations cross a boundary.
    for n in reversed(deferred):
        chunk[n] = min((chunk[u] for u in n.users if u in chunk), default=0)
    return chunk, free, params


def _build_chunk(gm, c, last, chunk, free, params, boundary_in, boundary_out, kw_placeholders, out_node,
                 rebuilt: set, symbols: dict):
    """Chunk ``c``'s GraphModule and the parameters it reads; ``rebuilt``: the SymInts of earlier
    chunks it may read, written again from the inputs' sizes (``symbols``: :func:`_sizes_symbols`)."""
    g = Graph(owning_module=gm)  # dead-code elimination looks up called submodules (recomputed regions)
    env: dict[Node, Node] = {}
    for i, v in enumerate(boundary_in):
        env[v] = g.placeholder(f"act_{i}")
        env[v].meta = dict(v.meta)
    for ph, name in kw_placeholders:
        env[ph] = g.placeholder(name)
        env[ph].meta = dict(ph.meta)
    used_params: list[str] = []

    def need(x: Node) -> Node:
        if x in env:
            return env[x]
        if x.op == "get_attr":
            if x.target in params:
                used_params.append(x.target)
            env[x] = g.node_copy(x, need)
            return env[x]
        if x in rebuilt:
            env[x] = _rebuild_symint(g, x, symbols, env)
            return env[x]
        if _gathers_params(x):
            if x.target is zero_gather:  # ZeRO-3: the gathered unit's parameters
                used_params.extend(x.meta[META_KEY].params)
            env[x] = g.node_copy(x, need)
            return env[x]
        assert x in free, f"value {x.name} not available in chunk {c}"
        env[x] = g.node_copy(x, need)
        return env[x]

    for n in gm.graph.nodes:
        if chunk.get(n) == c:
            for i in n.all_input_nodes:
                need(i)
            env[n] = g.node_copy(n, need)
    if last:
        g.output(need(out_node))
    else:
        g.output(tuple(_contiguous(g, need(v), v) for v in boundary_out))
    g.eliminate_dead_code()
    return GraphModule(gm, g), tuple(dict.fromkeys(used_params))


def _contiguous(g: Graph, value: Node, traced: Node) -> Node:
    """``value`` as a contiguous tensor where the traced one is a strided view (a transpose a
    layer returns as is): torch's pipelining sends it, and receives into a buffer of the same
    strides, and gloo sends and receives contiguous buffers only.  ``aten.contiguous`` copies
    nothing when the tensor is contiguous already."""
    val = traced.meta.get("val")
    try:
        contiguous = not isinstance(val, torch.Tensor) or bool(val.is_contiguous())
    except Exception:  # noqa: BLE001 - strides that depend on symbols: make sure
        contiguous = False
    if contiguous:
        return value
    node = g.call_function(torch.ops.aten.contiguous.default, (value,))
    node.meta = {k: v for k, v in traced.meta.items() if k != META_KEY}
    node.meta["val"] = val.contiguous()
    return provenance(node, "pipeline", "pp", "a strided activation made contiguous before it is sent")


def _check_tensors_cross(boundaries: list[list[Node]], rebuilt: set[Node]) -> None:
    """torch.distributed.pipelining sends tensors only between stages.  A SymInt a layer computes
    from sizes (DeepSeek-V3.2's ``min(index_topk, seq)``, which later layers reuse) is rebuilt in
    each later chunk from its inputs' sizes (``rebuilt``, :func:`_rebuild_symint`); any other
    Python number crossing a cut would fail in the first step, so it is refused here."""
    for k, values in enumerate(boundaries):
        for v in values:
            if not isinstance(v.meta.get("val"), torch.Tensor) and v not in rebuilt:
                raise AutoparError(
                    f"autopar: a value that is not a tensor ({type(v.meta.get('val')).__name__}) crosses pipeline "
                    f"boundary {k} at {describe_node(v)}, and its value is not a function of the sizes of the "
                    "model inputs; expected only tensors between pipeline stages "
                    "(torch.distributed.pipelining sends tensors). Use pp=1 for this model, or a "
                    "pipeline_split that keeps the layers using it in one chunk.")


def _sizes_symbols(placeholders: Sequence[Node]) -> dict:
    """Each size symbol of the model inputs -> (placeholder, dim) that holds it."""
    found = {}
    for ph in placeholders:
        val = ph.meta.get("val")
        for d, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            if expr is not None and expr.is_Symbol:
                found.setdefault(expr, (ph, d))
    return found


def _rebuildable(v: Node, symbols: dict) -> bool:
    """A SymInt whose expression :func:`_emit_expr` can write over the inputs' size symbols."""
    val = v.meta.get("val")
    if not isinstance(val, torch.SymInt):
        return False
    expr = val.node.expr
    return expr.free_symbols <= set(symbols) and _emittable(expr)


def _emittable(expr) -> bool:
    if expr.is_Integer or expr.is_Symbol:
        return True
    return isinstance(expr, (sympy.Add, sympy.Mul, Min, Max, FloorDiv)) and all(_emittable(a) for a in expr.args)


def _emit_expr(g: Graph, expr, size_of):
    """FX nodes computing the integer ``expr``; ``size_of(symbol)`` gives a symbol's node."""
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return size_of(expr)
    args = [_emit_expr(g, a, size_of) for a in expr.args]
    if isinstance(expr, FloorDiv):
        return g.call_function(operator.floordiv, tuple(args))
    fn = {sympy.Add: operator.add, sympy.Mul: operator.mul, Min: torch.sym_min, Max: torch.sym_max}[expr.func]
    value = args[0]
    for a in args[1:]:
        value = g.call_function(fn, (value, a))
    return value


def _rebuild_symint(g: Graph, v: Node, symbols: dict, env: dict) -> Node:
    """``v`` (a SymInt computed in an earlier chunk) recomputed from this chunk's input sizes."""
    sizes: dict = {}

    def size_of(symbol):
        if symbol not in sizes:
            ph, d = symbols[symbol]
            sizes[symbol] = g.call_function(torch.ops.aten.sym_size.int, (env[ph], d))
        return sizes[symbol]

    before = set(g.nodes)
    out = _emit_expr(g, v.meta["val"].node.expr, size_of)
    if not isinstance(out, Node):  # the expression folded to a constant
        return out
    for n in g.nodes:
        if n not in before:
            provenance(n, "pipeline", "pp", f"'{v.name}' (a size an earlier chunk computed) rebuilt from the "
                                            "inputs' sizes instead of sent")
    out.meta["val"] = v.meta["val"]
    return out


def pipeline_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    """Cut ``gm`` into ``result.pipeline`` (a :class:`PipelineProgram`); ``gm`` itself is unchanged."""
    plan = ctx.plan
    result = PassResult("pipeline_pass")
    counts = chunk_layer_counts(ctx.structure, plan, _seq_len(gm), ctx.pipeline_split)
    # A tied LM head: the last chunk holds a copy of the embedding weight, and the copies' gradients
    # are summed every step (the runtime's embedding group, as Megatron-Core does).
    tied = ctx.structure.lm_head.weight if ctx.structure.tied_embeddings and ctx.structure.lm_head else None
    chunk, free, params = _assign(gm, ctx.structure, counts)
    last = len(counts) - 1  # the last chunk's index
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [input_kwarg(i) for i in range(ctx.num_inputs)] + [TARGET_KWARG]
    names = names[:len(placeholders)]
    kw = list(zip(placeholders, names))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    loss = out.args[0]
    while isinstance(loss, (tuple, list)):
        assert len(loss) == 1, "the training graph returns one loss"
        loss = loss[0]
    # Values live across boundary k (between chunk k and k + 1), in graph order.
    last_use: dict[Node, int] = {}
    for n in gm.graph.nodes:
        user_chunks = [chunk[u] for u in n.users if u in chunk] + ([last] if n is loss else [])
        if n in chunk and user_chunks:
            last_use[n] = max(user_chunks)
    crossing = [[v for v in gm.graph.nodes if v in chunk and chunk[v] <= k < last_use.get(v, -1)]
                for k in range(last)]
    symbols = _sizes_symbols(placeholders)
    rebuilt = {v for values in crossing for v in values if _rebuildable(v, symbols)}
    _check_tensors_cross(crossing, rebuilt)
    boundaries = [[v for v in values if v not in rebuilt] for values in crossing]
    param_owner: dict[str, int] = {}
    chunks = []
    start = 0
    for c in range(last + 1):
        b_in = boundaries[c - 1] if c > 0 else []
        b_out = boundaries[c] if c < last else []
        cgm, used = _build_chunk(gm, c, c == last, chunk, free, params, b_in, b_out, kw, loss,
                                 {v for v in rebuilt if chunk[v] < c}, symbols)
        for p in used:
            if param_owner.setdefault(p, c) != c and not (p == tied and c == last):
                raise AutoparError(
                    f"autopar: parameter '{p}' is used by pipeline chunks {param_owner[p]} and {c}; "
                    "shared weights across stages are not supported, use pp=1 or untie them.")
        chunks.append(PipelineChunk(index=c, layers=tuple(range(start, start + counts[c])), gm=cgm,
                                    num_act_inputs=len(b_in), num_act_outputs=len(b_out), params=used))
        start += counts[c]
        result.notes.append(f"chunk {c} (rank {chunk_rank(c, plan.pp, plan.schedule)}): layers "
                            f"{list(chunks[-1].layers)}, {len(b_in)} activation input(s), {len(used)} parameters")
    result.pipeline = PipelineProgram(schedule=plan.schedule, pp=plan.pp, chunks=tuple(chunks),
                                      kwarg_names=tuple(names), tied=tied)
    if tied:
        result.notes.append(f"tied weight {tied}: held by pipeline ranks {list(result.pipeline.param_pp_ranks(tied))}")
    return result
