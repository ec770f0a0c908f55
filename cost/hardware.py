"""Cluster: GPU presets, link classes, and which mesh axes cross node boundaries.

The time model (time.py) charges every collective on a mesh axis by an alpha-beta model
per link class: NVLink inside a node, the network across nodes. Which links an axis
uses follows from the mesh layout ``pp x dp x cp x tp`` (outer to inner, tp fastest;
expert groups are carved from ``dp x cp`` with stride tp, docs/architecture.md): an axis of size
``n`` and rank stride ``st`` has ``r = min(n, G // st)`` members per node (``G`` GPUs per
node; ``r = 1`` once ``st >= G``) and spans ``N = ceil(n / r)`` nodes. Collectives are
taken to be hierarchical (NCCL-like): the intra-node part runs on NVLink and each GPU
drives its own network link for the inter-node part. :func:`axis_link_arrays` turns
that into seconds per byte and per call, vectorised over candidate plans.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoparError

__all__ = ["Cluster", "GPU_PRESETS", "AXES", "axis_geometry", "axis_link_arrays"]

# Vendor figures from calibration.md (bytes, bytes/s, FLOP/s); latencies are typical NCCL
# per-step figures (a few microseconds on NVLink, ~10 us across InfiniBand). gemm_efficiency is
# the fraction of peak a large bf16 GEMM reaches (eta_max of time.py), fitted per GPU generation
# on calibration.md (calibration.py): A100s get closer to their peak than H100s do.
GPU_PRESETS: dict[str, dict[str, float]] = {
    "a100": dict(gemm_efficiency=0.75, peak_flops=312e12, hbm_bytes=80 * 2**30, hbm_bandwidth=2.0e12,
                 intra_node_bandwidth=300e9, intra_node_latency=5e-6,
                 inter_node_bandwidth=25e9, inter_node_latency=10e-6),
    "h100": dict(gemm_efficiency=0.75, peak_flops=989e12, hbm_bytes=80 * 2**30, hbm_bandwidth=3.35e12,
                 intra_node_bandwidth=450e9, intra_node_latency=5e-6,
                 inter_node_bandwidth=50e9, inter_node_latency=10e-6),
    "h200": dict(gemm_efficiency=0.75, peak_flops=989e12, hbm_bytes=141e9, hbm_bandwidth=4.8e12,
                 intra_node_bandwidth=450e9, intra_node_latency=5e-6,
                 inter_node_bandwidth=50e9, inter_node_latency=10e-6),
    # A toy "accelerator" for tests and CPU runs: gloo over shared memory / loopback.
    "cpu": dict(gemm_efficiency=0.5, peak_flops=1e11, hbm_bytes=16 * 2**30, hbm_bandwidth=2e10,
                intra_node_bandwidth=5e9, intra_node_latency=20e-6,
                inter_node_bandwidth=1e9, inter_node_latency=100e-6),
}

# Mesh axes the cost model uses: (name, stride, size) as functions of the degrees.
AXES = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous GPU cluster. ``None`` overrides take the ``gpu`` preset's value.

    ``usable_memory_fraction`` is the share of HBM a plan may fill (the rest covers the
    CUDA context, the framework and allocator fragmentation).
    """

    gpu: str = "h100"
    num_nodes: int = 1
    gpus_per_node: int = 8
    peak_flops: float | None = None
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None
    intra_node_bandwidth: float | None = None
    intra_node_latency: float | None = None
    inter_node_bandwidth: float | None = None
    inter_node_latency: float | None = None
    gemm_efficiency: float | None = None
    usable_memory_fraction: float = 0.9

    def __post_init__(self):
        gpu = self.gpu.lower()
        if gpu not in GPU_PRESETS:
            missing = [n for n in GPU_PRESETS["h100"] if getattr(self, n) is None]
            if missing:
                raise AutoparError(
                    f"autopar: unknown GPU {self.gpu!r} and no value for {', '.join(missing)}; "
                    f"use one of {', '.join(GPU_PRESETS)} or give every hardware figure"
                )
        else:
            object.__setattr__(self, "gpu", gpu)
            for name, value in GPU_PRESETS[gpu].items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, float(value))
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise AutoparError(
                f"autopar: a cluster needs num_nodes >= 1 and gpus_per_node >= 1, got "
                f"{self.num_nodes} and {self.gpus_per_node}"
            )
        for name in GPU_PRESETS["h100"]:
            if not float(getattr(self, name)) > 0 or (name == "gemm_efficiency" and self.gemm_efficiency > 1):
                raise AutoparError(f"autopar: Cluster.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.usable_memory_fraction <= 1:
            raise AutoparError("autopar: usable_memory_fraction must be in (0, 1]")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.hbm_bytes * self.usable_memory_fraction

    @classmethod
    def for_world(cls, gpu: str, world_size: int, gpus_per_node: int = 8, **overrides) -> "Cluster":
        """The smallest cluster of ``gpu`` with ``world_size`` GPUs (a partial last node is not modelled)."""
        per_node = min(gpus_per_node, world_size)
        if world_size % per_node:
            raise AutoparError(
                f"autopar: {world_size} GPUs do not fill whole nodes of {per_node}; give "
                f"num_nodes and gpus_per_node explicitly"
            )
        return cls(gpu=gpu, num_nodes=world_size // per_node, gpus_per_node=per_node, **overrides)

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)


def axis_geometry(axis: str, tp, cp, dp, pp, ep):
    """(stride, size) of ``axis`` in the rank layout; arguments may be numpy arrays."""
    table = {
        "tp": (1, tp),
        "cp": (tp, cp),
        "dp": (tp * cp, dp),
        "pp": (tp * cp * dp, pp),
        "dp_cp": (tp, dp * cp),
        "ep": (tp, ep),
        # the tp ranks of an expert replica are adjacent; the link class is set by the
        # dp*cp/ep outer replicas at stride tp*ep
        "edp": (tp * ep, dp * cp // ep),
    }
    return table[axis]


def axis_link_arrays(cluster: Cluster, axis: str, tp, cp, dp, pp, ep, eps: float):
    """Per-axis link costs for arrays of plans.

    Returns ``(beta_ring, beta_a2a, alpha_ring, alpha_a2a)``: seconds per byte *sent by a
    rank* (the byte convention of docs/architecture.md) for ring collectives (all-gather, reduce-scatter,
    all-reduce) and for all-to-all / P2P, and seconds of latency per call (per unit of
    the collective's ring passes; an all-reduce is two passes).
    """
    stride, size = axis_geometry(axis, *(np.asarray(x, dtype=np.int64) for x in (tp, cp, dp, pp, ep)))
    stride = np.broadcast_to(stride, np.broadcast(stride, size).shape)
    size = np.broadcast_to(size, stride.shape).astype(np.float64)
    per_node = cluster.gpus_per_node
    r = np.where(stride >= per_node, 1.0, np.minimum(size, per_node // np.maximum(stride, 1)))
    r = np.maximum(r, 1.0)
    nodes = np.ceil(size / r)
    bn, bx = cluster.intra_node_bandwidth * eps, cluster.inter_node_bandwidth * eps
    an, ax = cluster.intra_node_latency, cluster.inter_node_latency
    with np.errstate(divide="ignore", invalid="ignore"):
        # Hierarchical ring: intra-node share over NVLink, 1/r of the buffer per GPU on the network.
        ring_time_per_F = (r - 1) / r / bn + (nodes - 1) / nodes / (r * bx)
        beta_ring = np.where(size > 1, ring_time_per_F * size / (size - 1), 0.0)
        # All-to-all: of the (n-1)/n addressed to others, (r-1)/n stays in the node.
        beta_a2a = np.where(size > 1, ((r - 1) / bn + (size - r) / bx) / (size - 1), 0.0)
    if axis == "pp":  # P2P to the next stage: NVLink when both stages share a node
        beta_a2a = np.where(stride * 1 >= per_node, 1.0 / bx, 1.0 / bn) * np.ones_like(size)
    alpha_ring = (r - 1) * an + (nodes - 1) * ax
    alpha_a2a = np.where(nodes > 1, ax, np.where(size > 1, an, 0.0))
    return beta_ring, beta_a2a, alpha_ring, alpha_a2a
