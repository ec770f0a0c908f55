"""ZeRO's peak memory against its ideal, by torch's own meter, with FSDP2 beside ZeRO-3.

On 2 gloo ranks a 26M-parameter Hugging Face Llama (vocabulary 4096, hidden 256, 30 layers,
untied head: every tensor and every ZeRO-3 unit but the head's at most a 4 MiB bucket; fp32,
AdamW, 4 MiB gradient buckets) trains three steps under ``dp=2`` and each
ZeRO stage (fp32, and bf16 mixed precision with fp32 masters); torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``, given the program's module, its
optimizer and every tensor alive in the process) meters the third step.  The ideal of a plan is
what its design must hold:

    ideal(plan) = held(plan) + max over the step of (a(t) + g(plan, t))  [+ U * w_p under ZeRO-3]
    held        = P * (w_p + w_g + w_o)                       plain dp
                  P * w_p + P * w_o / n                       ZeRO-1, ZeRO-2
                  P * (w_z + w_o) / n                         ZeRO-3
    a(t)        = total(t) - held(dp=2)                       the activations and temporaries at each op of
                                                              the plain-dp step, by the same meter
    g(plan, t)  = G(t) (ZeRO-1), G(t) / n (ZeRO-2, 3), 0 (plain dp: in held)
                                                              G(t): the gradient bytes backward has made
                                                              by then (counted by the parameters' hooks)
    U           = the largest ZeRO-3 unit (a layer, the embedding, or the final norm and LM head):
                  the parameters a ZeRO-3 rank must gather to compute with them

``held`` is what the design keeps for the whole step: plain dp keeps its gradient buckets from the
first backward on.  ZeRO's gradients are made by backward while it frees the activations: whole
under ZeRO-1 (its reduce-scatter takes them whole), the shards' under ZeRO-2 and 3; ZeRO-3
gathers a unit's parameters to compute with them.  So a design with no buffer beyond these holds
``a(t) + g(t)`` beside ``held`` at each moment (the same model, batch and backward order as the
plain-dp step the curves are measured on) and peaks at the largest; ``over`` is what it holds
beyond that (ZeRO-2's unit being filled and the one reduce-scattering, ZeRO-3's prefetched unit).
``P`` is the rank's parameters, ``n = 2``, and the bytes per
element are cost/memory.py's (fp32: w_p = w_g = 4, w_o = 8, w_z = 4; bf16 mixed: w_p = 2, w_g = 4,
w_o = 12 with the masters, w_z = 0).  ``over`` is the peak beyond the ideal, in MiB and in 4 MiB
buckets.  FSDP2 (``fully_shard`` on
each decoder layer and the root, torch's own ZeRO-3; bf16: its ``MixedPrecisionPolicy`` with fp32
reduction) runs the same model, batches and meter.

MemTracker sees the tensors the program allocates through torch's dispatcher.  A backend's own
buffers inside a collective (gloo copies the buffer of every reduce-scatter and all-gather it runs:
the cost model's ``collective_copies``, zero for NCCL) are not among them; the CPU allocator's
count sees them (tests/dist/test_memory_peak.py).

Run: ``python benchmarks/zero_memory.py [--shape 8x256] [--shape 2x128]`` (global batch x sequence;
by default both: activations above the gradients, and below them); the tables go to
docs/performance.md.  :func:`worker` is also what tests/dist/test_zero_memory.py runs.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

BUCKET_BYTES = 4 * 2**20
CONFIG = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=30, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
              attn_implementation="sdpa")
PLANS = ["dp=2", "dp=2,zero=1", "dp=2,zero=2", "dp=2,zero=3"]
MiB = 2**20

__all__ = ["memory_job", "held", "grad_share", "ideal", "run", "main", "PLANS", "BUCKET_BYTES"]


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


def _loss(out, target):
    return F.cross_entropy(out.logits.float().flatten(0, 1), target.flatten())


def _batches(batch: int, seq: int, steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=g),
             torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=g)) for _ in range(steps)]


class _Timeline:
    """While a step runs under MemTracker: after every op, the meter's total and the gradient bytes
    backward has made so far (a ``post_accumulate_grad_hook`` per parameter counts each one's first)."""

    def __init__(self, params):
        self.samples: list[tuple[int, int]] = []
        self.grads, self._seen = 0, set()
        for p in params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._made)

    def _made(self, p) -> None:
        if id(p) not in self._seen:
            self._seen.add(id(p))
            self.grads += p.numel() * 4  # fp32 gradient bytes (w_g)

    def sampling(self, mt):
        from torch.utils._python_dispatch import TorchDispatchMode

        timeline = self

        class Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                timeline.samples.append((mt.get_tracker_snapshot()[torch.device("cpu")]["Total"], timeline.grads))
                return out
        return Sample()


def _metered(step, module, optimizer, timeline: "_Timeline | None" = None) -> int:
    """MemTracker's peak over ``step()``, with every tensor alive in the process registered first.

    MemTracker counts the tensors it is given and those the tracked ops make; given only the
    module and the optimizer it misses what a program holds elsewhere -- fp32 masters and
    ZeRO-3 shards are the optimizer's parameters, not the module's, and a gradient buffer made in
    an earlier step is seen only once an op touches it -- so a peak before that touch would be
    low.  Registering every live tensor (the garbage collector's view, which is not autopar's own
    accounting) makes the peak that of the whole process."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    # Plain tensors on the CPU (the traced graph's metadata holds fake and meta tensors: no memory).
    live = [o for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "cpu"]
    mt = MemTracker()
    mt.track_external(module, optimizer, *live)
    del live
    with mt, (timeline.sampling(mt) if timeline is not None else contextlib.nullcontext()):
        step()
    return int(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])


def memory_job(plan: str, *, mixed: bool = False, batch: int = 8, seq: int = 256, steps: int = 3,
               bucket_bytes: int = BUCKET_BYTES) -> dict:
    """One rank's MemTracker peak of the last of ``steps`` steps under ``plan`` (``"fsdp2"``: torch's
    ``fully_shard``), and the model's parameter count."""
    import autopar

    batches = _batches(batch, seq, steps)
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    unit = _largest_unit(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-4)
    if plan == "fsdp2":
        return {"peak": _fsdp2_peak(model, batches, opt, mixed), "numel": numel, "unit": unit}
    pm = autopar.parallelize(model, example_inputs=(batches[0][0],), example_kwargs={"use_cache": False}, plan=plan,
                             loss_fn=_loss, optimizer=opt, bucket_bytes=bucket_bytes,
                             mixed_precision="bf16" if mixed else None)
    del model  # the user's model is theirs, not the program's: left out of the rank's count
    for inputs, target in batches[:-1]:
        pm.train_step((inputs,), target)
    inputs, target = batches[-1]
    timeline = _Timeline(pm.gm.parameters()) if plan == "dp=2" else None
    peak = _metered(lambda: pm.train_step((inputs,), target), pm.gm, pm.optimizer, timeline)
    out = {"peak": peak, "numel": numel, "unit": unit}
    if timeline is not None:  # the curves the ideals take (module docstring): per op, a(t) and G(t)
        base = held(plan, numel, mixed)
        out["curve"] = [(total - base, grads) for total, grads in timeline.samples]
    return out


def _largest_unit(model) -> int:
    """Elements of the largest ZeRO-3 unit (passes/zero.py): a decoder layer, the embedding, or the
    final norm and the LM head."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    head = model.lm_head.weight.numel() + sum(p.numel() for p in model.model.norm.parameters())
    return max(layers + [model.model.embed_tokens.weight.numel(), head])


def _fsdp2_peak(model, batches, make_optimizer, mixed: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    extra = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    optimizer = make_optimizer(model.parameters())
    rank, world = dist.get_rank(), dist.get_world_size()

    def step(inputs, target):
        rows = inputs.shape[0] // world
        local = slice(rank * rows, (rank + 1) * rows)
        _loss(model(inputs[local], use_cache=False), target[local]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for inputs, target in batches[:-1]:
        step(inputs, target)
    return _metered(lambda: step(*batches[-1]), model, optimizer)


def _zero(plan: str) -> int:
    return 3 if plan == "fsdp2" else int(plan.split("zero=")[1].split(",")[0]) if "zero=" in plan else 0


def held(plan: str, numel: int, mixed: bool, n: int = 2) -> float:
    """What ``plan``'s design keeps all step on a rank (``held`` of the module docstring)."""
    wp, wg, wo, wz = (2, 4, 12, 0) if mixed else (4, 4, 8, 4)
    zero = _zero(plan)
    params = numel * wz / n if zero == 3 else numel * wp
    return params + (numel * wg if zero == 0 else 0) + numel * wo / (n if zero >= 1 else 1)


def grad_share(plan: str, n: int = 2) -> float:
    """The share of the gradients made so far a stage holds beside the activations (``g / G``)."""
    zero = _zero(plan)
    return 0.0 if zero == 0 else 1.0 if zero == 1 else 1.0 / n


def ideal(plan: str, result: dict, base: dict, mixed: bool) -> float:
    """``plan``'s ideal peak (the module docstring), from its result and the ``dp=2`` result ``base``
    (whose ``curve`` is a(t), G(t) per op of its measured step)."""
    share = grad_share(plan)
    need = max(a + share * g for a, g in base["curve"])
    gathered = result["unit"] * (2 if mixed else 4) if _zero(plan) == 3 else 0
    return held(plan, result["numel"], mixed) + need + gathered


def worker(rank: int, world: int, batch: int, seq: int, plans=tuple(PLANS) + ("fsdp2",),
           precisions=(False, True)) -> list:
    """On each gloo rank (benchmarks/gloo_ranks.py, fresh processes: nothing else alive), every plan
    in every precision: ``(plan, mixed, memory_job result)``."""
    return [(plan, mixed, memory_job(plan, mixed=mixed, batch=batch, seq=seq)) for mixed in precisions
            for plan in plans]


def run(batch: int = 8, seq: int = 256) -> list[tuple]:
    """Every plan, fp32 and bf16, on 2 gloo ranks: ``(plan, mixed, peak, ideal)`` of rank 0."""
    from benchmarks.gloo_ranks import run_ranks

    rows = run_ranks(worker, 2, batch, seq)
    out = []
    for mixed in (False, True):
        base = next(r for p, m, r in rows if p == "dp=2" and m == mixed)
        for plan, m, r in rows:
            if m == mixed:
                out.append((plan, mixed, r["peak"], ideal(plan, r, base, mixed)))
    return out


SHAPES = ("8x256", "2x128")
"""(global batch)x(sequence) of the two regimes: activations above the gradients, and below them."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", metavar="BATCHxSEQ",
                    help="global batch x sequence, repeatable (default: " + " and ".join(SHAPES) + ")")
    args = ap.parse_args(argv)
    for shape in args.shape or SHAPES:
        batch, seq = (int(x) for x in shape.split("x"))
        print(f"2 gloo ranks, Llama {CONFIG['num_hidden_layers']} layers hidden {CONFIG['hidden_size']} vocab "
              f"{CONFIG['vocab_size']}, batch {batch} x seq {seq}, AdamW, buckets of 4 MiB; "
              "MemTracker peak of the third step, rank 0", flush=True)
        print(f"{'plan':<16} {'precision':<9} {'peak MiB':>9} {'ideal MiB':>10} {'over MiB':>9} {'buckets':>8}")
        for plan, mixed, peak, want in run(batch, seq):
            print(f"{plan:<16} {'bf16' if mixed else 'fp32':<9} {peak / MiB:>9.1f} {want / MiB:>10.1f} "
                  f"{(peak - want) / MiB:>9.1f} {(peak - want) / BUCKET_BYTES:>8.2f}", flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
