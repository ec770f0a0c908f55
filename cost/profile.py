"""Hardware profiles: the figures of the time model measured on a machine (``autopar calibrate``).

A profile is one JSON object (format ``autopar-hardware-profile/1``)::

    {"format": "autopar-hardware-profile/1",
     "device": "NVIDIA H200" | "cpu",        # what was measured
     "gpus_per_node": 8,                      # ranks of the fast-link domain it measured
     "gemm_efficiency": 1.0, "peak_flops": ..., "hbm_bytes": ..., "hbm_bandwidth": ...,
     "intra_node_bandwidth": ..., "intra_node_latency": ...,
     "inter_node_bandwidth": ..., "inter_node_latency": ...,   # = intra_node on one host
     "notes": ["..."],                        # how each figure was obtained
     "measured": {"gemm": [...], "memory": [...], "hbm_bytes": {...}, "collectives": {...}},
     "machine": {"hostname": ..., "torch": ..., "date": ...},
     "source": "measured by autopar calibrate"}

The eight figures are exactly those of a GPU preset (:data:`FIGURES`, cost/hardware.py's
``_gpu``), in the same units: FLOP/s, bytes, bytes/s per direction, seconds.
``Cluster.from_profile(path)`` (hardware.py) builds a cluster from them; ``autopar plan
--hardware`` and ``autopar explain --hardware`` take one on the command line.

The fits (docs/cost-model.md, "Hardware profiles"), all torch-free, so that the arithmetic is
tested without measuring anything; autopar/cli/calibrate_cmd.py does the measuring:

* :func:`fit_gemm`: ``peak_flops`` is the best FLOP/s any measured matrix product reached and
  ``gemm_efficiency`` is 1, so the time model's large-GEMM rate ``P_peak * eta_max`` equals the
  best measured rate (and MFU is reported against what this machine really reaches). The
  model's rate at a finite size, ``P_peak * eta(n)`` (time.py's smoothed roofline), is recorded
  beside each measured shape.
* :func:`fit_memory`: ``hbm_bandwidth`` is the best bytes moved per second of the
  memory-bound kernels (a copy reads and writes its buffer: 2x its bytes).
* :func:`fit_alpha_beta`: collective times ``t`` against the time model's own formula,
  ``t = sent / (B * epsilon) + passes * (n - 1) * alpha`` (sent bytes in the byte convention of
  docs/architecture.md: an all-reduce of ``F`` bytes sends ``2(n-1)/n F`` in 2 passes, an
  all-gather of an ``s``-byte shard ``(n-1) s`` in 1), least squares on the relative error,
  ``alpha >= 0``; so ``B`` is the bandwidth the model needs to reproduce the measured times,
  epsilon (time.CALIBRATED) included.
* :func:`fit_elementwise`, :func:`fit_optimizer`: the optional ``elementwise_bandwidth`` and
  ``optimizer_bandwidth``, the bandwidths at which the time model's byte counts (time.py) reproduce
  the measured time of an eager decoder layer's element-wise kernels (forward and backward) and of
  torch's AdamW step; :func:`fit_attention`: the optional ``attention_factor``, the measured causal
  attention kernel over the model's price of its FLOPs as a GEMM of its size (time.py's ``x_attn``);
  :func:`fit_overlap`: the optional ``comm_overlap``, the share of an
  asynchronous all-reduce that matrix products running meanwhile hide (time.py's phi).
* :func:`host_share`: a CPU profile's figures are one rank's with ``threads_per_rank`` cores of the
  ``host_cores``; more ranks than that on a host time-share its cores.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from autopar.errors import AutoparError

__all__ = ["FORMAT", "SOURCE", "FIGURES", "OPTIONAL_FIGURES", "HOST_FIELDS", "load_profile", "save_profile",
           "check_profile", "profile_name", "host_share", "sent_bytes", "fit_gemm", "fit_memory", "fit_alpha_beta",
           "layer_elementwise_bytes", "adamw_bytes", "attention_model_seconds", "fit_elementwise", "fit_optimizer",
           "fit_attention", "fit_overlap"]

FORMAT = "autopar-hardware-profile/1"
SOURCE = "measured by autopar calibrate"

FIGURES: dict[str, str] = {
    "gemm_efficiency": "fraction of peak_flops large matrix products reach (0 < x <= 1)",
    "peak_flops": "FLOP/s",
    "hbm_bytes": "bytes of device memory per rank",
    "hbm_bandwidth": "bytes/s of device memory",
    "intra_node_bandwidth": "bytes/s per direction between ranks of one node",
    "intra_node_latency": "seconds per ring step inside a node",
    "inter_node_bandwidth": "bytes/s per direction between nodes",
    "inter_node_latency": "seconds per ring step across nodes",
}
"""The time model's hardware figures (the keys of every ``GPU_PRESETS`` entry) and their units."""

OPTIONAL_FIGURES: dict[str, str] = {
    "elementwise_bandwidth": "bytes/s of the time model's element-wise byte count (eager kernels measured)",
    "optimizer_bandwidth": "bytes/s of the time model's optimizer byte count (torch AdamW measured)",
    "all_reduce_bandwidth": "bytes/s per direction of an all-reduce alone inside a node",
    "all_gather_bandwidth": "bytes/s per direction of an all-gather alone inside a node",
    "reduce_scatter_bandwidth": "bytes/s per direction of a reduce-scatter alone inside a node",
    "attention_factor": "measured seconds of causal attention over its FLOPs priced as a GEMM of its size",
    "comm_overlap": "share of an asynchronous collective hidden by compute running meanwhile (0 <= x <= 1)",
}
"""Figures a profile may add (``Cluster`` fields of the same names; without them the time model uses
``hbm_bandwidth`` and the phi fitted to published runs)."""

HOST_FIELDS: dict[str, str] = {
    "host_cores": "CPU cores of the host the ranks share",
    "threads_per_rank": "cores (threads) each rank used when its figures were measured",
}
"""A CPU profile's description of its host (:func:`host_share`)."""


# ---------------------------------------------------------------------- file format
def _where(path) -> str:
    return f"hardware profile {os.fspath(path)!r}"


def check_profile(data, where: str = "hardware profile") -> dict:
    """``data`` if it is a valid profile, else an :class:`AutoparError` naming the field, what it
    holds and what was expected."""
    fix = "measure one with `autopar calibrate --out PROFILE.json`"
    if not isinstance(data, dict):
        raise AutoparError(f"autopar: {where} holds a JSON {type(data).__name__}; expected an object "
                           f"with \"format\": {FORMAT!r}; {fix}")
    if data.get("format") != FORMAT:
        found = f"\"format\": {data['format']!r}" if "format" in data else "no \"format\" field"
        raise AutoparError(f"autopar: {where} has {found}; expected \"format\": {FORMAT!r} (a file "
                           f"written by `autopar calibrate`); {fix}")
    if not isinstance(data.get("device"), str) or not data["device"]:
        raise AutoparError(f"autopar: {where} has \"device\": {data.get('device')!r}; expected the name "
                           f"of the measured device, e.g. \"cpu\" or \"NVIDIA H100 80GB HBM3\"")
    per_node = data.get("gpus_per_node")
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise AutoparError(f"autopar: {where} has \"gpus_per_node\": {per_node!r}; expected an integer >= 1 "
                           f"(the ranks of one node)")
    for name, unit in FIGURES.items():
        if name not in data:
            raise AutoparError(f"autopar: {where} has no {name!r}; expected a number ({unit}); every figure "
                               f"of {', '.join(FIGURES)} must be given")
        value = data[name]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and value > 0 and (name != "gemm_efficiency" or value <= 1))
        if not ok:
            raise AutoparError(f"autopar: {where} has {name!r}: {value!r}; expected a positive finite "
                               f"number ({unit})")
    for name, unit in {**OPTIONAL_FIGURES, **HOST_FIELDS}.items():
        value = data.get(name)
        ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                               and math.isfinite(value) and (0 <= value <= 1 if name == "comm_overlap" else value > 0))
        if not ok:
            raise AutoparError(f"autopar: {where} has {name!r}: {value!r}; expected {unit}, a finite number"
                               f"{' in [0, 1]' if name == 'comm_overlap' else ' > 0'}, or no such field")
    return data


def load_profile(path) -> dict:
    """The profile at ``path`` (validated by :func:`check_profile`)."""
    where = _where(path)
    if not os.path.isfile(path):
        raise AutoparError(f"autopar: {where} does not exist; run `autopar calibrate --out "
                           f"{os.fspath(path)}` on the machine to measure it")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AutoparError(f"autopar: {where} is not readable JSON ({exc}); expected the file written "
                           f"by `autopar calibrate`") from None
    return check_profile(data, where)


def save_profile(profile: dict, path) -> None:
    """Write ``profile`` (checked first) to ``path`` as indented JSON."""
    check_profile(profile, "the profile to save")
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(profile, fh, indent=2)
        fh.write("\n")


def profile_name(profile: dict) -> str:
    """The ``Cluster.gpu`` of a profile's cluster: its device, marked measured (never a preset's name)."""
    return f"{profile['device']} (measured)"


def host_share(profile: dict, ranks_per_host: int, figures: dict) -> dict:
    """``figures`` for ``ranks_per_host`` ranks on one host of a CPU ``profile``.

    Its figures are one rank's on ``threads_per_rank`` cores of its own (how calibrate measures): a
    rank's share of the host is ``host_cores / (ranks_per_host * threads_per_rank)``; below 1 the
    ranks time-share the cores (compute, memory traffic and gloo's copies alike run on them), so
    every rate is that share of the measured one and every latency is divided by it.  When the
    ranks' threads fill every core, no core is left for gloo's threads: a collective's copies and
    sums displace compute, so ``comm_overlap`` is 0 (what calibrate measures there, up to the noise
    of other processes).  The share itself is ``core_share``: time a rank spends idle in the
    pipeline bubble, the others run in (:func:`autopar.cost.model.shared_host_step`).  The host's
    memory is split over the ranks.  A profile without
    ``host_cores`` (a GPU's) is returned as is."""
    cores, threads = profile.get("host_cores"), profile.get("threads_per_rank")
    if not cores or not threads:
        return figures
    out = dict(figures)
    out["hbm_bytes"] = figures["hbm_bytes"] * profile["gpus_per_node"] / ranks_per_host
    share = min(1.0, cores / (ranks_per_host * threads))
    out["core_share"] = share
    if ranks_per_host * threads >= cores:
        out["comm_overlap"] = 0.0
    for name in ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth",
                 "elementwise_bandwidth", "optimizer_bandwidth", "all_reduce_bandwidth", "all_gather_bandwidth",
                 "reduce_scatter_bandwidth"):
        if name in out:
            out[name] = out[name] * share
    for name in ("intra_node_latency", "inter_node_latency"):
        out[name] = out[name] / share
    return out


# ---------------------------------------------------------------------- fits
def _knee(peak: float, hbm_bandwidth: float, dtype_bytes: int, kappa: float) -> float:
    """time.efficiency's knee: kappa * 1.5 * w * P_peak / B_hbm."""
    return kappa * 1.5 * dtype_bytes * peak / hbm_bandwidth


def fit_gemm(samples: list[dict], hbm_bandwidth: float, kappa: float) -> dict:
    """``peak_flops`` and ``gemm_efficiency`` from timed matrix products.

    ``samples``: dicts with ``m``, ``k``, ``n``, ``dtype_bytes`` and ``seconds`` (one
    ``[m, k] @ [k, n]``). Returns the two figures and the samples with ``flop_per_s`` and
    ``model_flop_per_s`` (the time model's rate for that shape with the fitted figures).
    """
    if not samples:
        raise AutoparError("autopar: no matrix product was timed; cannot fit peak_flops")
    rows = [dict(s, flop_per_s=2.0 * s["m"] * s["k"] * s["n"] / s["seconds"]) for s in samples]
    peak = max(r["flop_per_s"] for r in rows)
    for r in rows:
        size = 3.0 / (1.0 / r["m"] + 1.0 / r["k"] + 1.0 / r["n"])
        r["effective_size"] = size
        r["model_flop_per_s"] = peak * size / (size + _knee(peak, hbm_bandwidth, r["dtype_bytes"], kappa))
    return {"peak_flops": peak, "gemm_efficiency": 1.0, "samples": rows}


def fit_memory(samples: list[dict]) -> dict:
    """``hbm_bandwidth``: the best ``bytes_moved / seconds`` of the memory-bound kernels."""
    if not samples:
        raise AutoparError("autopar: no memory-bound kernel was timed; cannot fit hbm_bandwidth")
    rows = [dict(s, bytes_per_s=s["bytes_moved"] / s["seconds"]) for s in samples]
    return {"hbm_bandwidth": max(r["bytes_per_s"] for r in rows), "samples": rows}


def sent_bytes(collective: str, group: int, nbytes: float) -> tuple[float, int]:
    """(bytes a rank sends, ring passes) for ``collective`` over ``group`` ranks, docs/architecture.md's
    convention: ``nbytes`` is the all-reduce buffer ``F`` (sends ``2(n-1)/n F``, 2 passes), the
    all-gather shard ``s`` (sends ``(n-1) s``, 1 pass) or the reduce-scatter input ``F`` (sends
    ``(n-1)/n F``, 1 pass)."""
    if collective == "all_reduce":
        return 2.0 * (group - 1) / group * nbytes, 2
    if collective == "all_gather":
        return float((group - 1) * nbytes), 1
    if collective == "reduce_scatter":
        return (group - 1) / group * nbytes, 1
    raise AutoparError(f"autopar: no byte convention for collective {collective!r}; expected all_reduce, "
                       f"all_gather or reduce_scatter")


def fit_alpha_beta(samples: list[dict], epsilon: float) -> dict:
    """Bandwidth and latency of the time model's ring collectives from timed calls.

    ``samples``: dicts with ``collective`` (all_reduce / all_gather), ``group`` (ranks),
    ``bytes`` (see :func:`sent_bytes`) and ``seconds`` per call. Fits
    ``t = sent * beta + passes * (n - 1) * alpha`` by least squares on the relative error with
    ``alpha >= 0``; returns ``bandwidth = 1 / (beta * epsilon)`` (time.py divides by epsilon),
    ``latency = alpha``, and each sample with ``sent``, ``passes`` and the fitted ``model_seconds``.
    """
    rows = []
    for s in samples:
        sent, passes = sent_bytes(s["collective"], s["group"], s["bytes"])
        rows.append(dict(s, sent=sent, passes=passes))
    rows = [r for r in rows if r["group"] > 1 and r["seconds"] > 0]
    if not rows:
        raise AutoparError("autopar: no collective over 2 or more ranks was timed; cannot fit the link "
                           "figures (pass --world 2 or more)")
    t = np.array([r["seconds"] for r in rows])
    x = np.array([r["sent"] for r in rows]) / t
    y = np.array([r["passes"] * (r["group"] - 1) for r in rows], dtype=np.float64) / t
    (beta, alpha), *_ = np.linalg.lstsq(np.stack([x, y], axis=1), np.ones_like(t), rcond=None)
    if alpha < 0 or beta <= 0:  # latency below what can be resolved: a pure bandwidth fit
        alpha, beta = 0.0, float(x @ np.ones_like(t) / (x @ x))
    if not beta > 0:
        raise AutoparError("autopar: the collective timings do not grow with the message size; cannot fit "
                           "a bandwidth (measure larger messages)")
    for r in rows:
        r["model_seconds"] = r["sent"] * beta + r["passes"] * (r["group"] - 1) * alpha
    return {"bandwidth": 1.0 / (beta * epsilon), "latency": float(alpha), "epsilon": epsilon, "samples": rows}


def layer_elementwise_bytes(tokens: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int,
                            dtype_bytes: int) -> float:
    """The time model's element-wise bytes (time.py) of one dense gated decoder layer over ``tokens``
    tokens on one rank, forward and backward (backward moves twice the forward's bytes)."""
    from . import symbols as S
    from .time import _elementwise_bytes_fwd

    layers, _ = _elementwise_bytes_fwd()
    values = {S.b: 1, S.s: tokens, S.cp: 1, S.tp: 1, S.SP: 0, S.FLASH: 1, S.ld: 1, S.le: 0, S.gated: 1, S.XEW: 1,
              S.h: hidden, S.a: heads, S.g: kv_heads, S.d: head_dim, S.f: ffn, S.w: dtype_bytes,
              S.E: 1, S.k: 1, S.rho: 1, S.nsh: 0, S.fe: 1}
    return 3.0 * float(layers.xreplace(values))


def adamw_bytes(params: int, dtype_bytes: int = 4) -> float:
    """The time model's optimizer bytes (time.optimizer_time, no ZeRO) for ``params`` parameters."""
    from .memory import precision_bytes

    pb = precision_bytes(dtype_bytes)
    return float(params * (pb["w_g"] + 2 * pb["w_o"] + pb["w_p"]))


def fit_elementwise(model_bytes: float, seconds: float) -> float:
    """``elementwise_bandwidth``: the model's bytes of the timed layer (:func:`layer_elementwise_bytes`)
    over the measured seconds of its eager element-wise kernels."""
    if not seconds > 0:
        raise AutoparError("autopar: the element-wise kernels took no measurable time; cannot fit "
                           "elementwise_bandwidth")
    return model_bytes / seconds


def fit_optimizer(model_bytes: float, seconds: float) -> float:
    """``optimizer_bandwidth``: the model's optimizer bytes (:func:`adamw_bytes`) over the measured
    seconds of one optimizer step."""
    if not seconds > 0:
        raise AutoparError("autopar: the optimizer step took no measurable time; cannot fit optimizer_bandwidth")
    return model_bytes / seconds


def fit_overlap(compute_s: float, collective_s: float, both_s: float) -> float:
    """``comm_overlap``: the share of the collective's time hidden when it runs asynchronously under
    the compute, ``(compute + collective - both) / collective``, clipped to [0, 1]."""
    if not collective_s > 0:
        return 0.0
    return min(1.0, max(0.0, (compute_s + collective_s - both_s) / collective_s))


def attention_model_seconds(batch: int, heads: int, seq: int, head_dim: int, dtype_bytes: int, peak: float,
                            hbm_bandwidth: float, kappa: float) -> float:
    """The time model's seconds (time.compute_terms, ``x_attn`` = 1) of causal flash attention over
    ``batch`` sequences of ``seq`` tokens, ``heads`` heads of ``head_dim``, forward and backward."""
    from . import symbols as S
    from .time import compute_terms

    terms = compute_terms()
    expr = terms["compute.fwd.attention"] + terms["compute.bwd.attention"]
    values = {S.b: batch, S.s: seq, S.a: heads, S.d: head_dim, S.dv: head_dim, S.cp: 1, S.tp: 1, S.ld: 1, S.le: 0,
              S.FLASH: 1, S.RSEL: 0, S.RFULL: 0, S.peak: peak, S.hbm_bw: hbm_bandwidth, S.w: dtype_bytes,
              S.eta_max: 1, S.kappa: kappa, S.x_attn: 1}
    return float(expr.xreplace(values))


def fit_attention(seconds: float, model_seconds: float) -> float:
    """``attention_factor``: the measured seconds of the attention kernel over the model's price of it
    as a GEMM (:func:`attention_model_seconds`)."""
    if not seconds > 0 or not model_seconds > 0:
        raise AutoparError("autopar: the attention kernel took no measurable time; cannot fit attention_factor")
    return seconds / model_seconds
