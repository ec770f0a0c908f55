"""GPU presets of the cost model (cost/hardware.py): the accelerators users plan for in 2026, each
taken by ``autopar.Cluster``, ``estimate`` and ``autopar plan --gpu``, and GB200's 72-GPU NVLink
domain as the fast link class."""
from __future__ import annotations

import json

import pytest

from autopar.cli import main
from autopar.cost import Cluster, ModelSpec, estimate
from autopar.cost.hardware import GPU_PRESETS, axis_link_arrays


@pytest.mark.parametrize("gpu", ["b200", "gb200", "mi300x"])
def test_new_presets_plan(gpu, capsys):
    assert gpu in GPU_PRESETS
    cost = estimate(ModelSpec.preset("llama3-8b"), Cluster.for_world(gpu, 16), plan="tp=4,sp,dp=4",
                    seq_len=4096, global_batch=32)
    assert 0 < cost.mfu < 1
    rc = main(["plan", "--model", "llama3-8b", "--gpu", gpu, "--gpus", "16", "--seq", "4096",
               "--global-batch", "32", "--top", "3", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)


def test_published_figures():
    # Vendor sheets: B200 (HGX) 2.25 PFLOP/s dense bf16 and 8 TB/s; MI300X 1307.4 TFLOP/s, 192 GB.
    assert GPU_PRESETS["b200"]["peak_flops"] == 2.25e15
    assert GPU_PRESETS["b200"]["hbm_bandwidth"] == 8.0e12
    assert GPU_PRESETS["mi300x"]["peak_flops"] == 1307.4e12
    assert GPU_PRESETS["mi300x"]["hbm_bytes"] == 192e9


def test_gb200_nvlink_spans_the_rack():
    rack = Cluster(gpu="gb200")
    assert rack.gpus_per_node == 72 and rack.world_size == 72
    assert Cluster(gpu="b200").gpus_per_node == 8
    eight = Cluster(gpu="gb200", num_nodes=9, gpus_per_node=8)  # the same 72 GPUs cut into servers
    # a dp=64 all-reduce over tp=1: inside the rack it stays on NVLink; cut into 8-GPU nodes it
    # crosses the network (hierarchical: each GPU drives its own NIC), about 3x slower per byte
    beta_rack = axis_link_arrays(rack, "dp", 1, 1, 64, 1, 1, 1.0)[0]
    beta_cut = axis_link_arrays(eight, "dp", 1, 1, 64, 1, 1, 1.0)[0]
    assert float(beta_cut) > 2 * float(beta_rack)
    assert float(beta_rack) == pytest.approx(1 / GPU_PRESETS["gb200"]["intra_node_bandwidth"])


def test_unknown_gpu_is_refused_with_the_presets():
    with pytest.raises(Exception, match="autopar: unknown GPU 'b300'.*b200, gb200, mi300x"):
        Cluster(gpu="b300")
