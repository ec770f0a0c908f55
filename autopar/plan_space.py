"""The plan space: its one home.  Which plans exist, which are valid, which the runtime runs.

Everything that more than one part of autopar knows about plans is written here once:

* the option names (:data:`SCHEDULES`, :data:`CP_VARIANTS`, :data:`RECOMPUTE_MODES`,
  :data:`ZERO_STAGES`) and the integer plan encoding (:func:`encode` / :func:`decode`: a name
  is coded as its index in the tuple that lists it) that the cost model and the search store
  plans in;
* the mesh layout: :data:`MESH_AXES` ``pp x dp x cp x tp`` (outer to inner, tp fastest), the
  derived axes (``dp_cp``, ``ep``, ``edp``), their strides (:func:`axis_digits`,
  :func:`axis_geometry`) and rank groups (:func:`axis_groups`);
* every rule about which plans are valid and which the runtime runs, each one predicate:
  the rules of a plan alone (``Plan``'s construction), of a plan against a model and a run
  (:meth:`autopar.plan.Plan.validate`, the cost model, the search), of what the runtime runs
  (:data:`RUNTIME_RULES`, asked by :mod:`autopar.support`), and of what the search prices;
* :func:`divisors` and the enumeration of candidates (:func:`structures`, :func:`candidates`);
* how gradients are packed into the buckets of their collectives (:func:`pack_buckets`,
  :data:`DEFAULT_BUCKET_BYTES`): the data-parallel pass packs them, the cost model counts them.

Asking it: ``Plan`` (construction and ``validate``), :mod:`autopar.support` (hence
``parallelize``), the search (:mod:`autopar.planning.search`) and ``plan="auto"``
(:mod:`autopar.planning.autoplan`), the cost model (``autopar.cost``), the mesh
(:mod:`autopar.runtime.mesh`) and the CLI.  Nothing else states a rule.

A predicate takes numbers and returns whether the plan passes (True) or, for a runtime rule,
whether the runtime refuses it.  It uses only arithmetic, comparisons, ``&`` and ``|`` on its
arguments, so the same function takes Python ints (one plan: ``encode(plan)``) and numpy
integer arrays (the search's columns of candidates; the result is then a boolean array).
Names are compared through their codes (:func:`among`).

Torch-free and numpy-free: the offline tools import it.
"""
from __future__ import annotations

import itertools

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

from autopar.errors import AutoparError

__all__ = [
    # names and codes
    "CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "ZERO_STAGES", "V_SCHEDULES", "MULTI_CHUNK_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES", "INTERLEAVED_VPP", "code", "among", "encode", "decode", "PLAN_COLUMNS",
    # layout
    "MESH_AXES", "GROUP_AXES", "data_axis", "axis_digits", "axis_geometry", "axis_groups",
    # chunks and micro-batches
    "chunks_per_rank", "chunk_rank", "microbatches_ok", "valid_microbatches", "check_microbatches",
    # rules of a plan alone, and of a plan against a model and a run
    "sp_ok", "ep_ok", "heads_ok", "kv_replicated", "kv_cp_ok", "ulysses_heads_ok", "ulysses_fits",
    "ulysses_ok", "layers_ok",
    "experts_ok", "batch_ok", "cp_seq_ok", "sp_seq_ok", "model_facts",
    # what the runtime runs
    "Rule", "RUNTIME_RULES", "moe_rewritten", "split_backward", "runtime_refusals", "runnable",
    "supported_summary",
    # what the search prices, and enumeration
    "zero_meaningful", "interleaved_priced", "divisors", "STRUCTURE_FIELDS", "structures", "candidates",
    # gradient buckets, and how the runtime holds gradients
    "DEFAULT_BUCKET_BYTES", "pack_buckets", "grads_kept", "ZERO_SCATTERS_IN_FLIGHT",
]

# ---- names and their integer codes ----------------------------------------------------------

CP_VARIANTS = ("ring", "allgather", "ulysses")
"""Context-parallel attention variants (``cp=N:<variant>``)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")
"""Pipeline schedules (``pp=N:<schedule>``)."""
RECOMPUTE_MODES = ("none", "selective", "full")
"""Activation recomputation modes (``recompute=<mode>``)."""
ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages (``zero=<stage>``)."""
V_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that run exactly two model chunks per rank, placed in a "V"."""
MULTI_CHUNK_SCHEDULES = ("interleaved",) + V_SCHEDULES
"""Schedules that hold several model chunks per rank (the others hold one)."""
SPLIT_BACKWARD_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that split a backward into input gradients, then weight gradients: two autograd
passes per chunk and micro-batch (each recomputes a checkpointed region again)."""
INTERLEAVED_VPP = (2, 3, 4, 5, 6, 8)
"""The chunks per rank the search tries for the interleaved schedule."""

_NAMES = {"schedule": SCHEDULES, "cp_variant": CP_VARIANTS, "recompute": RECOMPUTE_MODES}

PLAN_COLUMNS = ("tp", "dp", "cp", "pp", "ep", "vpp", "m", "sp", "zero", "recompute", "cp_variant", "schedule")
"""The integer columns of an encoded plan (:func:`encode`): the degrees, ``vpp`` the model
chunks per pipeline rank, ``m`` the micro-batches per step, ``sp`` 0/1, ``zero`` the stage,
and the codes of the recompute mode, CP variant and schedule."""


def code(field: str, name: str) -> int:
    """The integer code of ``name`` for ``field`` (``schedule``, ``cp_variant``, ``recompute``)."""
    return _NAMES[field].index(name)


def among(column, field: str, names):
    """Whether the codes in ``column`` are one of ``names`` of ``field`` (int or array)."""
    hit = column != column  # False, or an all-False array
    for name in names:
        hit = hit | (column == code(field, name))
    return hit


def encode(plan) -> dict[str, int]:
    """A plan's integer columns (:data:`PLAN_COLUMNS`), as the cost model and search store plans."""
    return dict(tp=plan.tp, dp=plan.dp, cp=plan.cp, pp=plan.pp, ep=plan.ep,
                vpp=chunks_per_rank(plan.schedule, plan.vpp), m=plan.mb, sp=int(plan.sp), zero=plan.zero,
                recompute=code("recompute", plan.recompute), cp_variant=code("cp_variant", plan.cp_variant),
                schedule=code("schedule", plan.schedule))


def decode(columns: Mapping, i: int | None = None) -> dict:
    """The ``Plan(...)`` fields of row ``i`` of encoded ``columns`` (of ``columns`` itself for
    scalars): the inverse of :func:`encode`."""
    def get(name):
        value = columns[name] if i is None else columns[name][i]
        return int(value)

    schedule = SCHEDULES[get("schedule")]
    return dict(dp=get("dp"), tp=get("tp"), sp=bool(get("sp")), cp=get("cp"),
                cp_variant=CP_VARIANTS[get("cp_variant")], ep=get("ep"), pp=get("pp"), schedule=schedule,
                vpp=get("vpp") if schedule in MULTI_CHUNK_SCHEDULES else 1, mb=get("m"), zero=get("zero"),
                recompute=RECOMPUTE_MODES[get("recompute")])


# ---- the mesh layout ------------------------------------------------------------------------

MESH_AXES = ("pp", "dp", "cp", "tp")
"""The mesh axes, outer to inner: tp varies fastest, so consecutive ranks (one node, NVLink)
form the tp groups (docs/architecture.md, "Mesh and ranks")."""
GROUP_AXES = MESH_AXES + ("dp_cp", "ep", "edp")
"""Every axis a collective runs on: the mesh axes and the derived ones -- ``dp_cp`` (the
``dp * cp`` ranks holding copies of the dense weights), ``ep`` (experts split over ``ep``
consecutive ``dp * cp`` indices of one stage and tp index) and ``edp`` (the ranks holding the
same experts: the other ``dp * cp / ep`` token slices times tp)."""


def data_axis(cp) -> str:
    """The axis over which the ranks holding different tokens of one model replica meet (the
    dense weights' gradient reduction, the loss mean, ZeRO's shards): ``dp_cp`` under context
    parallelism, else ``dp`` (the same ranks when ``cp == 1``; torch builds one group fewer)."""
    return "dp_cp" if cp > 1 else "dp"


def axis_digits(axis: str, *, pp, dp, cp, tp, ep=1) -> tuple[tuple, ...]:
    """The rank digits ``axis`` spans, outer to inner, as ``(stride, size)`` pairs.

    A rank is ``((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``; its ``dp * cp`` index splits
    again into ``dp * cp / ep`` expert replicas times ``ep``.  A group of ``axis`` is the ranks
    that differ only in these digits.  The degrees may be numpy arrays."""
    return {
        "tp": ((1, tp),),
        "cp": ((tp, cp),),
        "dp": ((tp * cp, dp),),
        "pp": ((tp * cp * dp, pp),),
        "dp_cp": ((tp, dp * cp),),
        "ep": ((tp, ep),),
        "edp": ((tp * ep, dp * cp // ep), (1, tp)),
    }[axis]


def axis_geometry(axis: str, *, pp, dp, cp, tp, ep=1):
    """(stride, size) of ``axis``'s outermost digit, which sets its links: the ``edp`` ranks of one
    expert replica's tp digit are adjacent, its ``dp * cp / ep`` replicas sit at stride ``tp * ep``."""
    return axis_digits(axis, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)[0]


def axis_groups(axis: str, *, pp: int, dp: int, cp: int, tp: int, ep: int = 1) -> list[list[int]]:
    """The rank groups of ``axis``, each ascending, in the order of their first rank (every rank
    builds them in this same order)."""
    offsets = [0]
    for stride, size in axis_digits(axis, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep):
        offsets = [o + i * stride for o in offsets for i in range(size)]
    offsets.sort()
    seen: set[int] = set()
    groups = []
    for rank in range(pp * dp * cp * tp):
        if rank not in seen:  # the smallest rank not yet grouped is its group's first
            group = [rank + o for o in offsets]
            seen.update(group)
            groups.append(group)
    return groups


# ---- model chunks and micro-batches ---------------------------------------------------------

def chunks_per_rank(schedule: str, vpp: int) -> int:
    """Model chunks each pipeline rank holds: ``vpp`` for interleaved, 2 for zbv and
    dualpipev (the V shape), else 1."""
    if schedule == "interleaved":
        return vpp
    return 2 if schedule in V_SCHEDULES else 1


def chunk_rank(c: int, pp: int, schedule: str) -> int:
    """Pipeline rank of model chunk ``c``: looped (``c % pp``), or for zbv / dualpipev
    V-shaped (rank ``c`` going down, ``2pp - 1 - c`` coming back, so rank 0 holds the first
    and the last chunk)."""
    if schedule in V_SCHEDULES:
        return c if c < pp else 2 * pp - 1 - c
    return c % pp


def microbatches_ok(schedule, pp, mb):
    """Whether ``schedule`` (a name or a code) on ``pp`` stages runs ``mb`` micro-batches per
    step (torch.distributed.pipelining 2.13).

    At least one micro-batch; with ``pp > 1``: 1f1b needs ``mb >= pp``; interleaved a multiple
    of its rounds (``max(1, mb // pp)``, as torch's ScheduleInterleaved1F1B runs them);
    dualpipev ``mb >= 2 pp`` (one per chunk); gpipe and zbv run any count.
    """
    s = code("schedule", schedule) if isinstance(schedule, str) else schedule
    rounds = mb // pp
    rounds = rounds + (rounds == 0)  # max(1, mb // pp), for ints and arrays alike
    short = (among(s, "schedule", ("1f1b",)) & (mb < pp)) \
        | (among(s, "schedule", ("interleaved",)) & (mb % rounds != 0)) \
        | (among(s, "schedule", ("dualpipev",)) & (mb < 2 * pp))
    return (mb >= 1) & ((pp == 1) | (short == 0))


def valid_microbatches(schedule: str, pp: int, mb: int) -> list[int]:
    """The nearest micro-batch counts below and above ``mb`` that ``schedule`` runs."""
    out = []
    below = next((m for m in range(mb - 1, 0, -1) if microbatches_ok(schedule, pp, m)), None)
    above = next(m for m in range(mb + 1, mb + 4 * pp + 2) if microbatches_ok(schedule, pp, m))
    if below is not None:
        out.append(below)
    out.append(above)
    return out


def check_microbatches(plan) -> None:
    """Raise an ``autopar:`` error naming the nearest valid counts when ``plan``'s pipeline
    schedule does not run ``plan.mb`` micro-batches (:func:`microbatches_ok`)."""
    if not microbatches_ok(plan.schedule, plan.pp, plan.mb):
        rule = {"1f1b": f"at least pp={plan.pp} micro-batches",
                "interleaved": f"a micro-batch count that is a multiple of its rounds (mb // pp = {max(1, plan.mb // plan.pp)})",
                "dualpipev": f"at least 2*pp={2 * plan.pp} micro-batches (one per chunk)"}[plan.schedule]
        near = " or ".join(f"mb={m}" for m in valid_microbatches(plan.schedule, plan.pp, plan.mb))
        raise AutoparError(f"autopar: schedule '{plan.schedule}' with pp={plan.pp} needs {rule}, "
                           f"got mb={plan.mb}; use {near}.")


# ---- rules of a plan alone (Plan's construction) ---------------------------------------------

def sp_ok(sp, tp):
    """Sequence parallelism splits activations over the tp group: it needs ``tp > 1``."""
    return (sp == 0) | (tp > 1)


def ep_ok(ep, dp, cp):
    """Expert parallelism is folded into the ``dp * cp`` ranks of a stage: ``ep`` divides them."""
    return (dp * cp) % ep == 0


# ---- rules of a plan against a model and a run (Plan.validate, cost model, search) ------------

def heads_ok(tp, num_heads, num_kv_heads):
    """Tensor parallelism splits whole query heads: tp divides them.  The KV heads are split too
    where tp divides them, and otherwise replicated (:func:`kv_replicated`), so any count fits."""
    return (num_heads % tp == 0) & (num_kv_heads > 0)


def kv_replicated(tp, num_kv_heads):
    """KV-head replication: where tp does not divide the KV heads (fewer KV heads than tp, down
    to multi-query attention's one, or a count tp does not divide), every tp rank holds all of
    them -- the K and V projections are not split -- and takes the copies its query heads read
    after the GQA broadcast; the K/V weights' gradients are summed over tp
    (``passes/tensor_parallel.py``, docs/plan-syntax.md)."""
    return num_kv_heads % tp != 0


def kv_cp_ok(tp, cp, num_kv_heads):
    """Context parallelism moves each tp rank's own KV heads: replicated KV heads
    (:func:`kv_replicated`) need ``cp == 1``."""
    return (cp == 1) | (num_kv_heads % tp == 0)


def padded_vocab(vocab, tp):
    """Vocabulary rows of the embedding / LM head on one tp rank: ceil(V/tp) (Megatron's padding).
    The embedding and LM head are split by vocabulary rows, and a vocabulary tp does not divide is
    padded, so the vocabulary constrains no tp (there is no vocabulary rule)."""
    return -(-vocab // tp)


def ulysses_heads_ok(num_heads, tp, cp):
    """Whether Ulysses can split ``num_heads`` heads (query or key/value) of a layer.

    Its all-to-all hands each cp rank whole heads of the heads a tp rank holds, so
    ``tp * cp`` must divide the count; for heads already local to a tp rank pass ``tp=1``.
    """
    return num_heads % (tp * cp) == 0


def ulysses_fits(num_heads, num_kv_heads, tp, cp):
    """Whether ``cp=N:ulysses`` under ``tp`` splits both the query and the KV heads
    (:func:`ulysses_heads_ok` for each)."""
    return ulysses_heads_ok(num_heads, tp, cp) & ulysses_heads_ok(num_kv_heads, tp, cp)


def ulysses_ok(cp, cp_variant, num_heads, num_kv_heads, tp):
    """A Ulysses plan (``cp > 1``, the variant's code) splits its heads (:func:`ulysses_fits`)."""
    return (cp == 1) | (among(cp_variant, "cp_variant", ("ulysses",)) == 0) \
        | ulysses_fits(num_heads, num_kv_heads, tp, cp)


def layers_ok(pp, chunks, num_layers):
    """Every one of the ``pp * chunks`` pipeline chunks gets a layer."""
    return pp * chunks <= num_layers


def experts_ok(ep, num_experts):
    """``ep`` divides the experts; a dense model (``num_experts == 0``) has ``ep == 1``."""
    return (num_experts % ep == 0) & ((num_experts > 0) | (ep == 1))


def batch_ok(global_batch, dp, mb):
    """The global batch splits into ``dp`` replicas of ``mb`` equal micro-batches."""
    return global_batch % (dp * mb) == 0


def cp_seq_ok(seq_len, cp):
    """CP cuts the sequence into ``2 * cp`` chunks (two per rank, for causal balance)."""
    return (cp == 1) | (seq_len % (2 * cp) == 0)


def sp_seq_ok(seq_len, cp, tp, sp):
    """SP splits each cp rank's ``seq_len / cp`` tokens over ``tp`` ranks."""
    return (sp == 0) | ((seq_len // cp) % tp == 0)


def model_facts(spec) -> dict[str, int]:
    """The numbers of a model the rules read, from anything with ``ModelSpec``'s fields (a
    missing field counts as absent: 0, or 1 head)."""
    heads = getattr(spec, "num_heads", 0) or 1
    return {"num_heads": heads, "num_kv_heads": getattr(spec, "num_kv_heads", 0) or heads,
            "vocab": getattr(spec, "vocab", 0), "num_layers": getattr(spec, "num_layers", 0),
            "num_experts": getattr(spec, "num_experts", 0),
            "tied": int(bool(getattr(spec, "tied_embeddings", False)))}


# ---- what the runtime runs -------------------------------------------------------------------

def moe_rewritten(tp, ep, capacity=0):
    """Whether a plan rewrites a MoE block's routing: experts split over ep, token shards under
    tp + sp, or a capacity factor (``capacity`` > 0; 0 for dropless routing)."""
    return (ep > 1) | (tp > 1) | (capacity > 0)


def split_backward(pp, schedule):
    """Whether a pipeline runs a split backward (:data:`SPLIT_BACKWARD_SCHEDULES`)."""
    return (pp > 1) & among(schedule, "schedule", SPLIT_BACKWARD_SCHEDULES)


@dataclass(frozen=True)
class Rule:
    """A combination the runtime does not run.

    ``refuses(c, moe, tied)``: the predicate on encoded columns ``c`` (:func:`encode`) and the
    model's facts (``moe``: it has MoE blocks; ``tied``: its LM head shares the embedding);
    ``says(plan)``: what a refused plan uses, and why the runtime does not run it, for the refusal;
    ``summary``: the exception as :func:`supported_summary` states it."""

    name: str
    refuses: Callable
    says: Callable
    summary: str


def _moe_tp_without_sp(c, moe, tied):
    # MoE blocks run on each rank's sequence shard with whole experts (they are not split by tp).
    return (moe > 0) & (c["tp"] > 1) & (c["sp"] == 0)


def _zero3_split_backward(c, moe, tied):
    # A unit's one flat shard feeds every weight of a layer, so torch's split weight backward
    # re-runs the layer's backward from the attention on, collectives included (measured: extra
    # CP sends), which neither the cost model nor the wall clock should pay.
    return split_backward(c["pp"], c["schedule"]) & (c["zero"] == 3) & (c["tp"] * c["cp"] * c["ep"] > 1)


def _tied_zero_under_pp(c, moe, tied):
    # The first and last stages' copies of the tied weight would have to be summed shard by shard,
    # with the copy in a unit of its own on both (on one rank under the V schedules).
    return (tied > 0) & (c["pp"] > 1) & (c["zero"] > 1)


def _recompute_split_backward(c, moe, tied):
    return (c["recompute"] != code("recompute", "none")) & split_backward(c["pp"], c["schedule"])


def _recompute_moe(c, moe, tied):
    # The expert bodies and their routed activations are not cut into recomputed regions, nor are
    # the MoE all-to-alls in the cost model's recompute accounting (a CP attention's are).
    return (moe > 0) & (c["recompute"] != code("recompute", "none"))


RUNTIME_RULES = (
    Rule("moe_tp_without_sp", _moe_tp_without_sp,
         lambda p: (f"tp={p.tp} without sp on a mixture-of-experts model (MoE blocks run on "
                    f"each rank's sequence shard with whole experts: add sp, '{p.replace(sp=True)}', as "
                    "Megatron-Core also requires)"),
         "tp without sp on a mixture-of-experts model"),
    Rule("zero3_split_backward", _zero3_split_backward,
         lambda p: (f"zero=3 with the {p.schedule} schedule together with tp, cp or ep (its "
                    "weight backward would re-run the layer's backward collectives)"),
         "zero=3 under zbv / dualpipev together with tp, cp or ep"),
    Rule("tied_zero_under_pp", _tied_zero_under_pp,
         lambda p: f"zero={p.zero} with pp on a model whose LM head is tied to the embedding (zero=1 runs there)",
         "zero=2|3 with pp on a model whose LM head is tied to the embedding"),
    Rule("recompute_split_backward", _recompute_split_backward,
         lambda p: (f"recompute={p.recompute} with the {p.schedule} schedule (its split "
                    "backward would recompute every region twice)"),
         "recompute with the zbv / dualpipev schedules"),
    Rule("recompute_moe", _recompute_moe,
         lambda p: (f"recompute={p.recompute} on a mixture-of-experts model (the expert "
                    "bodies and their routed activations are not cut into recomputed regions)"),
         "recompute on a mixture-of-experts model"),
)
"""What the runtime does not run, each rule once."""


def runtime_refusals(c: Mapping, *, moe=0, tied=0) -> list[Rule]:
    """The rules of :data:`RUNTIME_RULES` that refuse the one plan encoded in ``c``."""
    return [rule for rule in RUNTIME_RULES if rule.refuses(c, moe, tied)]


def runnable(c: Mapping, *, moe=0, tied=0):
    """Whether the runtime runs the plans encoded in ``c`` (int columns or arrays) on a model
    with (``moe``) or without MoE blocks, and with (``tied``) or without a tied LM head."""
    refused = c["tp"] != c["tp"]
    for rule in RUNTIME_RULES:
        refused = refused | rule.refuses(c, moe, tied)
    return refused == 0


def supported_summary() -> str:
    """What the runtime runs, generated from :data:`RUNTIME_RULES`."""
    return ("the runtime runs every plan the cost model prices (dp, tp, sp, cp, ep, pp, zero, mb, capacity "
            "and recompute, each with the others) except " + "; ".join(r.summary for r in RUNTIME_RULES))


# ---- what the search prices beyond validity ---------------------------------------------------

def zero_meaningful(zero, dp, cp):
    """ZeRO shards over the ``dp * cp`` copies of the dense weights: without copies every stage is
    stage 0 (the search keeps only that one)."""
    return (zero == 0) | (dp * cp > 1)


def interleaved_priced(schedule, pp, mb):
    """The cost model's interleaved bubble, ``(pp - 1)(T_f + T_b) / v``, needs ``mb >= pp``."""
    return (among(schedule, "schedule", ("interleaved",)) == 0) | (mb >= pp)


# ---- gradient buckets -------------------------------------------------------------------------

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""The default cap on a gradient bucket's local bytes (``parallelize(bucket_bytes=)``,
``estimate(bucket_bytes=)``)."""


def pack_buckets(sizes: Sequence[int], cap: int) -> list[range]:
    """The gradient buckets of tensors of ``sizes`` local bytes, in the order they are packed
    (backward's: reverse parameter order), as ranges of their indices.

    Greedy and in order: a bucket takes the next tensor unless that would take it past ``cap``
    bytes, then the next bucket starts with that tensor (a tensor bigger than ``cap`` is a bucket
    of its own).  ``passes/data_parallel.py`` packs the program's buckets with it and
    ``cost/buckets.py`` counts them from a ``ModelSpec``."""
    out: list[range] = []
    start, size = 0, 0
    for i, nbytes in enumerate(sizes):
        if i > start and size + nbytes > cap:
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if len(sizes) > start:
        out.append(range(start, len(sizes)))
    return out


def grads_kept(zero, dp, cp):
    """Whether a rank keeps its whole gradients all step, the forward before the first backward
    included: plain data parallelism (``dp*cp >= 2``) accumulates into persistent bucket buffers of
    which the gradients are views (DDP's ``gradient_as_bucket_view``; runtime/gradients/grad_sync.py).
    Otherwise backward makes the gradients and the step frees them (one rank, tp or pp alone;
    ZeRO-1's flat buffers are made at each unit's first gradient, runtime/gradients/zero_grads.py ``KeptGrads``;
    ZeRO-2/3 keep only their shards').  The cost model's peak timeline (cost/memory.py) and the
    runtime's flat optimizer (runtime/gradients/grad_sync.py, runtime/gradients/fused_step.py) ask it."""
    return (zero == 0) & (dp * cp >= 2)


ZERO_SCATTERS_IN_FLIGHT = 1
"""ZeRO-1/2: gradient reduce-scatters in flight at once; starting another first waits for the
oldest (runtime/gradients/zero_grads.py), so backward holds at most that many units' buffers beyond the one
being filled (ZeRO-2), and a backend that copies a collective's buffer (gloo) that many copies
(cost/memory.py ``zero_sync_buffer``, ``collective_copies``).  One, as FSDP2 (which waits for a
reduce-scatter before it issues the next): the one in flight runs while backward computes the
next unit's gradients, and a second would hold another unit's buffer for no more overlap once
the collective takes less than a unit's backward."""


# ---- enumeration ------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


STRUCTURE_FIELDS = ("pp", "dp", "cp", "tp", "ep", "sp", "cp_variant", "schedule", "vpp")
"""The columns of a structure: a plan but for its micro-batching, ZeRO and recompute."""


def structures(world_size: int, facts: Mapping, *, seq_len: int, global_batch: int,
               schedules=None, cp_variants=None, sp=None, max_tp=None) -> dict[str, list[int]]:
    """Every structure of ``world_size`` ranks that passes the rules of a plan and of the model
    ``facts`` (:func:`model_facts`), as integer columns keyed by :data:`STRUCTURE_FIELDS`.

    Restrictions: ``schedules`` and ``cp_variants`` (names), ``sp`` (True / False; None: both,
    and a tp of 1 keeps sp off), ``max_tp``."""
    f = facts
    cols: dict[str, list[int]] = {name: [] for name in STRUCTURE_FIELDS}
    for tp in divisors(world_size):
        if (max_tp is not None and tp > max_tp) or not heads_ok(tp, f["num_heads"], f["num_kv_heads"]):
            continue
        for cp in divisors(world_size // tp):
            if not (cp_seq_ok(seq_len, cp) & kv_cp_ok(tp, cp, f["num_kv_heads"])):
                continue
            for pp in divisors(world_size // (tp * cp)):
                dp = world_size // (tp * cp * pp)
                if not (batch_ok(global_batch, dp, 1) & layers_ok(pp, 1, f["num_layers"])):
                    continue
                eps = [e for e in divisors(dp * cp) if experts_ok(e, f["num_experts"])]
                sps = [s for s in (0, 1) if sp_ok(s, tp)]
                if sp is not None:
                    sps = [s for s in sps if s == int(sp)] or sps[:1]
                sps = [s for s in sps if sp_seq_ok(seq_len, cp, tp, s)]
                variants = [code("cp_variant", v) for v in (("ring",) if cp == 1 else cp_variants or CP_VARIANTS)]
                variants = [v for v in variants if ulysses_ok(cp, v, f["num_heads"], f["num_kv_heads"], tp)]
                scheds = [("1f1b", 1)] if pp == 1 else [
                    (s, v) for s in schedules or SCHEDULES
                    for v in (INTERLEAVED_VPP if s == "interleaved" else (chunks_per_rank(s, 1),))
                    if layers_ok(pp, chunks_per_rank(s, v), f["num_layers"])]
                for ep, sp_on, variant, (sched, vpp) in itertools.product(eps, sps, variants, scheds):
                    row = dict(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, sp=sp_on, cp_variant=variant,
                               schedule=code("schedule", sched), vpp=vpp)
                    for name in STRUCTURE_FIELDS:
                        cols[name].append(row[name])
    return cols


def candidates(world_size: int, facts: Mapping, *, seq_len: int, global_batch: int,
               zero_stages=ZERO_STAGES, recompute_modes=RECOMPUTE_MODES, max_microbatch: int = 64,
               microbatches=None, runnable_only: bool = False, **restrictions) -> Iterator[dict[str, int]]:
    """Every plan of ``world_size`` ranks that the search prices, one encoded plan
    (:func:`encode`, with ``b`` the micro-batch size) at a time; ``runnable_only``: only those
    the runtime runs.  Pure Python: the search expands :func:`structures` the same way over arrays."""
    base = structures(world_size, facts, seq_len=seq_len, global_batch=global_batch, **restrictions)
    for i in range(len(base["pp"])):
        s = {name: col[i] for name, col in base.items()}
        for b in divisors(global_batch):
            m = global_batch // (s["dp"] * b) if global_batch % (s["dp"] * b) == 0 else 0
            if not m or b > max_microbatch or (microbatches and m not in microbatches):
                continue
            if not (microbatches_ok(s["schedule"], s["pp"], m) & interleaved_priced(s["schedule"], s["pp"], m)):
                continue
            for zero in zero_stages:
                for mode in recompute_modes:
                    c = dict(s, b=b, m=m, zero=zero, recompute=code("recompute", mode))
                    if zero_meaningful(zero, s["dp"], s["cp"]) and (
                            not runnable_only or runnable(c, moe=facts["num_experts"] > 0, tied=facts["tied"])):
                        yield c
