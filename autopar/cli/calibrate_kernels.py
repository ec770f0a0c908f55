"""The kernels ``autopar calibrate`` times on one rank: matrix products, memory-bound kernels, one
eager decoder layer's element-wise kernels, causal attention and an AdamW step, and the device's
memory (the figures each gives: autopar/cli/calibrate_cmd.py's docstring; the fits:
cost/profile.py).  The collectives and the command itself live in calibrate_cmd.py.
torch is passed in, as calibrate_cmd imports it only when the command runs.
"""
from __future__ import annotations

import os
import time

_MIB = 2**20

__all__ = ["measure_gemm", "measure_memory_bandwidth", "measure_elementwise", "measure_attention",
           "measure_optimizer", "device_memory", "best_seconds", "sync"]

# ---------------------------------------------------------------------- timing
def best_seconds(fn, sync, budget: float) -> tuple[float, int]:
    """(seconds per call, calls per round): a warm-up, then three rounds sized to ``budget``, the best kept."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = time.perf_counter() - start
    calls = max(1, min(1000, int(budget / 3 / max(once, 1e-9))))
    best = once
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - start) / calls)
    return best, calls


def sync(torch, device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_gemm(torch, device, dtype, shapes, budget: float, log, rotate_bytes: int = 0) -> list[dict]:
    """One sample per ``(m, k, n)``: seconds of ``[m, k] @ [k, n]`` in ``dtype`` on ``device``.
    ``rotate_bytes``: cycle through that many bytes of operand pairs, so that each product reads its
    operands from memory, as a training step's do (a step's activations and weights far exceed a
    CPU's last-level cache; a product timed on the same operands runs from it, 5-12% faster here)."""
    rows = []
    for m, k, n in shapes:
        pair = (m * k + k * n) * torch.tensor([], dtype=dtype).element_size()
        operands = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
                    for _ in range(max(1, min(16, -(-rotate_bytes // pair))))]
        out = torch.empty(m, n, device=device, dtype=dtype)
        turn = iter(range(10**12))

        def product():
            a, b = operands[next(turn) % len(operands)]
            torch.mm(a, b, out=out)

        seconds, calls = best_seconds(product, sync(torch, device), budget)
        rows.append(dict(m=m, k=k, n=n, dtype=str(dtype).removeprefix("torch."), dtype_bytes=out.element_size(),
                         seconds=seconds, calls=calls))
        log(f"matrix product [{m}, {k}] @ [{k}, {n}] {rows[-1]['dtype']}: "
            f"{2.0 * m * k * n / seconds / 1e9:,.1f} GFLOP/s")
    return rows


def measure_memory_bandwidth(torch, device, nbytes: int, budget: float, log) -> list[dict]:
    """A copy (reads and writes ``nbytes``) and an add (reads 2x, writes 1x) of fp32 buffers."""
    x = torch.ones(nbytes // 4, device=device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    rows = []
    for kernel, fn, moved in (("copy", lambda: y.copy_(x), 2 * nbytes),
                              ("add", lambda: torch.add(x, y, out=z), 3 * nbytes)):
        seconds, calls = best_seconds(fn, sync(torch, device), budget)
        rows.append(dict(kernel=kernel, bytes=nbytes, bytes_moved=moved, seconds=seconds, calls=calls))
        log(f"memory {kernel} of {nbytes / _MIB:,.0f} MiB buffers: {moved / seconds / 1e9:,.1f} GB/s")
    return rows


def measure_elementwise(torch, device, dtype, layer: dict, budget: float, log) -> dict:
    """Seconds of one decoder layer's element-wise kernels, forward and backward (``calibrate_cmd.LAYER``), and
    the time model's bytes for them (:func:`autopar.cost.profile.layer_elementwise_bytes`)."""
    from autopar.cost.profile import layer_elementwise_bytes
    from autopar.frontend.elementwise import layer_leaves, llama_layer_elementwise

    T, H, a, g, d, F = (layer[k] for k in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "ffn"))
    t = layer_leaves(1, T, H, a, g, d, F, device=device, dtype=dtype)
    grads = [torch.randn_like(o) for o in llama_layer_elementwise(t)]

    def step():
        for x in t.values():
            x.grad = None
        torch.autograd.backward(llama_layer_elementwise(t), grads)

    seconds, calls = best_seconds(step, sync(torch, device), budget)
    model_bytes = layer_elementwise_bytes(T, H, a, g, d, F, torch.tensor([], dtype=dtype).element_size())
    log(f"element-wise kernels of a decoder layer ({T} tokens, hidden {H}, FFN {F}), forward + backward: "
        f"{seconds * 1e3:,.2f} ms, {model_bytes / seconds / 1e9:,.1f} GB/s of the time model's bytes")
    return dict(layer, dtype=str(dtype).removeprefix("torch."), seconds=seconds, calls=calls, model_bytes=model_bytes)


def measure_attention(torch, device, dtype, layer: dict, budget: float, log) -> dict:
    """Seconds of causal ``scaled_dot_product_attention`` over one layer's tokens (``calibrate_cmd.LAYER``:
    ``tokens // seq`` sequences, every head with its own K and V, as after the grouped-query copies),
    forward and backward."""
    b, a, s, d = layer["tokens"] // layer["seq"], layer["heads"], layer["seq"], layer["head_dim"]
    q, k, v = (torch.randn(b, a, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, a, s, d, device=device, dtype=dtype)

    def step():
        for x in (q, k, v):
            x.grad = None
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    seconds, calls = best_seconds(step, sync(torch, device), budget)
    log(f"causal attention ({b} x {s} tokens, {a} heads of {d}), forward + backward: {seconds * 1e3:,.2f} ms")
    return dict(batch=b, heads=a, seq=s, head_dim=d, dtype=str(dtype).removeprefix("torch."), seconds=seconds,
                calls=calls)


def measure_optimizer(torch, device, params: int, budget: float, log) -> dict:
    """Seconds of the per-step work on ``params`` fp32 parameters (16 tensors) as autopar's runtime
    does it: backward's gradient accumulated into the persistent gradient buffer, one
    ``torch.optim.AdamW`` step (its default implementation on ``device``), the buffer zeroed for the
    next step; and the time model's optimizer bytes for it."""
    from autopar.cost.profile import adamw_bytes

    tensors = [torch.zeros(params // 16, device=device, requires_grad=True) for _ in range(16)]
    fresh = [torch.randn_like(p) for p in tensors]  # what backward produces
    for p in tensors:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(tensors, lr=1e-3)

    def step():
        for p, g in zip(tensors, fresh):
            p.grad.add_(g)
        opt.step()
        for p in tensors:
            p.grad.zero_()

    seconds, calls = best_seconds(step, sync(torch, device), budget)
    model_bytes = adamw_bytes(params // 16 * 16)
    log(f"optimizer step (gradients accumulated, torch.optim.AdamW, zeroed; {params / 2**20:g}M fp32 parameters): "
        f"{seconds * 1e3:,.1f} ms, "
        f"{model_bytes / seconds / 1e9:,.1f} GB/s of the time model's bytes")
    return dict(params=params // 16 * 16, seconds=seconds, calls=calls, model_bytes=model_bytes)


def device_memory(torch, device, ranks_per_host: int) -> tuple[float, dict]:
    """(``hbm_bytes`` per rank, how it was found)."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return float(total), {"total_bytes": total, "source": "torch.cuda.get_device_properties"}
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / ranks_per_host, {"total_bytes": total, "ranks_sharing": ranks_per_host,
                                    "source": "os.sysconf: host memory / ranks on the host"}


