"""Tests of the multi-rank harness itself (tests/support/harness.py): that it runs, and can fail.

The job functions below are module level so the spawned ranks can import them.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import (
    OPTIMIZERS,
    JobTimeout,
    RankError,
    assert_equivalent,
    get_pool,
    make_batches,
    next_token_loss,
    reference_train,
)

__all__: list[str] = []


# ----------------------------------------------------------------------------- jobs (run on ranks)


def _all_reduce_rank_plus_one():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t


def _raise_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    # The healthy ranks block in a collective the failed rank never joins.
    dist.barrier()
    return "unreachable"


def _mesh_all_reduce(step: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed import distributed_c10d as c10d

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    t = torch.tensor([float(rank + step)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    u = torch.tensor([float(rank + step)])
    dist.all_reduce(u, group=mesh.get_group("dp"))
    return t.item(), u.item(), len(c10d._world.pg_map)


def _count_groups():
    from torch.distributed import distributed_c10d as c10d
    return len(c10d._world.pg_map)


def _leave_global_state():
    drawn = torch.rand(1).item()
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.environ["AUTOPAR_HARNESS_LEAK"] = "1"
    torch.manual_seed(1234)
    return drawn


def _read_global_state():
    return (torch.get_default_dtype(), torch.is_grad_enabled(),
            os.environ.get("AUTOPAR_HARNESS_LEAK"), torch.rand(1).item())


def _exit_on_rank(bad_rank: int):
    if dist.get_rank() == bad_rank:
        os._exit(3)
    dist.barrier()


def _sleep(seconds: float):
    time.sleep(seconds)


def _pid():
    return os.getpid()


# ----------------------------------------------------------------------------- pool tests


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce_sums_on_every_rank(dist_pool, world):
    results = dist_pool(_all_reduce_rank_plus_one, world=world)
    expected = world * (world + 1) / 2  # 1 + 2 + ... + world
    assert [r[:2] for r in results] == [(r, world) for r in range(world)]
    assert all(r[2].item() == expected for r in results)


def test_job_by_name_and_pool_reuse(dist_pool):
    first = dist_pool(f"{__name__}:_pid", world=2)
    second = dist_pool(_pid, world=2)
    assert len(set(first)) == 2
    assert first == second  # same processes served both jobs


def test_rank_error_names_rank_and_pool_recovers(dist_pool):
    pids_before = dist_pool(_pid, world=2)
    with pytest.raises(RankError) as info:
        dist_pool(_raise_on_rank, 1, world=2, timeout=60)
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exception, ValueError)
    assert "rank 1" in str(err) and "_raise_on_rank" in str(err)
    assert "deliberate failure on rank 1" in err.remote_traceback
    assert "Traceback" in err.remote_traceback and "_raise_on_rank" in err.remote_traceback
    # A fresh pool serves the next job.
    results = dist_pool(_all_reduce_rank_plus_one, world=2)
    assert [r[2].item() for r in results] == [3.0, 3.0]
    assert set(dist_pool(_pid, world=2)).isdisjoint(pids_before)


def test_dead_rank_is_reported_and_pool_recovers(dist_pool):
    with pytest.raises(RankError, match=r"rank 1 process exited with code 3.*_exit_on_rank") as info:
        dist_pool(_exit_on_rank, 1, world=2, timeout=60)
    assert info.value.rank == 1
    assert dist_pool(_all_reduce_rank_plus_one, world=2)[1][2].item() == 3.0


def test_unpicklable_arguments_leave_pool_running(dist_pool):
    pids = dist_pool(_pid, world=2)
    with pytest.raises(TypeError, match="cannot be pickled"):
        dist_pool(_pid, lambda: 0, world=2)
    assert dist_pool(_pid, world=2) == pids


def test_device_mesh_in_consecutive_jobs(dist_pool):
    baseline = dist_pool(_count_groups, world=4)
    for step in range(4):
        results = dist_pool(_mesh_all_reduce, step, world=4)
        for rank, (tp_sum, dp_sum, _) in enumerate(results):
            # tp varies fastest: tp group of rank r is {2*(r//2), 2*(r//2)+1}, dp is {r%2, r%2+2}.
            tp_peers = [2 * (rank // 2), 2 * (rank // 2) + 1]
            dp_peers = [rank % 2, rank % 2 + 2]
            assert tp_sum == sum(p + step for p in tp_peers)
            assert dp_sum == sum(p + step for p in dp_peers)
    # Sub-groups are dropped after each job: nothing accumulates.
    assert dist_pool(_count_groups, world=4) == baseline == [1] * 4


def test_global_state_reset_between_jobs(dist_pool):
    first = dist_pool(_leave_global_state, world=2)
    dtype, grad, env, rand = dist_pool(_read_global_state, world=2)[0]
    assert (dtype, grad, env) == (torch.float32, True, None)
    assert rand == first[0]  # each job starts from the same seed
    torch.manual_seed(0)
    assert rand == torch.rand(1).item()


def test_timeout_kills_pool_and_names_job(dist_pool):
    # World 1 so that restarting after the kill costs one process, not many.
    pid = dist_pool(_pid, world=1)[0]
    old_pool = get_pool(1)
    with pytest.raises(JobTimeout, match=r"_sleep.*within 2 s"):
        dist_pool(_sleep, 60, world=1, timeout=2)
    assert not old_pool.alive
    assert dist_pool(_pid, world=1)[0] != pid


def test_unimportable_job_is_rejected(dist_pool):
    with pytest.raises(ValueError, match="not importable"):
        dist_pool(lambda: 1, world=1)
    with pytest.raises(ValueError, match="module:qualname"):
        dist_pool("no_colon_here", world=1)


# ----------------------------------------------------------------------------- reference helpers


def test_make_batches_shapes_and_shift():
    batches = make_batches(vocab_size=11, batch=3, seq=5, num_steps=2, seed=7)
    assert len(batches) == 2
    for (ids,), target in batches:
        assert ids.shape == target.shape == (3, 5)
        assert ids.dtype == target.dtype == torch.int64
        assert torch.equal(ids[:, 1:], target[:, :-1])
        assert int(ids.min()) >= 0 and int(ids.max()) < 11
    again = make_batches(vocab_size=11, batch=3, seq=5, num_steps=2, seed=7)
    assert torch.equal(again[1][0][0], batches[1][0][0])
    assert not torch.equal(batches[0][0][0], batches[1][0][0])


class _TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.embed(ids))


def _build_tiny():
    torch.manual_seed(3)
    return _TinyLM()


def test_reference_train_matches_hand_loop():
    batches = make_batches(16, 2, 4, 3, seed=1)
    losses, state = reference_train(_build_tiny, batches, next_token_loss, OPTIMIZERS["sgd"])
    model = _build_tiny()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    expected = []
    for (ids,), target in batches:
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads):
                p -= 0.1 * g
        expected.append(loss.item())
    assert losses == pytest.approx(expected, abs=1e-6)
    assert set(state) == {"embed.weight", "head.weight", "head.bias"}
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, atol=1e-6, rtol=0)
        assert (state[k] - initial[k]).abs().max() > 1e-3  # training moved it


def _reference_job(optimizer: str):
    batches = make_batches(16, 2, 4, 3, seed=1)
    return reference_train(_build_tiny, batches, next_token_loss, OPTIMIZERS[optimizer])


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_reference_in_workers_matches_parent(dist_pool, optimizer):
    # What the equivalence tests rely on: a model built and trained on a rank equals
    # the one built in the test process (same seed, one thread vs several).
    here = _reference_job(optimizer)
    for rank_result in dist_pool(_reference_job, optimizer, world=2):
        assert_equivalent(here, rank_result, loss_atol=1e-6, param_atol=1e-6)


def _result():
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4), "n": torch.tensor([3])}
    return [2.5, 2.25, 2.0], state


def _copy(result):
    losses, state = result
    return list(losses), {k: v.clone() for k, v in state.items()}


def test_assert_equivalent_passes_on_identical_and_small_noise():
    ref = _result()
    assert_equivalent(ref, _copy(ref))
    losses, state = _copy(ref)
    state["a"] += 5e-5
    assert_equivalent(ref, ([x + 5e-6 for x in losses], state))


def test_assert_equivalent_reports_perturbed_tensor():
    ref = _result()
    losses, state = _copy(ref)
    state["b"][2] += 1e-3
    state["a"][0, 0] -= 0.5
    with pytest.raises(AssertionError) as info:
        assert_equivalent(ref, (losses, state))
    msg = str(info.value)
    assert "2 of 3 tensors" in msg
    assert msg.index("a: max |diff| 0.5") < msg.index("b: max |diff| 0.001")


def test_assert_equivalent_reports_missing_and_extra_keys():
    ref = _result()
    losses, state = _copy(ref)
    del state["b"]
    state["c"] = torch.zeros(1)
    with pytest.raises(AssertionError, match=r"missing keys \(1\): b") as info:
        assert_equivalent(ref, (losses, state))
    assert "unexpected keys (1): c" in str(info.value)


def test_assert_equivalent_reports_loss_mismatch_and_nan():
    ref = _result()
    losses, state = _copy(ref)
    losses[1] += 1e-3
    with pytest.raises(AssertionError, match=r"step 1: reference 2.25"):
        assert_equivalent(ref, (losses, state))
    losses, state = _copy(ref)
    losses[2] = float("nan")
    with pytest.raises(AssertionError, match="step 2"):
        assert_equivalent(ref, (losses, state))
    with pytest.raises(AssertionError, match="loss count"):
        assert_equivalent(ref, (losses[:2], state))


def test_assert_equivalent_reports_shape_dtype_and_int_mismatch():
    ref = _result()
    losses, state = _copy(ref)
    state["a"] = state["a"].reshape(3, 2)
    state["b"] = state["b"].double()
    state["n"] = torch.tensor([4])
    with pytest.raises(AssertionError) as info:
        assert_equivalent(ref, (losses, state))
    msg = str(info.value)
    assert "shape of a: reference (2, 3), got (3, 2)" in msg
    assert "dtype of b" in msg
    assert "n: max |diff| inf" in msg
