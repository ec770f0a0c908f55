"""``pm.last_step_stats`` holds the measured step time and, given a hardware profile, the cost
model's predicted one (``predicted_seconds``, from ``pm.predicted_cost``, the plan's Cost on the
profiled machine); on a CPU without a profile it holds no prediction.  Their closeness is
benchmarks/fidelity.py's business (docs/performance.md, "Time-model fidelity"), not this test's."""
from __future__ import annotations

import json

import pytest

from autopar import Plan
from autopar.cost.profile import FORMAT
from tests.support.prediction_jobs import stats_job

# A hand-written CPU profile: two cores, one thread per rank (the figures' size does not matter here).
PROFILE = {"format": FORMAT, "device": "cpu", "gpus_per_node": 2, "gemm_efficiency": 1.0, "peak_flops": 1e11,
           "hbm_bytes": 8 * 2**30, "hbm_bandwidth": 1e10, "intra_node_bandwidth": 1e9, "intra_node_latency": 1e-4,
           "inter_node_bandwidth": 1e9, "inter_node_latency": 1e-4, "elementwise_bandwidth": 5e9,
           "optimizer_bandwidth": 5e9, "comm_overlap": 0.0, "host_cores": 2, "threads_per_rank": 1}


@pytest.mark.parametrize("plan,world", [("dp=2", 2), ("pp=2:1f1b,mb=2", 2)])
def test_stats_hold_measured_and_predicted(dist_pool, tmp_path, plan, world):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    for r in dist_pool(stats_job, plan, str(path), world=world):
        stats, cost = r["stats"], r["cost"]
        assert stats["seconds"] > 0 and stats["tokens"] == 4 * 16
        assert cost is not None and stats["predicted_seconds"] == cost["step_time"] > 0
        assert stats["predicted_tokens_per_s"] == pytest.approx(stats["tokens"] / stats["predicted_seconds"])
        assert 0 < stats["predicted_mfu"] < 1
        # the plan on the ranks of this host, with the step's batch and sequence
        assert (cost["gpu"], cost["gpus_per_node"], cost["plan"]) == ("cpu (measured)", world, str(Plan.parse(plan)))
        assert (cost["global_batch"], cost["seq_len"]) == (4, 16)


def test_no_prediction_on_a_cpu_without_a_profile(dist_pool):
    for r in dist_pool(stats_job, "dp=2", None, world=2):
        assert r["stats"]["seconds"] > 0 and "predicted_seconds" not in r["stats"] and r["cost"] is None
