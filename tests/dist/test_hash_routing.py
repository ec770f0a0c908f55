"""Hash routing (DeepSeek-V4's first layers) on gloo ranks: equal to one process.

The tiny ``hash_moe`` model (tests/support/models.py) routes each token to the experts its id's row
of a fixed table names, drawn at random over the experts so every expert gets rows.  Under dp the
experts run as traced on each rank's tokens, their looked-up ids checked at run time; under ep the
block is rewritten to dispatch by those ids.  Three SGD steps against one process, as every plan.
"""
from __future__ import annotations

import pytest

from tests.dist.test_equivalence import _check

pytest.importorskip("transformers")


@pytest.mark.parametrize("plan", ["dp=2", "dp=2,zero=3", "ep=2,dp=2"])
def test_hash_routing_matches_single_process(dist_pool, plan):
    _check(dist_pool, "hash_moe", plan, 2, "sgd", overrides={})
