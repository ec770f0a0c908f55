"""Dropout drawn from per-stream generators, as Megatron's RNG tracker does.

The dropout pass (``passes/dropout.py``) rewrites every dropout of the traced graph into
:func:`dropout` (and attention with ``dropout_p > 0`` into :func:`attention`), naming the
*stream* its mask comes from, which shard propagation decided from the input's placement:

* ``"replicated"``: the values are the same on every tp rank (the residual stream and the
  embedding output without SP, replicated heads).  Every tp rank draws the same mask, so
  the replicas stay identical.
* ``"tp"``: the values are sharded over tp (attention heads, the MLP's hidden features,
  sequence shards under SP).  Each tp rank draws its own mask.

Ranks holding different data always draw different masks: the seed of a stream is the
step context's base seed (:attr:`autopar.ops.step.StepContext.seed`, the same on every
rank) plus an offset from this rank's data coordinates (dp, cp) and pipeline stage (pp),
and, for the ``"tp"`` stream only, its tp rank:

    replicated:  seed + OFFSET + d                    d = (pp_rank * dp + dp_rank) * cp + cp_rank
    tp:          seed + OFFSET + pp*dp*cp + d * tp + tp_rank

so no two streams of a step share a seed.  The generators live in the step context (one
per stream and device) and advance with every draw, step after step; a checkpoint saves their
states by stream index (:func:`stream_states`, :func:`restore_streams`), so a resumed run draws
the masks the uninterrupted one would.  Outside a step (no
context) the operators are plain torch dropout; in ``pm.eval_step`` (``step.training`` is
False) they are the identity.  Masks are drawn on the values each rank holds, so they are
independent across shards, not slices of one global mask (Megatron's rule too).

Neighbours: :mod:`autopar.ops.step` (the seed and the generators), ``passes/dropout.py``
(which stream a dropout reads).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.ops.fused_attention import fused_sdpa
from autopar.ops.step import StepContext, find_current

__all__ = ["REPLICATED", "TP", "STREAMS", "KINDS", "OFFSET", "stream_index", "stream_seed", "stream_states",
           "restore_streams", "generator", "dropout", "attention", "common_seed"]

REPLICATED, TP = "replicated", "tp"
STREAMS = (REPLICATED, TP)
KINDS = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")  # the aten ops, by name
# Keeps the streams off the plain torch.manual_seed(seed) sequence (Megatron adds 2718 too).
OFFSET = 2718
_ALPHA = 1.7580993408473766  # SELU's alpha, as torch's alpha_dropout


def _rank_size(step: StepContext, axis: str) -> tuple[int, int]:
    g = step.groups.get(axis)
    return (g.rank, g.size) if g is not None else (0, 1)


def stream_index(step: StepContext, stream: str) -> int:
    """This rank's index of ``stream`` (the offset from the base seed, the module docstring's formula)."""
    if stream not in STREAMS:
        raise ValueError(f"autopar: unknown dropout stream {stream!r}; expected one of {STREAMS}")
    (pp_r, pp), (dp_r, dp), (cp_r, cp), (tp_r, tp) = (_rank_size(step, a) for a in ("pp", "dp", "cp", "tp"))
    data = (pp_r * dp + dp_r) * cp + cp_r
    return data if stream == REPLICATED else pp * dp * cp + data * tp + tp_r


def stream_seed(step: StepContext, stream: str) -> int:
    """The seed of ``stream`` on this rank (the formula of the module docstring)."""
    return (step.seed + OFFSET + stream_index(step, stream)) % 2 ** 64


def stream_states(step: StepContext) -> dict[tuple[str, int, str], torch.Tensor]:
    """``(stream, its index on this rank, device type) -> generator state`` of every stream this
    rank has drawn from (a checkpoint's dropout state; a stream never drawn from needs none)."""
    out = {}
    for (stream, device, seed), gen in step.generators.items():
        if seed == step.seed:
            out[(stream, stream_index(step, stream), torch.device(device).type)] = gen.get_state()
    return out


def restore_streams(step: StepContext, seed: int, states: dict[tuple[str, int, str], torch.Tensor],
                    device: torch.device) -> None:
    """Continue the streams a checkpoint saved: base seed ``seed``, and each stream of this rank
    whose ``(stream, index, device type)`` is in ``states`` at its saved state; the others start
    afresh from the seed, as they would have (:func:`stream_states`)."""
    device = torch.device(device)
    step.seed = seed
    step.generators.clear()
    for stream in STREAMS:
        state = states.get((stream, stream_index(step, stream), device.type))
        if state is not None:
            generator(step, stream, device).set_state(state)


def generator(step: StepContext, stream: str, device: torch.device) -> torch.Generator:
    """This rank's generator of ``stream`` on ``device``, made (and seeded) on first use."""
    device = torch.device(device)
    key = (stream, str(device), step.seed)
    gen = step.generators.get(key)
    if gen is None:
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(step, stream))
        step.generators[key] = gen
    return gen


def _plain(x: torch.Tensor, p: float, train: bool, kind: str) -> torch.Tensor:
    return getattr(torch.ops.aten, kind).default(x, p, train)


def dropout(x: torch.Tensor, p: float, train: bool = True, stream: str = REPLICATED,
            kind: str = "dropout") -> torch.Tensor:
    """``torch.ops.aten.<kind>(x, p, train)`` with its mask drawn from ``stream``'s generator.

    ``kind`` is one of :data:`KINDS` (``feature_*``: one draw per (batch, channel); ``alpha_*``:
    SELU-preserving).  The mask of ``dropout`` and ``feature_dropout`` is kept as booleans, as
    the fused CUDA kernel does."""
    if kind not in KINDS:
        raise ValueError(f"autopar: unknown dropout kind {kind!r}; expected one of {KINDS}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    step = find_current()
    if step is None or x.device.type == "meta":
        return _plain(x, p, train, kind)
    if not (train and step.training) or p == 0.0 or x.numel() == 0:
        return x
    if p == 1.0:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    gen = generator(step, stream, x.device)
    feature = kind.startswith("feature")
    if feature and x.dim() < 2:
        raise ValueError(f"Feature dropout requires at least 2 dimensions in the input, got {x.dim()}")
    shape = (*x.shape[:2], *([1] * (x.dim() - 2))) if feature else x.shape
    if kind.endswith("alpha_dropout"):
        noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=gen)
        a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
        b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        return x * noise.mul_(a) + b
    keep = torch.empty(shape, dtype=torch.bool, device=x.device).bernoulli_(1 - p, generator=gen)
    return x * keep * (1.0 / (1 - p))


@contextlib.contextmanager
def _default_generator_is(gen: torch.Generator, device: torch.device) -> Iterator[None]:
    """Let ``device``'s default generator draw from ``gen``'s state while the block runs
    (for kernels that take no generator, like attention's fused dropout), then move the
    advanced state back into ``gen`` and restore the default generator."""
    if device.type == "cpu":
        default = torch.default_generator
    else:
        module = torch.get_device_module(device.type)
        default = module.default_generators[device.index if device.index is not None else module.current_device()]
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        yield
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, *, scale: float | None = None,
              enable_gqa: bool = False, stream: str = REPLICATED) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose dropout on the attention probabilities draws from
    ``stream``'s generator (the fused kernels take none, so the device's default generator
    holds the stream's state for the call); on the meta device the fused kernel a GPU would run
    (:func:`autopar.ops.fused_attention.fused_sdpa`)."""
    extra = {"scale": scale}
    if enable_gqa:
        extra["enable_gqa"] = True
    step = find_current()
    if step is None or query.device.type == "meta":
        return fused_sdpa(query, key, value, attn_mask, dropout_p, is_causal, **extra)
    if not step.training or dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, **extra)
    with _default_generator_is(generator(step, stream, query.device), query.device):
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, **extra)


def common_seed() -> int:
    """Rank 0's ``torch.initial_seed()`` on every rank (a collective over the default group;
    the local seed without a process group): a base seed the ranks agree on even when the
    user seeded each process differently, or not at all."""
    seed = torch.initial_seed()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seed
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([seed - 2 ** 63], dtype=torch.int64, device=device)  # uint64 in an int64
    dist.broadcast(t, src=0)
    return int(t.item()) + 2 ** 63
