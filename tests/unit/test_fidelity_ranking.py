"""benchmarks/fidelity.py's ranking figures: Kendall's tau and the regret of the predicted-fastest plan.

By hand on small tables, so that the figures docs/performance.md quotes mean what they say."""
from __future__ import annotations

import pytest

from benchmarks.fidelity import kendall_tau, ranking


def test_kendall_tau_by_hand():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1
    # one discordant pair of six (3 and 4 swapped): (5 - 1) / 6
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)


def _result(plan, world, predicted, measured):
    return {"plan": plan, "world": world, "status": "ok", "predicted_s": predicted, "step_s": measured}


def test_ranking_per_world_size():
    results = [_result("none", 1, 1.0, 1.0),
               _result("dp=2", 2, 0.5, 0.60), _result("tp=2,sp", 2, 0.4, 0.66), _result("pp=2", 2, 0.7, 0.7),
               {"plan": "cp=2", "world": 2, "status": "no prediction", "step_s": 0.1}]
    out = ranking(results)
    assert out[1] == {"plans": 1, "tau": pytest.approx(float("nan"), nan_ok=True), "predicted_best": "none",
                      "measured_best": "none", "regret": 0.0}
    two = out[2]
    assert (two["plans"], two["predicted_best"], two["measured_best"]) == (3, "tp=2,sp", "dp=2")
    assert two["regret"] == pytest.approx(0.66 / 0.60 - 1)
    # pairs: (dp, tp) discordant, (dp, pp) concordant, (tp, pp) concordant
    assert two["tau"] == pytest.approx(1 / 3)
