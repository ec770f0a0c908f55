"""For every published run of calibration.md (sets A, B, C), the search on the same model, cluster,
sequence and batch finds a plan that fits and is predicted no slower than the published plan.
A search over clusters of up to 6,144 GPUs per run, so not in the fast tier; the calibration's
error bounds: tests/unit/test_calibration.py."""
from __future__ import annotations

import pytest

from autopar.cost.calibration import calibration_rows, predict
from autopar.planning.search import search


RUNS = [r for r in calibration_rows() if r.mfu == r.mfu]


@pytest.mark.parametrize("row", RUNS, ids=[f"{r.set}-{r.name}" for r in RUNS])
def test_search_is_no_worse_than_the_published_plan(row):
    published, _ = predict(row)
    found = search(row.spec, row.cluster, row.seq_len, row.global_batch, top=1, **row.options)
    assert found and found[0][1].fits
    if published.fits:  # else the published plan is no candidate (test_every_published_row_is_in_the_table)
        assert found[0][1].step_time <= published.step_time * (1 + 1e-9)
