"""GPU check: one GPU, bf16 training through autopar the user's way, against PyTorch, next to the cost model.

For a session lent a GPU (issue 27; ``benchmarks/device_check.sh`` runs it there with
``tests/gpu``).  At world 1 on NCCL it first writes a Llama-shaped ``LlamaForCausalLM`` with
``save_pretrained`` into a temporary directory (sharded), then trains four pairs from it.

Pairs (autopar; PyTorch):

* ``eager``: ``plan="dp=1"``; fp32 parameters under ``torch.autocast(bfloat16)``;
* ``recompute``: ``plan="dp=1,recompute=selective"``; the same, with ``torch.utils.checkpoint``
  (non-reentrant) on the regions autopar recomputes: attention + o_proj (from q, k, v) and
  act(gate) * up + down_proj (from gate, up) in every layer (passes/recompute.py);
* ``compiled``: ``compile=True``; ``torch.compile`` of the eager model;
* ``recompute_compiled``: ``plan="dp=1,recompute=selective"`` with ``compile=True`` (each recomputed
  region's body compiled, its checkpoint eager: autopar/runtime/stepping/inductor.py); the ``recompute``
  side through ``torch.compile``.

Pipelined plans need a rank per stage, so they take more than the one GPU this check runs on.

Each autopar side goes the user's way for a large model: the model is built under
``torch.device("meta")``, ``autopar.parallelize(model, (ids,), ..., mixed_precision="bf16")`` is
given example inputs on the GPU, and ``pm.load_pretrained(dir)`` reads the checkpoint (bf16
parameters and activations, fp32 masters, main gradients and AdamW state).  Each PyTorch side is
``from_pretrained(dir)`` moved to the GPU.  Both use AdamW at lr 1e-4 and the same batch.

Method, per side, each alone on the GPU: free everything (``gc.collect``,
``torch.cuda.empty_cache``, ``torch._dynamo.reset``), reset the peak counter, build and load,
one step (its loss is the equal-work check: both sides of a pair start from the same weights
and must agree within ``LOSS_RTOL``), ``--warmup`` steps, then ``--steps`` timed steps
(``torch.cuda.synchronize`` around each).  So a side's peak (``max_memory_allocated`` over the
timed steps, less what was allocated before it was built) never includes the other side's
model.  The sides run one after the other, not interleaved.  Reported per pair:

* each side's median step time and their ratio autopar/torch (below 1: autopar is faster), MFU
  (the cost model's model FLOPs of the step over the measured time and the GPU's bf16 peak);
* the cost model's prediction (``autopar.estimate(..., dtype_bytes=2)`` of the pair's plan on this
  GPU) term by term (``Cost.breakdown()``): each time term (only the total is measured), each memory
  term next to what was measured -- autopar's own meter (``pm.memory_report()``) and, for PyTorch,
  the bytes of its parameters, gradients and optimizer state and (eager pair) the bytes saved for
  backward -- and ``memory_per_gpu`` next to both allocator peaks;
* the optimizer's share of each side's step: the median time of its ``optimizer.step()`` (synchronized
  around it, in the timed steps) over the median step (autopar: the fused step on its fp32 masters,
  ``autopar/runtime/gradients/fused_step.py``; PyTorch: AdamW's default ``foreach`` step on fp32 parameters).

``--quick`` trains a 4-layer model of the same width at sequence 2048 with fewer steps (under 3
minutes on one H200); the default is about 1.1B parameters (hidden 2048, 16 layers, 16 heads, 8 KV
heads, FFN 8192, vocab 32000) at sequence 4096.  ``--dry-run`` runs the same code on the CPU (gloo,
a 2-layer hidden-256 model at sequence 128, the meta model and ``load_pretrained`` included, the
``compiled`` pair with the ``aot_eager`` backend on both sides, the cost model with the ``cpu``
preset) to check the script; its numbers mean nothing.  tests/e2e/test_gpu_check.py runs it.
Record GPU results in docs/performance.md ("GPU check").

Run: ``python benchmarks/gpu_check.py [--dry-run | --quick] [--pairs eager,recompute,compiled,recompute_compiled]
[--steps N] [--warmup N] [--seq S] [--batch B] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autopar  # noqa: E402

LOSS_RTOL = 2e-2  # bf16 recipes differ in where they round (bf16 parameters vs autocast)
LR = 1e-4
FULL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
            intermediate_size=8192, vocab_size=32000)
QUICK = dict(FULL, num_hidden_layers=4)
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
            intermediate_size=768, vocab_size=2048)
PAIRS = ("eager", "recompute", "compiled", "recompute_compiled")
PLANS = {"eager": "dp=1", "recompute": "dp=1,recompute=selective", "compiled": "dp=1",
         "recompute_compiled": "dp=1,recompute=selective"}
RECOMPUTED = {"recompute", "recompute_compiled"}
COMPILED = {"compiled", "recompute_compiled"}
TORCH_SIDES = {
    "eager": "fp32 parameters, torch.autocast(bfloat16), eager",
    "recompute": "fp32 parameters, torch.autocast(bfloat16), torch.utils.checkpoint on the same regions",
    "compiled": "fp32 parameters, torch.autocast(bfloat16), torch.compile",
    "recompute_compiled": "fp32 parameters, torch.autocast(bfloat16), torch.utils.checkpoint on the same regions, "
                          "torch.compile",
}


def _timed(step: Callable, device, times: list) -> Callable:
    """``step`` (an optimizer's) timed into ``times``, synchronized around it."""
    def run(*args, **kwargs):
        _sync(device)
        t0 = time.perf_counter()
        out = step(*args, **kwargs)
        _sync(device)
        times.append(time.perf_counter() - t0)
        return out
    return run


def _loss(out, target):
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def _config(shape: dict, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(**shape, max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False)


def _init(device_type: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device) -> None:
    """Drop everything a finished side left: compiled code, cached blocks, the peak counter."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocated(device) -> int:
    return torch.cuda.memory_allocated() if device.type == "cuda" else 0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def write_checkpoint(path: Path, config, device, shard: str) -> tuple[int, int]:
    """The model from seed 0, written with ``save_pretrained`` (sharded): (parameters, files)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialising on the GPU is much faster than on the CPU
        model = LlamaForCausalLM(config)
    model.save_pretrained(path, max_shard_size=shard)
    params = sum(p.numel() for p in model.parameters())
    del model
    _free(device)
    return params, len(list(path.glob("*.safetensors")))


# --- PyTorch: activation recompute on the regions autopar recomputes ----------------------


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """``LlamaAttention.forward`` (transformers 5.x, no cache) with the attention op and o_proj run
    under ``torch.utils.checkpoint``: q, k and v are kept, the attention output is recomputed."""
    from transformers.models.llama import modeling_llama as M

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = M.apply_rotary_pos_emb(q, k, cos, sin)
    attention = M.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, M.eager_attention_forward)

    def region(q, k, v):
        out, _ = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                           scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous())

    return torch.utils.checkpoint.checkpoint(region, q, k, v, use_reentrant=False), None


def _mlp_forward(self, x):
    """``LlamaMLP.forward`` with act(gate) * up and down_proj under ``torch.utils.checkpoint``."""
    def region(gate, up):
        return self.down_proj(self.act_fn(gate) * up)

    return torch.utils.checkpoint.checkpoint(region, self.gate_proj(x), self.up_proj(x), use_reentrant=False)


def checkpoint_regions(model) -> int:
    """Route every Llama attention and MLP of ``model`` through the checkpointed forwards above."""
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

    count = 0
    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.forward = types.MethodType(_attention_forward, module)
            count += 1
        elif isinstance(module, LlamaMLP):
            module.forward = types.MethodType(_mlp_forward, module)
            count += 1
    return count


# --- the two sides -------------------------------------------------------------------------


class AutoparSide:
    """The user's large-model path: meta model, ``parallelize``, ``load_pretrained``."""

    def __init__(self, checkpoint: Path, config, ids, plan: str, compile_options: dict | None):
        """``compile_options``: None for eager, else ``parallelize``'s ``compile=`` (True for {})."""
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        model.train()
        options = {} if compile_options is None else {"compile": compile_options or True}
        self.pm = autopar.parallelize(model, (ids,), example_kwargs={"use_cache": False}, plan=plan, loss_fn=_loss,
                                      optimizer=functools.partial(torch.optim.AdamW, lr=LR),
                                      mixed_precision="bf16", **options)
        self.pm.load_pretrained(checkpoint)
        self.optimizer_times: list[float] = []
        optimizer = self.pm.optimizer
        optimizer.step = _timed(optimizer.step, ids.device, self.optimizer_times)

    def step(self, ids, meter: bool = False) -> float:
        return self.pm.train_step((ids,), ids)

    def memory(self) -> dict:
        """autopar's own meter of the last step (autopar/runtime/stepping/memory.py)."""
        return {k: int(v) for k, v in self.pm.memory_report().items()}


class TorchSide:
    """PyTorch's usual bf16 recipe: ``from_pretrained``, fp32 parameters, autocast, AdamW."""

    def __init__(self, checkpoint: Path, device, recompute: bool, compile_options: dict | None):
        """``compile_options``: None for eager, else ``torch.compile``'s keyword arguments ({} for Inductor)."""
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device)
        self.model.train()
        if recompute:
            checkpoint_regions(self.model)
        compiled = compile_options is not None
        self.forward = torch.compile(self.model, **compile_options) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.optimizer_times: list[float] = []
        self.opt.step = _timed(self.opt.step, device, self.optimizer_times)
        self.device = device
        self.measured: dict = {}
        self.meter_activations = not recompute and not compiled  # checkpoint and compile hide the saves

    def step(self, ids, meter: bool = False) -> float:
        saved: dict[int, int] = {}
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()} if meter else set()

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        hooks = (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if meter and self.meter_activations
                 else contextlib.nullcontext())
        with hooks, torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = _loss(self.forward(input_ids=ids), ids)
        loss.backward()
        if meter:
            self.measured = {"params": _nbytes(self.model.parameters()),
                             "grads": _nbytes(p.grad for p in self.model.parameters())}
            if self.meter_activations:
                self.measured["activations"] = sum(saved.values())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if meter:
            self.measured["optimizer"] = _nbytes(t for state in self.opt.state.values() for t in state.values()
                                                 if isinstance(t, torch.Tensor) and t.dim() > 0)
        return float(loss.detach())

    def memory(self) -> dict:
        return dict(self.measured)


def measure(make, ids, args, device) -> dict:
    """One side alone on the device: build, first step, warm-up, timed steps, peak; then freed."""
    _free(device)
    base = _allocated(device)
    start = time.perf_counter()
    side = make()
    _sync(device)
    build_s = time.perf_counter() - start
    first = side.step(ids, meter=True)
    memory = side.memory()
    for _ in range(args.warmup):
        side.step(ids)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    side.optimizer_times.clear()
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        side.step(ids)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
    optimizer_s = statistics.median(side.optimizer_times) if side.optimizer_times else None
    del side
    _free(device)
    median = statistics.median(times)
    return {"first_loss": first, "build_s": build_s, "times": times, "median_s": median,
            "peak_bytes": peak, "left_after_free_bytes": _allocated(device) - base if device.type == "cuda" else None,
            "memory": memory, "optimizer_s": optimizer_s,
            "optimizer_share": optimizer_s / median if optimizer_s is not None else None}


# --- the cost model ---------------------------------------------------------------------------


def _cluster(device):
    if device.type != "cuda":
        return autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=1)
    name = torch.cuda.get_device_name().lower()
    gpu = next((g for g in ("h200", "h100", "a100") if g in name), "h100")
    return autopar.Cluster(gpu=gpu, num_nodes=1, gpus_per_node=1)


def predict(config, plan: str, seq: int, batch: int, cluster) -> dict:
    spec = autopar.ModelSpec.from_hf_config(config.to_dict())
    cost = autopar.estimate(spec, cluster, plan, seq_len=seq, global_batch=batch, dtype_bytes=2)
    peak = float(cluster.peak_flops)
    return {"plan": plan, "gpu": cluster.gpu, "step_s": cost.step_time, "mfu": cost.mfu,
            "flops": cost.mfu * cost.step_time * peak, "peak_flops": peak, "memory_bytes": cost.memory_per_gpu,
            "terms": [{"name": t.name, "category": t.category, "value": t.value}
                      for t in cost.breakdown(formulas=False) if t.value > 0]}


# The cost model's memory terms that autopar's meter measures under one name.
METER_TERMS = {"params": ("params",), "grads": ("grads",), "optimizer": ("optimizer",),
               "activations": ("activations", "embedding_activations", "head_activations", "recompute_buffer")}


def run_pair(name: str, args, device, checkpoint: Path, config, ids, cluster) -> dict:
    plan = PLANS[name]
    compiled = name in COMPILED
    options = ({"backend": "aot_eager"} if args.dry_run else {}) if compiled else None  # {}: Inductor
    print(f"gpu_check: {name}: autopar (plan {plan}{', compile' if compiled else ''}) ...", flush=True)
    a = measure(lambda: AutoparSide(checkpoint, config, ids, plan, options), ids, args, device)
    print(f"gpu_check: {name}: torch ({TORCH_SIDES[name]}) ...", flush=True)
    b = measure(lambda: TorchSide(checkpoint, device, name in RECOMPUTED, options), ids, args, device)
    predicted = predict(config, plan, args.seq, args.batch, cluster)
    equal = abs(a["first_loss"] - b["first_loss"]) <= LOSS_RTOL * abs(b["first_loss"])
    out = {"pair": name, "plan": plan, "autopar_side": f"plan {plan}, mixed_precision=bf16"
           f"{', compile=True' if compiled else ''}, meta model + load_pretrained",
           "torch_side": TORCH_SIDES[name] + ", from_pretrained", "equal": equal,
           "loss_autopar": a["first_loss"], "loss_torch": b["first_loss"],
           "autopar_s": a["median_s"], "torch_s": b["median_s"], "ratio": a["median_s"] / b["median_s"],
           "times_autopar": a["times"], "times_torch": b["times"], "build_autopar_s": a["build_s"],
           "build_torch_s": b["build_s"], "peak_autopar_bytes": a["peak_bytes"], "peak_torch_bytes": b["peak_bytes"],
           "left_after_free_bytes": [a["left_after_free_bytes"], b["left_after_free_bytes"]],
           "memory_autopar": a["memory"], "memory_torch": b["memory"], "predicted": predicted,
           "optimizer_s": [a["optimizer_s"], b["optimizer_s"]],
           "optimizer_share": [a["optimizer_share"], b["optimizer_share"]]}
    if compiled and args.dry_run:
        out["note"] = "dry run: both sides compiled with backend aot_eager (Inductor on the GPU)"
    flops, peak = predicted["flops"], predicted["peak_flops"]
    out["mfu_autopar"] = flops / a["median_s"] / peak
    out["mfu_torch"] = flops / b["median_s"] / peak
    return out


def run(args) -> dict:
    from transformers import __version__ as transformers_version

    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.dry_run else torch.device("cpu")
    if device.type == "cpu" and not args.dry_run:
        raise SystemExit("autopar: gpu_check: no GPU here; run with --dry-run to check the script on the CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = TINY if args.dry_run else QUICK if args.quick else FULL
    config = _config(shape, args.seq)
    _init(device.type)
    try:
        with tempfile.TemporaryDirectory(prefix="autopar-gpu-check-") as tmp:
            checkpoint = Path(tmp) / "model"
            start = time.perf_counter()
            params, files = write_checkpoint(checkpoint, config, device, "1MB" if args.dry_run else "1GB")
            written_s = time.perf_counter() - start
            ids = torch.randint(0, shape["vocab_size"], (args.batch, args.seq),
                                generator=torch.Generator().manual_seed(1)).to(device)
            mode = "dry run: the numbers mean nothing" if args.dry_run else "quick" if args.quick else "full"
            print(f"gpu_check: {params / 1e6:,.0f}M parameters, batch {args.batch} x seq {args.seq}, on {device}; "
                  f"checkpoint: {files} safetensors files ({written_s:.1f} s); {mode}", flush=True)
            cluster = _cluster(device)
            pairs = [run_pair(name, args, device, checkpoint, config, ids, cluster) for name in args.pairs]
        return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "transformers": transformers_version, "mode": mode,
                "date": time.strftime("%Y-%m-%d"), "params": params, "seq": args.seq, "batch": args.batch,
                "steps": args.steps, "warmup": args.warmup, "checkpoint_files": files,
                "method": "each side alone on the device, one after the other (not interleaved); peak memory "
                          "over the timed steps with the other side freed",
                "pairs": pairs}
    finally:
        dist.destroy_process_group()


# --- the report ---------------------------------------------------------------------------------


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f} GiB" if abs(x) >= 2**28 else f"{x / 2**20:.1f} MiB"


def _ms(x) -> str:
    return f"{x * 1e3:.1f} ms"


def report(result: dict) -> list[str]:
    lines = [f"device {result['device']} (torch {result['torch']}, transformers {result['transformers']}), "
             f"{result['params'] / 1e6:,.0f}M parameters, batch {result['batch']} x seq {result['seq']}, "
             f"{result['mode']}", f"method: {result['method']}"]
    for p in result["pairs"]:
        pred = p["predicted"]
        lines.append(f"== {p['pair']}: autopar ({p['autopar_side']}) vs torch ({p['torch_side']})")
        if not p["equal"]:
            lines.append(f"  UNEQUAL WORK: first loss {p['loss_autopar']:.5f} vs {p['loss_torch']:.5f}; "
                         "the times below do not compare")
        lines.append(f"  autopar/torch {p['ratio']:.3f}: step {_ms(p['autopar_s'])} vs {_ms(p['torch_s'])} "
                     f"(predicted {_ms(pred['step_s'])}); MFU {p['mfu_autopar']:.1%} vs {p['mfu_torch']:.1%} "
                     f"(predicted {pred['mfu']:.1%}, {pred['gpu']} peak)")
        lines.append(f"  first loss {p['loss_autopar']:.5f} vs {p['loss_torch']:.5f}; build + load "
                     f"{p['build_autopar_s']:.1f} s vs {p['build_torch_s']:.1f} s")
        lines.append(f"  peak memory {_gib(p['peak_autopar_bytes'])} vs {_gib(p['peak_torch_bytes'])} "
                     f"(predicted memory_per_gpu {_gib(pred['memory_bytes'])})")
        (oa, ot), (sa, st) = p["optimizer_s"], p["optimizer_share"]
        lines.append(f"  optimizer step {_ms(oa)} vs {_ms(ot)}: {sa:.1%} vs {st:.1%} of the step")
        lines.append(f"  {'cost model term':<36} {'predicted':>12} {'autopar':>12} {'torch':>12}")
        terms = {t["name"]: t for t in pred["terms"]}
        for t in pred["terms"]:
            if t["category"] != "memory":
                lines.append(f"  {t['name']:<36} {_ms(t['value']):>12} {'(total only)':>12}")
        for meter, names in METER_TERMS.items():
            value = sum(terms[f"memory.{n}"]["value"] for n in names if f"memory.{n}" in terms)
            label = "memory." + ("+".join(names) if len(names) == 1 else "activations (all)")
            lines.append(f"  {label:<36} {_gib(value):>12} {_gib(p['memory_autopar'].get(meter)):>12} "
                         f"{_gib(p['memory_torch'].get(meter)):>12}")
        left = [x for x in p["left_after_free_bytes"] if x]
        if left and max(left) > 2**24:
            lines.append(f"  note: {_gib(max(left))} was still allocated after a side was freed")
        if p.get("note"):
            lines.append(f"  note: {p['note']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="check the script on the CPU (tiny model, gloo)")
    mode.add_argument("--quick", action="store_true", help="4 layers at sequence 2048, fewer steps (< 3 min, H200)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma-separated, of {', '.join(PAIRS)}")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per side (default 10; quick 5; dry run 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per side (default 3; quick 2; dry run 1)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 4096; quick 2048; dry run 128)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)
    args.pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = sorted(set(args.pairs) - set(PAIRS))
    if unknown:
        parser.error(f"autopar: unknown pair(s) {', '.join(unknown)}; expected some of {', '.join(PAIRS)}")
    key = "dry" if args.dry_run else "quick" if args.quick else "full"
    args.steps = args.steps or {"dry": 2, "quick": 5, "full": 10}[key]
    args.warmup = args.warmup if args.warmup is not None else {"dry": 1, "quick": 2, "full": 3}[key]
    args.seq = args.seq or {"dry": 128, "quick": 2048, "full": 4096}[key]
    result = run(args)
    for line in report(result):
        print(line)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if all(p["equal"] for p in result["pairs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
