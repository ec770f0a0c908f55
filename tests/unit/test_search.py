"""autopar.search: the space it covers, pruning, ranking, and agreement with estimate().

The reference answer: every plan of a small space, one at a time
(:func:`autopar.plan_space.candidates`, pure Python; that it is the space plain loops over
``Plan(...)`` give is tests/unit/test_plan_space.py's), scored with estimate(); search (numpy
over the same space) must find the same best step time, return only plans that fit, best
first, and never touch sympy per candidate.
"""
from __future__ import annotations

import itertools

import pytest
import sympy

from autopar.cost import Cluster, ModelSpec, estimate
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import candidates, decode, divisors, model_facts
from autopar.planning.search import enumerate_plans, search

SPEC = ModelSpec(name="small", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn=512, vocab=512)
SEQ, GB = 256, 8
RESTRICT = dict(zero_stages=(0, 1), recompute_modes=("none", "full"), schedules=("1f1b", "zbv"),
                cp_variants=("ring", "ulysses"))


def cluster(mem_gib=None):
    kw = {} if mem_gib is None else {"hbm_bytes": mem_gib * 2**30}
    return Cluster(gpu="cpu", num_nodes=1, gpus_per_node=4, **kw)


def brute_force(cl, **opts):
    """Every plan the runtime runs of RESTRICT's space over 4 ranks, scored by estimate()."""
    out = {}
    for c in candidates(4, model_facts(SPEC), seq_len=SEQ, global_batch=GB, runnable_only=True, **RESTRICT):
        plan = Plan(**decode(c))
        out[str(plan)] = estimate(SPEC, cl, plan, SEQ, GB, **opts)
    return out


@pytest.fixture(scope="module")
def everything():
    return brute_force(cluster())


def test_search_finds_the_brute_force_optimum(everything):
    best = min(c.step_time for c in everything.values() if c.fits)
    found = search(SPEC, cluster(), SEQ, GB, top=5, **RESTRICT)
    assert found[0][1].step_time == pytest.approx(best, rel=1e-12)
    times = [c.step_time for _, c in found]
    assert times == sorted(times) and len(found) == 5
    for plan, cost in found:  # each returned cost is what estimate() says for that plan
        assert cost.step_time == pytest.approx(everything[str(plan)].step_time, rel=1e-12)


def test_memory_limit_is_respected():
    tight = cluster(mem_gib=0.02)
    everything = brute_force(tight)
    fitting = [c for c in everything.values() if c.fits]
    assert 0 < len(fitting) < len(everything)  # the limit bites
    found = search(SPEC, tight, SEQ, GB, top=50, **RESTRICT)
    assert found and all(c.fits and c.memory_per_gpu <= tight.usable_memory for _, c in found)
    assert found[0][1].step_time == pytest.approx(min(c.step_time for c in fitting), rel=1e-12)


def test_nothing_fits_returns_empty():
    assert search(SPEC, cluster(mem_gib=1e-6), SEQ, GB, top=3, **RESTRICT) == []


def test_space_covers_each_dimension():
    moe = ModelSpec(name="small-moe", num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn=512,
                    vocab=512, num_experts=4, top_k=2)
    cands = enumerate_plans(moe, 16, SEQ, 16, runnable=False)
    for key in ("tp", "dp", "cp", "pp", "ep", "vpp", "m", "zero", "recompute", "schedule", "cp_variant", "sp"):
        assert len(set(cands[key].tolist())) > 1, key
    # Every factorisation of 16 into pp*dp*cp*tp with tp | 8 heads appears.
    seen = {tuple(int(cands[k][i]) for k in ("pp", "dp", "cp", "tp")) for i in range(len(cands["tp"]))}
    expected = {(p, d, c, t) for p, d, c, t in itertools.product(divisors(16), repeat=4)
                if p * d * c * t == 16 and 8 % t == 0 and p <= 4 and (c == 1 or SEQ % (2 * c) == 0)}
    assert seen == expected
    # ep divides dp*cp and the experts; ulysses only where heads split over tp*cp.
    assert all((d * c) % e == 0 and 4 % e == 0 for d, c, e in zip(cands["dp"], cands["cp"], cands["ep"]))
    uly = cands["cp_variant"] == 2
    assert all(8 % (t * c) == 0 for t, c in zip(cands["tp"][uly], cands["cp"][uly]))


def test_divisibility_pruning():
    odd = ModelSpec(name="odd", num_layers=3, hidden=192, num_heads=6, num_kv_heads=2, ffn=384, vocab=510)
    cands = enumerate_plans(odd, 8, 96, 4)
    assert set(cands["tp"].tolist()) <= {1, 2}                 # tp | heads and vocab
    assert (cands["pp"] * cands["vpp"] <= 3).all()             # layers >= pp * chunks
    assert ((4 / cands["dp"]) % cands["b"] == 0).all()          # batch splits into dp * mb
    assert ((cands["cp"] == 1) | (96 % (2 * cands["cp"]) == 0)).all()


def test_progress_and_no_sympy_per_candidate(monkeypatch):
    search(SPEC, cluster(), SEQ, GB, top=1, **RESTRICT)  # warm the compiled model
    calls = []

    def boom(*a, **k):
        raise AssertionError("sympy called during search")

    monkeypatch.setattr(sympy, "lambdify", boom)
    monkeypatch.setattr(sympy.Basic, "subs", boom)
    monkeypatch.setattr(sympy.Expr, "evalf", boom)
    monkeypatch.setattr(sympy.Basic, "xreplace", boom)
    found = search(SPEC, cluster(), SEQ, GB, top=2, progress=lambda done, total: calls.append((done, total)),
                   **RESTRICT)
    assert len(found) == 2
    assert calls and calls[-1][0] == calls[-1][1] and all(a <= b for a, b in calls)


def test_unknown_option_and_impossible_world():
    with pytest.raises(AutoparError, match="unknown search option"):
        search(SPEC, cluster(), SEQ, GB, bogus=1)
    with pytest.raises(AutoparError, match="no plan"):
        search(SPEC, cluster(), SEQ, 3, world_size=4, sp=True, max_tp=1, cp_variants=("ring",),
               max_microbatch=1, schedules=("1f1b",), microbatches=(5,))
