"""Context parallelism (issue 4) on gloo ranks: equivalence, bytes, errors, load balance, inspect.

Every plan trains 3 SGD steps on gloo ranks and is compared with single-process training
on the same global batches (loss per step <= 1e-5, full state dict <= 1e-4, fp32).  The
same run's last-step collectives are compared with ``autopar.estimate(...).comm_table()``
per (phase, collective, axis): bytes sent, bytes received and the number of calls.  The
single-process CP tests (plan errors, the inspected program, block attention) are
tests/unit/test_cp.py.
"""
from __future__ import annotations

import collections
import functools

import pytest

import autopar
from tests.support.comm_check import model_spec
from tests.support.cp_jobs import bad_sequence_job, blocks_job
from tests.support.harness import OPTIMIZERS, assert_equivalent, make_batches, reference_train, run_distributed
from tests.support.jobs import BATCH, SEQ, VOCAB, build, train_job

# Ulysses with tp=2 splits heads over tp*cp = 4: it needs 4 K/V heads (the others keep GQA, 2 K/V heads).
_KV4 = {"example": {"num_kv_heads": 4}, "hf_llama": {"num_key_value_heads": 4}}
PLANS = [("cp=2:allgather", 2), ("cp=2:ring", 2), ("cp=2:ulysses", 2), ("cp=4:ring", 4),
         ("cp=2:ulysses,tp=2,sp", 4), ("cp=2:ring,dp=2", 4),
         ("cp=2:allgather,tp=2", 4), ("cp=2:ring,mb=2", 2)]  # beyond the list: TP without SP, mb
MODEL_NAMES = ["example", "hf_llama"]


def _overrides(model_name: str, plan: str) -> dict:
    return dict(_KV4[model_name]) if "ulysses" in plan and "tp=2" in plan else {}


@functools.lru_cache(maxsize=None)
def _train(model_name: str, plan: str, world: int):
    return run_distributed(train_job, model_name, plan, "sgd", _overrides(model_name, plan), world=world)


@functools.lru_cache(maxsize=None)
def _reference(model_name: str, overrides: tuple):
    _, loss_fn, kwargs = build(model_name, dict(overrides))
    batches = make_batches(VOCAB, BATCH, SEQ, 3, seed=1)
    return reference_train(lambda: build(model_name, dict(overrides))[0], batches, loss_fn,
                           OPTIMIZERS["sgd"], kwargs)


@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_cp_matches_single_process(dist_pool, model_name, plan, world):
    results = _train(model_name, plan, world)
    for r in results:  # every rank reports the same global mean loss
        assert r["losses"] == results[0]["losses"]
    ref = _reference(model_name, tuple(sorted(_overrides(model_name, plan).items())))
    assert_equivalent(ref, (results[0]["losses"], results[0]["state"]))


def _totals(items) -> dict:
    out = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for phase, op, axis, sent, recv, count in items:
        out[(phase, op, axis)][0] += sent * count
        out[(phase, op, axis)][1] += recv * count
        out[(phase, op, axis)][2] += count
    return dict(out)


@pytest.mark.parametrize("plan,world", PLANS, ids=[p for p, _ in PLANS])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_cp_bytes_equal_cost_model(dist_pool, model_name, plan, world):
    results = _train(model_name, plan, world)
    spec = model_spec(model_name, _overrides(model_name, plan), BATCH)
    cluster = autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world)
    cost = autopar.estimate(spec, cluster, plan, seq_len=SEQ, global_batch=BATCH, dtype_bytes=4)
    predicted = _totals((r.phase, r.collective, r.axis, r.bytes_sent, r.bytes_recv, r.count)
                        for r in cost.comm_table())
    assert any(axis == "cp" for _, _, axis in predicted)
    for rank, r in enumerate(results):
        measured = _totals((c["phase"], c["op"], c["axis"], c["bytes_sent"], c["bytes_recv"], 1)
                           for c in r["comm"])
        assert set(measured) == set(predicted), (rank, sorted(measured), sorted(predicted))
        for key, (sent, recv, count) in measured.items():
            assert (sent, recv, count) == pytest.approx(tuple(predicted[key]), rel=1e-12, abs=0), (rank, key)


def test_cp_bytes_by_hand_ring_and_allgather(dist_pool):
    """The CP rows derived by hand for the example model (2 layers, 2 K/V heads of 16, fp32)."""
    kv = (BATCH * SEQ // 2) * 2 * 16 * 4 * 2          # packed K and V of one layer on one rank (bytes)
    ring = collections.Counter()
    for c in _train("example", "cp=2:ring", 2)[0]["comm"]:
        if c["axis"] == "cp":
            ring[(c["phase"], c["op"])] += c["bytes_sent"] + c["bytes_recv"]
    # forward: one K,V hop per layer; backward: one K,V hop and one dK,dV hop per layer
    assert ring == {("fwd", "send"): 2 * kv, ("fwd", "recv"): 2 * kv,
                    ("bwd", "send"): 4 * kv, ("bwd", "recv"): 4 * kv}
    ag = collections.Counter()
    for c in _train("example", "cp=2:allgather", 2)[0]["comm"]:
        if c["axis"] == "cp":
            ag[(c["phase"], c["op"])] += c["bytes_sent"]
    assert ag == {("fwd", "all_gather"): 2 * kv, ("bwd", "reduce_scatter"): 2 * kv}


@pytest.mark.parametrize("plan,world", [("cp=2:allgather", 2), ("cp=2:ring", 2), ("cp=4:ring", 4),
                                        ("cp=2:ulysses", 2)])
def test_load_balanced_score_blocks(dist_pool, plan, world):
    cp = int(plan.split("=")[1].split(":")[0])
    counts = run_distributed(blocks_job, "example", plan, {}, SEQ, world=world)
    layers = 2
    for rank, got in enumerate(counts):
        if "ulysses" in plan:  # every rank sees the whole sequence: the causal lower triangle of chunks
            expected = 2 * cp * (2 * cp + 1) // 2
        else:  # query chunks r and 2cp-1-r, each against the key chunks at or before it
            expected = (rank + 1) + (2 * cp - rank)
        assert got == layers * expected, (rank, got)
    assert max(counts) - min(counts) <= layers  # at most one block per attention op


def test_sequence_not_split_into_2cp_chunks(dist_pool):
    messages = run_distributed(bad_sequence_job, "example", "cp=2:ring", 18, world=2)
    assert all(m.startswith("autopar:") and "2*cp = 4" in m for m in messages), messages


@pytest.mark.parametrize("plan", ["cp=2:ring", "cp=2:allgather", "cp=2:ulysses"])
def test_inspect_bytes_match_measured(dist_pool, plan):
    """The bytes printed on each CP node, summed, equal what the running program sent on cp."""
    from autopar.passes.context import META_KEY
    from autopar.runtime import compile_program

    model, loss_fn, kwargs = build("example", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    traced, ctx = compile_program(model, inputs, kwargs, plan, loss_fn, world_size=2)
    subs = {ctx.batch_symbol: BATCH, ctx.seq_symbol: SEQ // 2}  # this rank's batch and sequence chunk
    printed = collections.Counter()
    for node in traced.gm.graph.nodes:
        meta = node.meta.get(META_KEY) or {}
        if meta.get("axis") == "cp" and meta.get("bytes"):
            for phase, (_, nbytes) in meta["bytes"].items():
                printed[phase] += float(nbytes.subs(subs))
    measured = collections.Counter()
    for c in _train("example", plan, 2)[0]["comm"]:
        if c["axis"] == "cp":
            measured[c["phase"]] += c["bytes_sent"]
    assert printed == measured and printed["fwd"] > 0
