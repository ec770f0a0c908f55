"""Cluster: GPU presets, link classes, and which mesh axes cross node boundaries.

The time model (time.py) charges every collective on a mesh axis by an alpha-beta model
per link class: NVLink inside a node, the network across nodes. Which links an axis
uses follows from the mesh layout (:func:`autopar.plan_space.axis_geometry`: ``pp x dp x cp x tp``,
outer to inner, tp fastest; expert groups carved from ``dp x cp`` with stride tp): an axis of size
``n`` and rank stride ``st`` has ``r = min(n, G // st)`` members per node (``G`` GPUs per
node; ``r = 1`` once ``st >= G``) and spans ``N = ceil(n / r)`` nodes. Collectives are
taken to be hierarchical (NCCL-like): the intra-node part runs on NVLink and each GPU
drives its own network link for the inter-node part. :func:`axis_link_arrays` turns
that into seconds per byte and per call, vectorised over candidate plans.

The figures come from a preset's published table (:data:`GPU_PRESETS`) or from a hardware
profile measured on the machine by ``autopar calibrate`` (profile.py, :meth:`Cluster.from_profile`).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from autopar.errors import AutoparError
from autopar.plan_space import axis_geometry

from .profile import FIGURES, OPTIONAL_FIGURES, host_share, load_profile, profile_name

__all__ = ["Cluster", "GPU_PRESETS", "NODE_GPUS", "node_gpus", "whole_nodes", "axis_link_arrays"]

def _gpu(peak_flops: float, hbm_bytes: float, hbm_bandwidth: float, intra_node_bandwidth: float,
         inter_node_bandwidth: float = 50e9, *, gemm_efficiency: float = 0.75, intra_node_latency: float = 5e-6,
         inter_node_latency: float = 10e-6) -> dict[str, float]:
    """One preset's figures (bytes, bytes/s per direction, FLOP/s, seconds)."""
    return dict(gemm_efficiency=gemm_efficiency, peak_flops=peak_flops, hbm_bytes=hbm_bytes,
                hbm_bandwidth=hbm_bandwidth, intra_node_bandwidth=intra_node_bandwidth,
                intra_node_latency=intra_node_latency, inter_node_bandwidth=inter_node_bandwidth,
                inter_node_latency=inter_node_latency)


# Vendor figures (dense bf16 peaks, no sparsity); latencies are typical NCCL per-step figures (a
# few microseconds on NVLink, ~10 us across InfiniBand); the network default is one 400 Gb/s NIC per
# GPU. gemm_efficiency is the fraction of peak a large bf16 GEMM reaches (eta_max of time.py),
# fitted per GPU generation on calibration.md (calibration.py): A100s get closer to their peak
# than H100s do. B200, GB200 and MI300X take H100's fit: calibration.md has no GEMM table for
# them yet, so `autopar calibrate` on the machine is the better source.
GPU_PRESETS: dict[str, dict[str, float]] = {
    # A100, H100, H200: the figures of calibration.md.
    "a100": _gpu(312e12, 80 * 2**30, 2.0e12, 300e9, 25e9),
    "h100": _gpu(989e12, 80 * 2**30, 3.35e12, 450e9),
    "h200": _gpu(989e12, 141e9, 4.8e12, 450e9),
    # B200 in an HGX / DGX B200 (1,000 W): 2.25 PFLOP/s, 180 GB HBM3e at 8 TB/s, NVLink 5 at 1.8 TB/s
    # both ways (NVIDIA DGX B200 datasheet; per-precision table: glennklockwood.com/garden/processors/B200).
    "b200": _gpu(2.25e15, 180e9, 8.0e12, 900e9),
    # B200 in a GB200 NVL72 rack (1,200 W): 2.5 PFLOP/s; 13.4 TB HBM3e and 576 TB/s over 72 GPUs
    # (186 GB, 8 TB/s each); the NVLink domain is the rack's 72 GPUs (NODE_GPUS) (NVIDIA GB200 NVL72
    # product page; the same per-precision table).
    "gb200": _gpu(2.5e15, 186e9, 8.0e12, 900e9),
    # AMD Instinct MI300X: 1,307.4 TFLOP/s, 192 GB HBM3 at 5.3 TB/s (AMD MI300X datasheet); 8 GPUs
    # fully connected by Infinity Fabric, 7 links of 64 GB/s each way: 448 GB/s in all, which a
    # collective over the 8 GPUs drives (a pair alone gets one link; not modelled).
    "mi300x": _gpu(1307.4e12, 192e9, 5.3e12, 448e9),
    # A toy "accelerator" for tests and CPU runs: gloo over shared memory / loopback.
    "cpu": _gpu(1e11, 16 * 2**30, 2e10, 5e9, 1e9, gemm_efficiency=0.5, intra_node_latency=20e-6,
                inter_node_latency=100e-6),
}

NODE_GPUS: dict[str, int] = {"gb200": 72}
"""GPUs that share the fast links (a "node" of the time model) where a preset's domain is not the
8 GPUs of one server: GB200 NVL72's NVLink spans the rack.  Others default to 8."""
DEFAULT_NODE_GPUS = 8


def node_gpus(gpu: str) -> int:
    """The default ``gpus_per_node`` (fast-link domain) of a GPU preset."""
    return NODE_GPUS.get(gpu.lower(), DEFAULT_NODE_GPUS)


def whole_nodes(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """``(num_nodes, gpus_per_node)`` of ``world_size`` GPUs on nodes of ``gpus_per_node``: the one
    rule of how GPUs fill nodes (the CLI, the cost model's clusters and a program's own prediction
    ask it).  Fewer GPUs than a node make one partial node; more must fill whole nodes (a partial
    last node is not modelled)."""
    if world_size < 1 or gpus_per_node < 1:
        raise AutoparError(f"autopar: a cluster needs >= 1 GPU and >= 1 GPU per node, got {world_size} GPUs "
                           f"and {gpus_per_node} per node")
    if world_size <= gpus_per_node:
        return 1, world_size
    if world_size % gpus_per_node:
        lo = world_size // gpus_per_node * gpus_per_node
        raise AutoparError(
            f"autopar: {world_size} GPUs do not fill whole nodes of {gpus_per_node}; use a multiple of "
            f"{gpus_per_node} (e.g. {lo} or {lo + gpus_per_node}), or give the GPUs per node "
            f"(--gpus-per-node, gpus_per_node=)")
    return world_size // gpus_per_node, gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """A homogeneous GPU cluster. ``None`` overrides take the ``gpu`` preset's value.

    ``usable_memory_fraction`` is the share of HBM a plan may fill (the rest covers the
    CUDA context, the framework and allocator fragmentation).  ``gpus_per_node`` is the size of
    the fast-link domain (NVLink / Infinity Fabric); ``None`` takes the preset's (:data:`NODE_GPUS`,
    else 8: 72 for ``gb200``).  ``profile`` is the path of the hardware profile the figures were
    measured into (:meth:`from_profile`; ``None`` for a preset's published figures); it does not
    take part in comparisons.  ``elementwise_bandwidth``, ``optimizer_bandwidth`` (bytes/s of the
    time model's element-wise and optimizer byte counts), ``all_reduce_bandwidth``,
    ``all_gather_bandwidth``, ``reduce_scatter_bandwidth`` (each ring collective's own rate inside a
    node), ``attention_factor`` (the attention kernel's seconds over its price as a GEMM) and
    ``comm_overlap`` (the share of an asynchronous collective that compute hides, time.py's phi) are
    measured figures of a profile (:data:`autopar.cost.profile.OPTIONAL_FIGURES`); ``None``:
    ``hbm_bandwidth``, ``intra_node_bandwidth``, 1 and the calibrated phi.  ``collective_copies``:
    whether the collective backend copies the buffer of each reduce-scatter and all-gather it runs
    (gloo does, NCCL does not: the memory term ``collective_copies``); ``None``: gloo's for the CPU
    (the ``cpu`` preset and CPU profiles), NCCL's otherwise (:attr:`backend_copies`).  ``core_share``:
    the share of its cores each rank gets where more ranks than cores share a host (a CPU profile's,
    :func:`autopar.cost.profile.host_share`, which also scales the rates by it); below 1 a rank's idle
    time in the pipeline bubble goes to the host's other ranks (:func:`autopar.cost.model.shared_host_step`).
    """

    gpu: str = "h100"
    num_nodes: int = 1
    gpus_per_node: int | None = None
    peak_flops: float | None = None
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None
    intra_node_bandwidth: float | None = None
    intra_node_latency: float | None = None
    inter_node_bandwidth: float | None = None
    inter_node_latency: float | None = None
    gemm_efficiency: float | None = None
    elementwise_bandwidth: float | None = None
    optimizer_bandwidth: float | None = None
    all_reduce_bandwidth: float | None = None
    all_gather_bandwidth: float | None = None
    reduce_scatter_bandwidth: float | None = None
    attention_factor: float | None = None
    comm_overlap: float | None = None
    collective_copies: bool | None = None
    core_share: float = 1.0
    usable_memory_fraction: float = 0.9
    profile: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        gpu = self.gpu.lower()
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", node_gpus(gpu))
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
        for name in ("elementwise_bandwidth", "optimizer_bandwidth", "all_reduce_bandwidth", "all_gather_bandwidth",
                     "reduce_scatter_bandwidth", "attention_factor"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise AutoparError(f"autopar: Cluster.{name} must be > 0 or None, got {getattr(self, name)!r}")
        if self.comm_overlap is not None and not 0 <= self.comm_overlap <= 1:
            raise AutoparError(f"autopar: Cluster.comm_overlap must be in [0, 1] or None, got {self.comm_overlap!r}")
        if not 0 < self.core_share <= 1:
            raise AutoparError(f"autopar: Cluster.core_share must be in (0, 1], got {self.core_share!r}")
        if not 0 < self.usable_memory_fraction <= 1:
            raise AutoparError("autopar: usable_memory_fraction must be in (0, 1]")

    @property
    def backend_copies(self) -> bool:
        """Whether the collective backend copies each reduce-scatter's and all-gather's buffer (see the class)."""
        if self.collective_copies is not None:
            return bool(self.collective_copies)
        return self.gpu.startswith("cpu")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.hbm_bytes * self.usable_memory_fraction

    @classmethod
    def for_world(cls, gpu: str, world_size: int, gpus_per_node: int | None = None, **overrides) -> "Cluster":
        """The smallest cluster of ``gpu`` with ``world_size`` GPUs (a partial last node is not modelled);
        ``gpus_per_node`` defaults to the preset's fast-link domain (:func:`node_gpus`)."""
        num_nodes, per_node = whole_nodes(world_size, gpus_per_node or node_gpus(gpu))
        return cls(gpu=gpu, num_nodes=num_nodes, gpus_per_node=per_node, **overrides)

    @classmethod
    def from_profile(cls, path, *, num_nodes: int = 1, gpus_per_node: int | None = None, **overrides) -> "Cluster":
        """The cluster of a machine measured by ``autopar calibrate`` (cost/profile.py): every figure
        from the profile at ``path`` (the optional ones too), ``gpu`` its device (e.g. ``"cpu (measured)"``),
        ``profile`` the path; ``gpus_per_node`` defaults to the profile's, ``overrides`` replace figures.
        A CPU profile's figures are one rank's on ``threads_per_rank`` cores: more ranks on the host than
        it has cores for time-share them (:func:`autopar.cost.profile.host_share`)."""
        data = load_profile(path)
        per_node = data["gpus_per_node"] if gpus_per_node is None else gpus_per_node
        figures = {name: float(data[name]) for name in (*FIGURES, *OPTIONAL_FIGURES) if name in data}
        figures = host_share(data, per_node, figures)
        return cls(gpu=profile_name(data), num_nodes=num_nodes, gpus_per_node=per_node,
                   profile=os.fspath(path), **{**figures, **overrides})

    def replace(self, **changes) -> "Cluster":
        return dataclasses.replace(self, **changes)


def axis_link_arrays(cluster: Cluster, axis: str, tp, cp, dp, pp, ep, eps: float):
    """Per-axis link costs for arrays of plans.

    Returns ``(beta_ring, beta_a2a, alpha_ring, alpha_a2a)``: seconds per byte *sent by a
    rank* (the byte convention of docs/architecture.md) for ring collectives (all-gather, reduce-scatter,
    all-reduce) and for all-to-all / P2P, and seconds of latency per call (per unit of
    the collective's ring passes; an all-reduce is two passes).
    """
    tp, cp, dp, pp, ep = (np.asarray(x, dtype=np.int64) for x in (tp, cp, dp, pp, ep))
    stride, size = axis_geometry(axis, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
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
