"""The lambdified cost model: every formula lambdified once, evaluated on arrays of plans.

``model_formulas(activation_formula, full)`` gathers the per-pp-rank formulas of flops.py,
memory.py, comm.py and time.py into one list, lambdifies it once (numpy, common
subexpressions shared) and caches it, in the process and on disk (cache.py: the
generated numpy source, keyed by a hash of the cost model's sources and the sympy and
numpy versions, so that a warm process neither builds nor lambdifies a formula).
``evaluate`` fills the symbols with numbers -- model and hardware as scalars, plans (and
the pipeline rank being scored) as arrays -- and returns one array per output.
``estimate.py`` scores one plan on every pipeline rank (with ``full``: every memory term, the
step's FLOPs as torch's FlopCounterMode counts them, flops.py ``counted_flops``, and every row), :mod:`autopar.planning.search` millions
of (plan, rank) pairs in a few calls; sympy is never called per candidate.  Plans arrive encoded
(:func:`autopar.plan_space.encode`); :func:`plan_values` turns the codes into the formulas' 0/1
indicators, and link figures come per axis of :data:`autopar.plan_space.GROUP_AXES`.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import sympy

from autopar.plan_space import GROUP_AXES, SCHEDULES, among, grads_kept

from . import cache as _cache
from . import symbols
from .comm import RowSpec, row_specs
from .hardware import Cluster, axis_link_arrays
from .flops import counted_flops
from .memory import memory_terms, peak_memory, peak_parts, precision_bytes
from .pipeline import T_b, T_f, T_w, bubble_expr
from .time import CALIBRATED, compute_terms, exposure, optimizer_time, row_time

__all__ = ["Formulas", "RowInfo", "model_formulas", "memory_formulas", "compute_formulas",
           "model_values", "plan_values", "link_values", "evaluate", "step_time_arrays", "shared_host_step"]

_NP_FUNCTIONS = {"Max": lambda *x: functools.reduce(np.maximum, x),
                 "Min": lambda *x: functools.reduce(np.minimum, x)}
_NP_MODULES = [_NP_FUNCTIONS, "numpy"]

# (rows, output names, output formulas) of one lambdified variant
Outputs = tuple[list[RowSpec], list[str], list[sympy.Expr]]


@dataclass(frozen=True)
class RowInfo:
    """A collective kind of ``comm.row_specs()`` without its formulas (outputs ``row{i}.*`` carry them)."""

    phase: str
    dimension: str
    collective: str
    axis: str
    per_mb: bool
    what: str
    routed: bool = False


@dataclass
class Formulas:
    """Output names, input symbol names and the numpy function of one lambdified variant.

    ``exprs`` (the sympy formulas, one per output) are built on first use when the
    function came from the disk cache."""

    rows: list[RowInfo]
    names: list[str]
    input_names: list[str]
    fn: object
    bubble_fns: dict
    _outputs: Callable[[], Outputs] = field(repr=False)
    _exprs: list | None = field(default=None, repr=False)

    @property
    def exprs(self) -> list[sympy.Expr]:
        if self._exprs is None:
            self._exprs = self._outputs()[2]
        return self._exprs


def _lambdified(entry: str, outputs: Callable[[], Outputs], bubbles: bool = False) -> Formulas:
    """``outputs()`` lambdified (with each schedule's bubble formula if ``bubbles``), through the disk cache."""
    key = _cache.source_key()
    stored = _cache.load(entry, key)
    if stored is not None:
        try:
            fns = _cache.load_functions(stored["functions"], _NP_FUNCTIONS)
            return Formulas([RowInfo(*row) for row in stored["rows"]], stored["names"], stored["inputs"],
                            fns.pop("fn"), {name[len("bubble."):]: fn for name, fn in fns.items()}, outputs)
        except Exception:  # noqa: BLE001 -- a foreign or damaged entry: lambdify instead
            pass
    rows, names, exprs = outputs()
    inputs = sorted(set().union(*(e.free_symbols for e in exprs)), key=lambda x: x.name)
    fns = {"fn": sympy.lambdify(inputs, exprs, modules=_NP_MODULES, cse=True)}
    if bubbles:
        fns.update({f"bubble.{name}": sympy.lambdify([T_f, T_b, T_w, symbols.pp, symbols.vpp], bubble_expr(name),
                                                  modules=_NP_MODULES) for name in SCHEDULES})
    info = [RowInfo(r.phase, r.dimension, r.collective, r.axis, r.per_mb, r.what, r.routed) for r in rows]
    model = Formulas(info, names, [x.name for x in inputs], fns["fn"],
                     {name[len("bubble."):]: fn for name, fn in fns.items() if name != "fn"}, outputs, exprs)
    functions = _cache.dump_functions(fns, _NP_FUNCTIONS)
    if functions is not None:
        _cache.store(entry, key, {"rows": [list(vars(r).values()) for r in info], "names": names,
                                  "inputs": model.input_names, "functions": functions})
    return model


def _memory_outputs(activation_formula: str) -> Outputs:
    return [], ["memory"], [sympy.sympify(peak_memory(memory_terms(activation_formula)))]


@functools.lru_cache(maxsize=8)
def memory_formulas(activation_formula: str = "derived") -> Formulas:
    """Only the memory total (search prunes with it before scoring time)."""
    return _lambdified(f"memory-{activation_formula}", functools.partial(_memory_outputs, activation_formula))


def _compute_outputs() -> Outputs:
    comp = compute_terms()
    return [], ["T_f", "T_b", "T_w"], [sympy.sympify(comp[k]) for k in ("fwd", "bwd", "wgrad")]


@functools.lru_cache(maxsize=2)
def compute_formulas() -> Formulas:
    """Only compute time per micro-batch (T_f, T_b without communication): a lower bound for search."""
    return _lambdified("compute", _compute_outputs)


def _model_outputs(activation_formula: str, full: bool) -> Outputs:
    rows = row_specs()
    comp = compute_terms()
    exposed = {"fwd": sympy.Integer(0), "bwd": sympy.Integer(0), "step": sympy.Integer(0)}
    row_outputs: list[tuple[str, sympy.Expr]] = []
    for i, row in enumerate(rows):
        t = row.count * row_time(row)             # per micro-batch (per_mb) or per step
        if row.latency is not None:  # the latency of ``row.latency`` calls only (comm.RowSpec.latency)
            t += (row.latency - row.count) * row_time(dataclasses.replace(row, sent=sympy.Integer(0)))
        exp_t = exposure(row, t, comp)
        key = row.phase if (row.per_mb and row.phase in ("fwd", "bwd")) else "step"
        exposed[key] += exp_t
        if full:
            mult = symbols.m if row.per_mb else 1
            row_outputs += [(f"row{i}.count", row.count * mult), (f"row{i}.group", row.group),
                            (f"row{i}.sent", row.sent), (f"row{i}.recv", row.recv),
                            (f"row{i}.time", t * mult), (f"row{i}.exposed", exp_t * mult)]
    mem = memory_terms(activation_formula)
    outputs: list[tuple[str, sympy.Expr]] = [
        ("T_f", comp["fwd"] + exposed["fwd"]),
        ("T_b", comp["bwd"] + exposed["bwd"]),
        ("T_w", comp["wgrad"]),
        ("step_comm", exposed["step"]),
        ("optimizer", optimizer_time()),
        ("memory", peak_memory(mem)),
    ]
    if full:
        outputs += [(name, expr) for name, expr in comp.items()]
        outputs += [("exposed.fwd", exposed["fwd"]), ("exposed.bwd", exposed["bwd"])]
        outputs += [(f"memory.{name}", expr) for name, expr in mem.items()]
        outputs += [(f"peak.{moment}.{name}", expr) for moment, parts in peak_parts(mem).items()
                    for name, expr in parts.items()]
        flops = counted_flops()
        outputs += [("flops", sum(flops.values()))] + [(f"flops.{name}", expr) for name, expr in flops.items()]
        outputs += row_outputs
    return rows, [n for n, _ in outputs], [sympy.sympify(e) for _, e in outputs]


@functools.lru_cache(maxsize=8)
def model_formulas(activation_formula: str = "derived", full: bool = False) -> Formulas:
    """The whole model's formulas: step-time parts and memory (``full``: every term and row too)."""
    return _lambdified(f"model-{activation_formula}-{'full' if full else 'search'}",
                       functools.partial(_model_outputs, activation_formula, full), bubbles=True)


def model_values(spec, *, dtype_bytes: int, grad_bytes: int | None, routing_imbalance: float,
                 seq_len: int, flash_attention: bool = True) -> dict[str, float]:
    """Scalar values of the model and precision symbols."""
    vals = {
        "S": seq_len, "H": spec.hidden, "a": spec.num_heads, "g": spec.num_kv_heads,
        "d": spec.head_dim, "F": spec.ffn, "F_e": spec.moe_ffn or 1, "V": spec.vocab,
        # Dense models: the MoE symbols only ever meet l_e = 0; 1 keeps every term finite.
        "E": max(spec.num_experts, 1), "k": max(spec.top_k, 1), "w": dtype_bytes,
        "n_sh": spec.num_shared_experts, "shared_gate": int(spec.shared_expert_gate), "n_norm": spec.norm_vectors, "q_b": int(spec.qkv_bias), "qk_norm": int(spec.qk_norm),
        "aux_loss": int(spec.router_aux_loss and spec.num_experts > 0), "qk_head_norm": int(spec.qk_head_norm),
        "fused_qkv": int(spec.fused_qkv),
        "mla": int(spec.kv_lora_rank > 0), "l_q": int(spec.q_lora_rank > 0), "r_q": spec.q_lora_rank,
        "r_kv": spec.kv_lora_rank, "d_r": spec.qk_rope_head_dim, "d_v": spec.v_dim,
        "gated": int(spec.gated_mlp), "L": spec.num_layers, "L_e": max(spec.num_moe_layers, 1),
        "tied": int(spec.tied_embeddings), "norm_offset": int(spec.norm_weight_offset),
        "x_ew": spec.elementwise_factor, "rho": routing_imbalance, "flash": int(flash_attention),
        "n_ln": spec.layer_norms, "p_b": int(spec.proj_bias), "P_emb": spec.embedding_extra_params,
        "emb_norm": int(spec.embedding_norm), "P_head": spec.head_extra_params, "head_bias": int(spec.lm_head_bias),
        "gathered_logits": int(spec.gathered_logits), "n_cs": spec.seq_cumsums,
        "c_cs": spec.seq_cumsum_bytes / max(spec.seq_cumsums, 1), "g_cp": spec.cp_kv_heads,
    }
    vals.update(precision_bytes(dtype_bytes, grad_bytes))
    return vals


def link_values(cluster: Cluster, tp, cp, dp, pp, ep, epsilon: float) -> dict[str, np.ndarray]:
    """Values of every link symbol (seconds per byte / per pass, per axis) for arrays of plans."""
    vals = {}
    for axis in GROUP_AXES:
        br, ba, ar, aa = axis_link_arrays(cluster, axis, tp, cp, dp, pp, ep, epsilon)
        for (beta, alpha), (bv, av) in ((symbols.link_symbols(axis, "ring"), (br, ar)),
                                        (symbols.link_symbols(axis, "a2a"), (ba, aa))):
            vals[beta.name], vals[alpha.name] = bv, av
    return vals


def plan_values(cluster: Cluster, arrays: dict[str, np.ndarray], *, constants: dict,
                tp_comm_overlap: bool, zero_overlap: bool = True, capacity=None,
                links: dict | None = None) -> dict[str, np.ndarray]:
    """Plan, view and hardware symbol values from integer-coded plan arrays.

    ``arrays`` keys: the encoded plan (:data:`autopar.plan_space.PLAN_COLUMNS`), ``b`` (the
    micro-batch size), the view: ld le first last nsend nrecv infl, and the rank's gradient
    buckets (``buckets.py``): nbd nud nbe nue umx.
    """
    A = arrays
    zero, rec, cpv, sched = A["zero"], A["recompute"], A["cp_variant"], A["schedule"]
    vals = {
        "tp": A["tp"], "dp": A["dp"], "cp": A["cp"], "pp": A["pp"], "ep": A["ep"], "v": A["vpp"],
        "m": A["m"], "b": A["b"], "sp": A["sp"],
        "r_sel": among(rec, "recompute", ("selective",)) * 1.0,
        "r_full": among(rec, "recompute", ("full",)) * 1.0,
        "z_1": (zero >= 1) * 1.0, "z_2": (zero >= 2) * 1.0, "z_3": (zero == 3) * 1.0,
        "cp_ring": (among(cpv, "cp_variant", ("ring",)) & (A["cp"] > 1)) * 1.0,
        "cp_ag": among(cpv, "cp_variant", ("allgather",)) * 1.0,
        "cp_ul": among(cpv, "cp_variant", ("ulysses",)) * 1.0,
        "first": A["first"], "last": A["last"], "n_inflight": A["infl"],
        "n_send": A["nsend"], "n_recv": A["nrecv"], "l_d": A["ld"], "l_e": A["le"],
        "n_bd": A["nbd"], "n_ud": A["nud"], "n_be": A["nbe"], "n_ue": A["nue"], "u_max": A["umx"],
        "keep": grads_kept(zero, A["dp"], A["cp"]) * 1.0,
        "c_bk": 1.0 if cluster.backend_copies else 0.0,
        "tp_overlap": 1.0 if tp_comm_overlap else 0.0,
        "zero_overlap": 1.0 if zero_overlap else 0.0,
        "dualpipe": among(sched, "schedule", ("dualpipev",)) * 1.0,
        "P_peak": cluster.peak_flops, "B_hbm": cluster.hbm_bandwidth,
        "B_ew": cluster.elementwise_bandwidth or cluster.hbm_bandwidth,
        "B_opt": cluster.optimizer_bandwidth or cluster.hbm_bandwidth,
        **ring_factors(cluster), "x_attn": cluster.attention_factor or 1.0,
        "eta_max": constants.get("eta_max") or cluster.gemm_efficiency, "kappa": constants["kappa"],
        # A measured profile's overlap (autopar calibrate) replaces the phi fitted to published runs.
        "epsilon": constants["epsilon"],
        "phi": constants["phi"] if cluster.comm_overlap is None else cluster.comm_overlap,
    }
    if capacity is not None:
        vals["rho"] = capacity
    if links is None:
        links = link_values(cluster, A["tp"], A["cp"], A["dp"], A["pp"], A["ep"], constants["epsilon"])
    vals.update(links)
    return vals


def ring_factors(cluster: Cluster) -> dict[str, float]:
    """Each ring collective's seconds per byte over the link's ring rate (symbols.RING_FACTORS): the
    cluster's intra-node bandwidth over the collective's own, measured (1 without one)."""
    ring = cluster.intra_node_bandwidth
    own = {"all_reduce": cluster.all_reduce_bandwidth, "all_gather": cluster.all_gather_bandwidth,
           "reduce_scatter": cluster.reduce_scatter_bandwidth}
    return {symbols.RING_FACTORS[c].name: ring / (b or ring) for c, b in own.items()}


def evaluate(model: Formulas, values: dict) -> dict[str, np.ndarray]:
    args = []
    for name in model.input_names:
        if name not in values:
            raise KeyError(f"cost model input {name!r} has no value")
        args.append(values[name])
    if not args:
        return {}
    sizes = [np.size(v) for v in args if np.ndim(v)]
    size = (0 if 0 in sizes else max(sizes)) if sizes else 1
    # Scalars stay scalars so that model-only subexpressions are computed once.
    args = [np.asarray(v, dtype=np.float64) if np.ndim(v) else float(v) for v in args]
    out = model.fn(*args)
    return {name: np.broadcast_to(np.asarray(v, dtype=np.float64), (size,))
            for name, v in zip(model.names, out)}


def shared_host_step(step, busy, core_share: float):
    """The step where ranks time-share a host's cores (``core_share`` < 1, each rate already scaled
    by it): a rank idle in the pipeline bubble leaves its share to the others, so the step is the
    longer of the critical path at full speed and the work the host runs at its share, the ranks'
    mean busy time (``busy``: the step less the bubble, with the pipeline ranks' mean compute):

        step' = max(core_share * step, busy)      (= step where core_share = 1 and busy <= step)"""
    return np.maximum(core_share * step, np.minimum(busy, step))


def step_time_arrays(model: Formulas, schedule_codes, tf, tb, tw, pp, vpp, m):
    """m (T_f + T_b) + bubble, with each schedule's bubble formula (vectorised)."""
    bubble = np.zeros(np.shape(tf))
    for code, name in enumerate(SCHEDULES):
        sel = schedule_codes == code
        if np.any(sel):
            bubble[sel] = np.broadcast_to(
                model.bubble_fns[name](tf[sel], tb[sel], tw[sel], pp[sel], vpp[sel]), (int(sel.sum()),))
    return m * (tf + tb) + bubble, bubble


DEFAULT_CONSTANTS = dict(CALIBRATED)
