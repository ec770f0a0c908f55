"""Calibration against calibration.md (sets A, B, C): error bounds and search sanity.

Recomputes the table of docs/cost-model.md: the median absolute MFU error must stay within
10% (relative) and no row beyond 25%; set C's activation memory must match Korthikanti et
al.'s published figures, and the weights + optimizer theirs up to the embedding we add on
the first pp rank.  That the search finds, for every published run, a plan predicted no slower
than the published one: tests/e2e/test_search_published.py (a search per run).
"""
from __future__ import annotations

import pathlib
import statistics

import pytest

from autopar.cost.calibration import GIB, calibration_rows, calibration_table
from autopar.cost.flops import megatron_flops

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "cost-model.md"


@pytest.fixture(scope="module")
def table():
    return calibration_table()


def test_every_published_row_is_in_the_table(table):
    runs = [e for e in table if e["mfu_err"] is not None]
    assert [e["set"] for e in runs].count("A") == 9
    assert [e["set"] for e in runs].count("B") == 10
    assert [e["set"] for e in runs].count("C") == 8  # 4 models x (SP + selective, full recompute)
    # Every published run fits in 80 GB by our memory model (set A's 314B and 462B did not while the
    # runtime kept the all-gathered SP input of each GEMM; it re-gathers it now, as Megatron does,
    # autopar/ops/regather.py) -- but for the receive buffers of torch.distributed.pipelining, which
    # autopar's pipelines run on: a stage keeps one per micro-batch (Megatron's do not), so the runs
    # of 280 and 512 micro-batches do not fit autopar's runtime as published (cost/memory.py).
    usable = 80 * 0.9
    too_big = [e for e in runs if not e["fits"]]
    assert {"1008B", "1T full recompute"} <= {e["name"] for e in too_big}  # 512 micro-batches: ~100 GiB of them
    for e in too_big:
        assert "pp=" in e["plan"] and e["memory_gib"] - e["pipeline_buffers_gib"] <= usable, e["name"]


def test_mfu_error_bounds(table):
    errs = [abs(e["mfu_err"]) for e in table if e["mfu_err"] is not None]
    assert statistics.median(errs) <= 0.10
    assert max(errs) <= 0.25


def test_mfu_is_flops_over_time_in_the_published_convention(table):
    # Set C's 22B row, by hand: 72*B*s*l*h^2*(1 + s/6h + V/12lh) over time * GPUs * 312 TFLOP/s.
    row = next(e for e in table if e["name"] == "22B SP+selective")
    b, s, l, h, v = 4, 2048, 48, 6144, 51200
    flops = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert row["mfu_pred"] == pytest.approx(flops / (row["time_pred"] * 8 * 312e12), rel=1e-9)
    # and the published MFU is consistent with the published time (41.5% in the paper)
    assert flops / (1.10 * 8 * 312e12) == pytest.approx(0.415, abs=0.002)


def test_set_b_uses_the_recompute_flop_formula():
    row = next(r for r in calibration_rows() if r.set == "B" and r.name == "1.7B")
    b, s, l, h, v = 512, 2048, 24, 2304, 51200
    assert megatron_flops(row.spec, s, b, recompute=True) == pytest.approx(
        96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=1e-12)


def test_set_c_activation_memory(table):
    for e in table:
        if e.get("act") is not None:
            assert e["act_pred"] == pytest.approx(e["act"], rel=0.005), e["name"]


def test_set_c_weights_and_optimizer(table):
    for e in table:
        if e.get("wo") is not None:
            # We add the first pp rank's vocab-parallel embedding (18 B per parameter), they do not.
            row = next(r for r in calibration_rows() if r.name == e["name"])
            embedding = row.spec.vocab * row.spec.hidden / 8 * 18 / GIB
            assert e["wo_pred"] == pytest.approx(e["wo"] + embedding, rel=0.01), e["name"]


def test_docs_table_matches(table):
    text = DOCS.read_text(encoding="utf-8")
    for e in table:
        if e["mfu_err"] is not None:
            cell = f"| {e['mfu'] * 100:.1f}% | {e['mfu_pred'] * 100:.1f}% |"
            assert f"| {e['set']} | {e['name']} |" in text and cell in text, e["name"]
