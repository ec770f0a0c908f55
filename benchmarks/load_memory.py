"""Benchmark: each rank's peak memory while ``pm.load_pretrained`` and ``pm.export_weights`` run.

The parent writes a Llama-shaped model (``LlamaForCausalLM``, fp32, random weights) with
``save_pretrained`` as a sharded Hugging Face directory, then starts ``--world`` gloo ranks on
this machine.  Each rank builds the same model on the meta device, parallelizes it under
``--plan``, and measures two calls with a meter independent of autopar: Linux's ``VmHWM``
(peak resident set) reset right before the call by writing ``5`` to ``/proc/self/clear_refs``,
minus the resident set just before it (where ``clear_refs`` is refused: a thread sampling
``VmRSS`` every millisecond).  The calls: ``pm.load_pretrained(dir)`` (each rank reads its own
slices) and ``pm.export_weights(out, max_shard_size=...)`` (each rank writes its own pieces).

Per rank it reports the two peaks, the rank's share (bytes of the parameters it holds) and
``model bytes / ranks holding different shards`` (tp x pp x ep).  A rank that gathered the
model would show a peak near the model's size; one that streams shows about its share (the
load makes the share resident) plus one tensor piece and one read block.

Run: ``python benchmarks/load_memory.py [--world 4] [--plan tp=2,pp=2,mb=2] [--hidden 512]
[--layers 8] [--vocab 32000] [--json]``.  Results: ``docs/performance.md`` ("Loading and
exporting at scale").  The test: ``tests/e2e/test_load_memory.py``.  Neighbours:
:mod:`autopar.runtime.weights.pretrained` (the load), :mod:`autopar.runtime.weights.export` (the export).
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

MB = 2**20


def llama_config(hidden: int, layers: int, vocab: int) -> dict:
    """A Llama config of that size (heads of 64, MLP 2.7x hidden rounded to 16)."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=(hidden * 8 // 3 + 15) // 16 * 16,
                num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                num_key_value_heads=max(1, hidden // 64), max_position_embeddings=64, tie_word_embeddings=False)


# --- the meter ------------------------------------------------------------------------------

def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status("VmHWM") <= _status("VmRSS") + MB  # the reset took
    except OSError:
        return False


def measured(fn) -> tuple[int, str]:
    """(peak resident bytes during ``fn()`` above those just before it, the meter used)."""
    gc.collect()
    before = _status("VmRSS")
    if _reset_peak():
        fn()
        return max(0, _status("VmHWM") - before), "VmHWM"
    peak, done = [before], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _status("VmRSS"))
            time.sleep(0.001)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(0, max(peak[0], _status("VmRSS")) - before), "VmRSS sampled"


# --- one rank -------------------------------------------------------------------------------

def _rank_main(rank: int, world: int, plan: str, config: dict, source: str, out: str, results: str,
               shard_size: str, patch: str | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{results}/rendezvous", rank=rank, world_size=world)
    try:
        if patch:  # a function run first on every rank: checking the meter against a known-bad variant
            module, _, name = patch.partition(":")
            getattr(importlib.import_module(module), name)()
        report = _measure_rank(plan, config, source, out, shard_size)
        with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, **report}, f)
    finally:
        dist.destroy_process_group()


def _measure_rank(plan: str, config: dict, source: str, out: str, shard_size: str) -> dict:
    import transformers

    import autopar

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
    ids = torch.zeros(2, 16, dtype=torch.long)
    loss = lambda o, y: torch.nn.functional.cross_entropy(o.logits.flatten(0, 1), y.flatten())  # noqa: E731
    pm = autopar.parallelize(model, example_inputs=(ids,), example_kwargs={"use_cache": False}, plan=plan,
                             loss_fn=loss, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    share = sum(p.numel() * p.element_size() for p in pm.gm.parameters())
    model_bytes = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    distinct = pm.plan.tp * pm.plan.pp * pm.plan.ep
    del model
    dist.barrier()
    load, meter = measured(lambda: pm.load_pretrained(source))
    dist.barrier()
    export, _ = measured(lambda: pm.export_weights(out, max_shard_size=shard_size))
    dist.barrier()
    return {"share": share, "model_bytes": model_bytes, "distinct_shards": distinct,
            "per_distinct_shard": model_bytes // distinct, "load_peak": load, "export_peak": export, "meter": meter}


# --- the parent -----------------------------------------------------------------------------

def measure(world: int = 4, plan: str = "tp=2,pp=2,mb=2", hidden: int = 512, layers: int = 8,
            vocab: int = 32000, shard_size: str = "50MB", patch: str | None = None, workdir: str | None = None) -> list[dict]:
    """Write the checkpoint, run the ranks, and return their reports in rank order."""
    import transformers

    config = llama_config(hidden, layers, vocab)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        source, out, results = (os.path.join(tmp, n) for n in ("source", "export", "results"))
        os.makedirs(results)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model.save_pretrained(source, max_shard_size=shard_size)
        del model
        gc.collect()
        mp.start_processes(_rank_main, args=(world, plan, config, source, out, results, shard_size, patch),
                           nprocs=world, join=True, start_method="spawn")
        return [json.load(open(os.path.join(results, f"rank{r}.json"))) for r in range(world)]


def table(reports: list[dict], plan: str) -> str:
    first = reports[0]
    lines = [f"plan {plan}, {len(reports)} ranks, model {first['model_bytes'] / MB:.1f} MiB fp32, "
             f"{first['distinct_shards']} distinct shards: {first['per_distinct_shard'] / MB:.1f} MiB each; "
             f"meter {first['meter']}",
             f"{'rank':>4} {'share MiB':>10} {'load peak MiB':>14} {'/share':>7} {'export peak MiB':>16} {'/share':>7}"]
    for r in reports:
        lines.append(f"{r['rank']:>4} {r['share'] / MB:>10.1f} {r['load_peak'] / MB:>14.1f} "
                     f"{r['load_peak'] / r['share']:>7.2f} {r['export_peak'] / MB:>16.1f} "
                     f"{r['export_peak'] / r['share']:>7.2f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--plan", default="tp=2,pp=2,mb=2")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-size", default="50MB", help="max_shard_size of the checkpoint and the export")
    p.add_argument("--patch", default=None, help="module:function run first on every rank (checking the meter)")
    p.add_argument("--json", action="store_true", help="print the per-rank reports as JSON")
    args = p.parse_args(argv)
    reports = measure(args.world, args.plan, args.hidden, args.layers, args.vocab, args.shard_size, args.patch)
    print(json.dumps(reports, indent=2) if args.json else table(reports, args.plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
