"""Comparing what a run's collectives moved with the cost model's ``comm_table()``.

Not a test module: the byte-equality tests (TP/SP/DP, ZeRO, PP, CP) share these helpers.
Both sides are summed per (phase, collective, mesh axis): bytes sent, bytes received and
the number of calls per step.  Records that carry the same step's wire calls
(:class:`tests.support.wire.WireRecords`, from a job that ran :func:`~tests.support.wire.guard_program`)
are first checked against them: every collective that entered torch.distributed is recorded.
"""
from __future__ import annotations

import collections

import pytest

import autopar
from tests.support.harness import make_batches
from tests.support.jobs import SEQ, VOCAB, build
from tests.support.wire import wire_problems

__all__ = ["measured_by_kind", "predicted_by_kind", "assert_comm_equal", "assert_wire_matches_records",
           "predicted_cost"]


def measured_by_kind(records) -> dict:
    out = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in records:
        key = (r["phase"], r["op"], r["axis"])
        out[key][0] += r["bytes_sent"]
        out[key][1] += r["bytes_recv"]
        out[key][2] += 1
    return dict(out)


def predicted_by_kind(rows) -> dict:
    out = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for row in rows:
        key = (row.phase, row.collective, row.axis)
        out[key][0] += row.bytes_sent * row.count
        out[key][1] += row.bytes_recv * row.count
        out[key][2] += row.count
    return dict(out)


def assert_wire_matches_records(records, rank=None) -> None:
    """The wire-level guard (tests/support/wire.py): every collective and point-to-point call of the
    measured step, counted where it entered torch.distributed, has its record, call for call and
    byte for byte; a call without one fails, naming its operator.  ``records`` must carry the wire."""
    wire = getattr(records, "wire", None)
    assert wire is not None, (rank, "these records carry no wire calls: the job did not guard_program()")
    problems = wire_problems(records, wire)
    assert not problems, (rank, "collectives on the wire without their record:\n" + "\n".join(problems))


def assert_comm_equal(records, rows, rank=None, *, wire: bool | None = None) -> None:
    """Every kind of collective: the same calls, and exactly the same bytes both ways; first, when the
    records carry the step's wire calls (or ``wire=True``, which requires them),
    :func:`assert_wire_matches_records`."""
    if wire or (wire is None and getattr(records, "wire", None) is not None):
        assert_wire_matches_records(records, rank)
    measured, predicted = measured_by_kind(records), predicted_by_kind(rows)
    assert set(measured) == set(predicted), (rank, sorted(measured), sorted(predicted))
    for key, (sent, recv, count) in measured.items():
        p_sent, p_recv, p_count = predicted[key]
        assert count == p_count, (rank, key, count, p_count)
        assert sent == pytest.approx(p_sent, rel=1e-12, abs=0), (rank, key, sent, p_sent)
        assert recv == pytest.approx(p_recv, rel=1e-12, abs=0), (rank, key, recv, p_recv)


def predicted_cost(model_name: str, overrides: dict, plan: str, world: int, batch: int, dtype_bytes: int = 4):
    """The cost model's ``Cost`` for a test model, shapes and plan (fp32 unless ``dtype_bytes=2``,
    bf16 mixed precision; ``world`` CPU ranks)."""
    spec = model_spec(model_name, overrides, batch)
    cluster = autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world)
    return autopar.estimate(spec, cluster, plan, seq_len=SEQ, global_batch=batch, dtype_bytes=dtype_bytes)


_SPECS: dict = {}


def model_spec(model_name: str, overrides: dict, batch: int, seq: int = SEQ):
    """``ModelSpec.from_module`` of a test model, traced once per model and shapes (the spec is
    frozen: every plan of a byte or memory test prices the same one)."""
    key = (model_name, repr(sorted(overrides.items())), batch, seq)
    if key not in _SPECS:
        model, _, kwargs = build(model_name, overrides)
        (inputs, _), = make_batches(VOCAB, batch, seq, 1, seed=1)
        _SPECS[key] = autopar.ModelSpec.from_module(model, inputs, kwargs)
    return _SPECS[key]


def assert_memory_report_equals_cost_model(dist_pool, model_name: str, plan: str, overrides: dict, world: int,
                                           batch: int, seq: int, flash_attention: bool = True) -> None:
    """``memory_report()`` after two AdamW steps on every rank: parameters, gradients and optimizer
    state equal the cost model's terms; saved activations within 10% of its activation terms
    (``flash_attention``: the cost model's, False where SDPA's math kernel runs)."""
    from tests.support.zero_jobs import memory_plans_job

    reports = dist_pool(memory_plans_job, model_name, [plan], batch, overrides, seq, world=world)
    cost = autopar.estimate(model_spec(model_name, overrides, batch),
                            autopar.Cluster(gpu="cpu", num_nodes=1, gpus_per_node=world), plan,
                            seq_len=seq, global_batch=batch, dtype_bytes=4, flash_attention=flash_attention)
    predicted = cost.memory()
    activations = (predicted["activations"] + predicted["embedding_activations"]
                   + predicted["head_activations"] + predicted["recompute_buffer"])
    for (r,) in reports:
        for key in ("params", "grads", "optimizer"):
            assert r[key] == predicted[key], (key, r[key], predicted[key])
        assert abs(r["activations"] - activations) <= 0.10 * activations, (r["activations"], activations)
