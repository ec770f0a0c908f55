"""The rules of a plan: chunks and micro-batches, the rules of a plan alone, and of a plan against a model and a run.

Part of :mod:`autopar.plan_space`, which re-exports every public name; import them from there."""
from __future__ import annotations

from autopar.plan_space.names import V_SCHEDULES, among, code

__all__ = ["chunk_rank", "microbatches_ok", "valid_microbatches", "sp_ok", "ep_ok",
           "heads_ok", "kv_replicated", "kv_cp_ok", "padded_vocab", "ulysses_heads_ok", "ulysses_fits", "ulysses_ok", "head_split",
           "layers_ok", "experts_ok", "local_experts", "batch_ok", "cp_seq_ok", "sp_seq_ok", "model_facts"]


# ---- model chunks and micro-batches ---------------------------------------------------------

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


def head_split(tp, cp, cp_variant):
    """The ranks a layer's heads are split over: ``tp``, times ``cp`` under Ulysses (its all-to-all
    hands each cp rank whole heads); ``cp_variant`` a name or its code."""
    variant = code("cp_variant", cp_variant) if isinstance(cp_variant, str) else cp_variant
    return tp * (1 + (cp - 1) * among(variant, "cp_variant", ("ulysses",)))


def ulysses_ok(cp, cp_variant, num_heads, num_kv_heads, tp):
    """A Ulysses plan (``cp > 1``, the variant's code) splits its heads (:func:`ulysses_fits`)."""
    return (cp == 1) | (among(cp_variant, "cp_variant", ("ulysses",)) == 0) \
        | ulysses_fits(num_heads, num_kv_heads, tp, cp)


def layers_ok(pp, chunks, num_layers):
    """Every one of the ``pp * chunks`` pipeline chunks gets a layer."""
    return pp * chunks <= num_layers


def experts_ok(ep, num_experts):
    """Every ``ep`` rank holds at least one expert; a dense model (``num_experts == 0``) has ``ep == 1``.
    An ``ep`` that does not divide the experts pads them (:func:`local_experts`): the first ``ep - 1``
    ranks' ``ceil(E / ep)`` each must leave some for the last (7 experts over 4: 2, 2, 2, 1; 6 over 4
    would leave the last none)."""
    return (((ep - 1) * local_experts(num_experts, ep) < num_experts) | (num_experts % ep == 0)) \
        & ((num_experts > 0) | (ep == 1))


def local_experts(num_experts, ep):
    """Experts per ``ep`` rank: ``ceil(E / ep)``.  Rank ``r`` owns experts ``[r n, (r + 1) n)``; where
    ``ep`` does not divide ``E`` the last rank's slots past ``E - 1`` are zero padding that no token
    is routed to (FlexOlmo's 7 experts over ep=2: 4 and 3 + 1 padding), as an uneven vocabulary is padded."""
    return -(-num_experts // ep)


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
