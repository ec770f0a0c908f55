"""The private torch APIs of autopar/compat.py that need a process group: mesh flattening and
the recording pipeline stage, under a fake process group in one process
(``torch.testing._internal.distributed.fake_pg``, no peers).  The rest: tests/unit/test_compat.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar import compat


def _fake_world(size: int, rank: int = 0) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)


def test_flatten_mesh_and_recording_stage_under_a_fake_group():
    from torch.distributed.device_mesh import init_device_mesh

    _fake_world(4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        flat = compat.flatten_mesh(mesh, ("dp", "cp"), "dp_cp")
        assert flat.size() == 4 and flat.get_local_rank() == 0
        seen = []
        stage_cls = compat.recording_stage_class(lambda ops, phase, index: seen.append((phase, index)))
        stage = stage_cls(torch.nn.Linear(2, 2), 0, 4, torch.device("cpu"), group=dist.group.WORLD)
        for name in ("get_fwd_recv_ops", "get_fwd_send_ops", "get_bwd_recv_ops", "get_bwd_send_ops"):
            assert name in vars(type(stage)), f"PipelineStage no longer has {name}"
            assert callable(getattr(super(stage_cls, stage), name))
    finally:
        dist.destroy_process_group()
