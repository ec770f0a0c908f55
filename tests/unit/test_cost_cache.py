"""The disk cache of the lambdified cost formulas (cost/cache.py).

A model loaded from the cache must score exactly as the freshly lambdified one (same
arrays, bit for bit: the cache stores the code the fresh compile generated), build no
sympy formula until one is asked for, and never be read under another key; a damaged
entry or an unwritable directory falls back to compiling.
"""
from __future__ import annotations

import numpy as np
import pytest
import sympy

import autopar.cost.model as cost_model
from autopar.cost import Cluster, ModelSpec, estimate
from autopar.cost import cache
from autopar.planning.search import search

SPEC = ModelSpec(name="small", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn=512, vocab=512)
MOE = ModelSpec(name="moe", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn=512, vocab=512,
                num_experts=4, top_k=2)
CLUSTER = Cluster(gpu="cpu", num_nodes=1, gpus_per_node=8)
PLANS = [(SPEC, "tp=2,sp,pp=2:zbv,dp=2,mb=4"), (SPEC, "cp=2:ring,dp=4,zero=3,recompute=selective"),
         (SPEC, "tp=2,pp=2:interleaved,vpp=2,dp=2,mb=4,zero=1"), (MOE, "ep=2,dp=4,tp=2,sp,zero=1")]
RESTRICT = dict(zero_stages=(0, 1), recompute_modes=("none", "full"), schedules=("1f1b", "zbv"))


def _forget_lambdified():
    for fn in (cost_model.model_formulas, cost_model.memory_formulas, cost_model.compute_formulas):
        fn.cache_clear()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    _forget_lambdified()
    yield tmp_path / "cache"
    _forget_lambdified()


def _scores():
    costs = [estimate(spec, CLUSTER, plan, 64, 16) for spec, plan in PLANS]
    found = search(SPEC, CLUSTER, 64, 16, top=3, **RESTRICT)
    return costs, [(str(p), c.step_time) for p, c in found]


def test_cached_formulas_score_exactly_as_lambdified_ones(cache_dir, monkeypatch):
    fresh_costs, fresh_found = _scores()
    assert cost_model.model_formulas("derived", True)._exprs is not None          # lambdified in this process
    assert len(list(cache_dir.glob("*.json"))) == 4                         # model x2, memory, compute
    _forget_lambdified()

    def boom(*args, **kwargs):
        raise AssertionError("sympy formulas built on the warm path")

    with monkeypatch.context() as patch:    # the warm path neither builds nor lambdifies a formula
        for name in ("row_specs", "memory_terms", "compute_terms"):        # what the formulas come from
            patch.setattr(cost_model, name, boom)
        patch.setattr(sympy, "lambdify", boom)
        warm_costs, warm_found = _scores()
        for cost in warm_costs:
            cost.breakdown(formulas=False)
            cost.comm_table()
    assert cost_model.model_formulas("derived", True)._exprs is None              # loaded from the cache
    assert warm_found == fresh_found
    for fresh, warm in zip(fresh_costs, warm_costs):
        assert (warm.step_time, warm.memory_per_gpu, warm.bubble) == (fresh.step_time, fresh.memory_per_gpu,
                                                                      fresh.bubble)
        assert warm._out.keys() == fresh._out.keys()
        assert all(np.array_equal(warm._out[k], fresh._out[k]) for k in fresh._out)
        assert warm.comm_table() == fresh.comm_table()
    # Formulas, when asked for, are rebuilt and equal the lambdified ones.
    fresh_terms, warm_terms = fresh_costs[0].breakdown(), warm_costs[0].breakdown()
    assert [(t.name, t.value, str(t.formula)) for t in warm_terms] == \
        [(t.name, t.value, str(t.formula)) for t in fresh_terms]


def test_another_key_is_never_read(cache_dir, monkeypatch):
    cost_model.compute_formulas()                                           # writes the entry
    key = cache.source_key()
    assert cache.load("compute", key) is not None
    assert cache.load("compute", "0" * 64) is None
    _forget_lambdified()
    monkeypatch.setattr(cache, "source_key", lambda: "f" * 64)             # e.g. a cost/ file changed
    assert cost_model.compute_formulas()._exprs is not None                 # lambdified again ...
    assert {p.name.rsplit("-", 1)[1] for p in cache_dir.glob("compute-*.json")} == {
        key[:24] + ".json", "f" * 24 + ".json"}                             # ... and stored under the new key


def test_key_follows_the_sources(tmp_path, monkeypatch):
    src = tmp_path / "formulas.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(cache, "_key_files", lambda: [src])
    cache.source_key.cache_clear()
    try:
        first = cache.source_key()
        src.write_text("x = 2\n")
        cache.source_key.cache_clear()
        assert cache.source_key() != first
        src.unlink()
        cache.source_key.cache_clear()
        assert cache.source_key() is None                                   # unreadable: no cache
    finally:
        cache.source_key.cache_clear()


def test_damaged_entry_and_unwritable_directory_fall_back(cache_dir, tmp_path, monkeypatch):
    reference = cost_model.evaluate(cost_model.compute_formulas(), _compute_values())
    _forget_lambdified()
    for path in cache_dir.glob("compute-*.json"):
        path.write_text(path.read_text()[:-40])                             # truncated
    model = cost_model.compute_formulas()
    assert model._exprs is not None
    assert all(np.array_equal(v, reference[k]) for k, v in cost_model.evaluate(model, _compute_values()).items())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(blocker / "cache"))         # cannot be created
    _forget_lambdified()
    assert cost_model.compute_formulas().names == ["T_f", "T_b", "T_w"]
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", "off")
    assert cache.cache_dir() is None


def _compute_values():
    model = cost_model.compute_formulas()
    return {name: np.linspace(1.0, 3.0, 5) + i for i, name in enumerate(model.input_names)}
