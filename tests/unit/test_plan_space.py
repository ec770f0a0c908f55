"""autopar.plan_space: the one home of the plan rules.

* Each rule is stated once: the source of ``autopar/``, ``passes/`` and ``cost/`` holds the
  expressions and texts of the MoE-needs-sp, split-backward and
  tied-embedding rules in the package autopar/plan_space/ only.
* What the search ranks as runnable, ``parallelize`` runs: every plan ``search(runnable=True)``
  (and the space it scores, ``enumerate_plans``) offers on dense, MoE, latent-attention and tied
  models passes the checks ``parallelize`` makes before compiling (``compile_program``'s
  ``check_supported``, after ``Plan``'s own checks, then ``support.check_runnable``, the very
  function its ``_validate`` calls with the traced model's numbers).
* The predicates agree on ints and on numpy arrays; the pure-Python enumeration is the space
  plain loops over ``Plan(...)`` give; the encoding round-trips; the layout's rank groups are
  the device mesh's; the refusal summary is generated from the rules.
"""
from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autopar.cost import Cluster, ModelSpec, estimate
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.plan_space import (RUNTIME_RULES, axis_groups, candidates, decode, divisors,
                                encode, model_facts, pack_buckets, runnable, supported_summary)
from autopar.planning.search import enumerate_plans, search
from autopar.support import SUPPORTED_SUMMARY, check_runnable, check_supported, unsupported

ROOT = Path(__file__).resolve().parents[2]
HOME = ROOT / "autopar" / "plan_space"  # the package: its modules are the one home

# What a second statement of each rule would contain: its expression or its refusal's text.
RULE_PATTERNS = {
    "moe needs sp": [r"\bmoe\w*\b[^\n]*\btp\s*>\s*1[^\n]*\bsp\b", r"\btp\s*>\s*1[^\n]*\bnot\s+[\w.]*\bsp\b",
                     r"num_experts[^\n]*\bsps?\b\s*=", r"\bsps?\b\s*=[^\n]*num_experts",
                     r"without sp on a mixture-of-experts"],
    "split backward": [r"SPLIT_BACKWARD_SCHEDULES", r"""in\s*\(\s*["']zbv["']\s*,\s*["']dualpipev["']\s*\)""",
                       r"would recompute every region twice", r"would re-run the layer's backward collectives"],
    "tied embedding": [r"tied\w*[^\n]*\bpp\s*>\s*1[^\n]*\bzero\b", r"\bzero\b[^\n]*\bpp\s*>\s*1[^\n]*tied",
                       r"\bpp\s*>\s*1[^\n]*\bzero\b[^\n]*tied", r"tied\w*[^\n]*\bzero\s*>\s*1[^\n]*\bpp\b",
                       r"LM head is tied to the embedding \(zero=1"],
}


def _sources():
    for folder in ("autopar", "passes", "cost"):
        yield from sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("rule", list(RULE_PATTERNS))
def test_each_rule_is_stated_only_in_the_plan_space(rule):
    found, home = [], 0
    for path in _sources():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if any(re.search(p, line) for p in RULE_PATTERNS[rule]):
                if HOME in path.parents:
                    home += 1
                else:
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert home, f"the patterns of '{rule}' no longer match its statement in autopar/plan_space/"
    assert not found, f"'{rule}' stated outside autopar/plan_space/:\n" + "\n".join(found)


# --------------------------------------------------------------------------- search vs parallelize

DENSE = ModelSpec(name="dense", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn=512, vocab=512)
MODELS = {
    "dense": DENSE,
    "moe": ModelSpec(name="moe", num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn=512, vocab=512,
                     num_experts=4, top_k=2, moe_ffn=256),
    "latent": ModelSpec(name="latent", num_layers=4, hidden=256, num_heads=8, num_kv_heads=8, ffn=512, vocab=512,
                        head_dim=48, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, v_head_dim=32),
    "tied": ModelSpec(name="tied", num_layers=4, hidden=256, num_heads=8, num_kv_heads=4, ffn=512, vocab=512,
                      tied_embeddings=True),
}
WORLD, SEQ, GB = 8, 256, 16


def _parallelize_checks(plan: Plan, spec: ModelSpec) -> None:
    """What ``parallelize`` checks before compiling: compile_program's checks of the plan alone, then
    passes/compile.py's ``_validate`` (``check_runnable`` with the model's numbers)."""
    check_supported(plan)
    check_runnable(plan, world_size=WORLD, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                   vocab=spec.vocab, num_experts=spec.num_experts, tied=spec.tied_embeddings)


@pytest.mark.parametrize("name", list(MODELS))
def test_search_offers_only_what_parallelize_runs(name):
    spec = MODELS[name]
    cluster = Cluster(gpu="cpu", num_nodes=1, gpus_per_node=WORLD)
    cands = enumerate_plans(spec, WORLD, SEQ, GB, runnable=True)
    plans = {str(Plan(**decode(cands, i))): Plan(**decode(cands, i)) for i in range(len(cands["tp"]))}
    for plan in plans.values():
        _parallelize_checks(plan, spec)
    found = search(spec, cluster, SEQ, GB, top=20, runnable=True)
    assert found
    for plan, _ in found:
        _parallelize_checks(plan, spec)
    # The runnable space is all of the priced space that parallelize's checks accept.
    priced = enumerate_plans(spec, WORLD, SEQ, GB, runnable=False)
    refused = 0
    for i in range(len(priced["tp"])):
        plan = Plan(**decode(priced, i))
        try:
            _parallelize_checks(plan, spec)
        except AutoparError:
            refused += 1
            assert str(plan) not in plans
        else:
            assert str(plan) in plans
    assert refused or name == "dense"


def test_moe_search_offers_tp_with_sp_only():
    cands = enumerate_plans(MODELS["moe"], WORLD, SEQ, GB, runnable=True)
    assert ((cands["tp"] == 1) | (cands["sp"] == 1)).all() and (cands["tp"] > 1).any()
    assert (cands["recompute"] == 0).all()  # the runtime recomputes no MoE model
    assert (enumerate_plans(MODELS["moe"], WORLD, SEQ, GB, runnable=False)["sp"] == 0).any()


def test_latent_attention_is_split_over_tp():
    spec = MODELS["latent"]
    assert (enumerate_plans(spec, WORLD, SEQ, GB, runnable=False)["tp"] > 1).any()
    assert estimate(spec, Cluster(gpu="cpu", num_nodes=1, gpus_per_node=2), "tp=2", SEQ, GB)


# --------------------------------------------------------------------------- the rules on ints and arrays

def _all_plans():
    for tp, cp, pp, dp, ep in itertools.product((1, 2), (1, 2), (1, 2), (1, 2), (1, 2)):
        for sp, sched, zero, rec in itertools.product((False, True), ("1f1b", "zbv", "interleaved"), range(4),
                                                      ("none", "selective")):
            try:
                yield Plan(tp=tp, sp=sp, cp=cp, pp=pp, dp=dp, ep=ep, schedule=sched if pp > 1 else "1f1b",
                           vpp=2 if sched == "interleaved" and pp > 1 else 1, zero=zero, recompute=rec, mb=4)
            except AutoparError:
                pass


@pytest.mark.parametrize("moe,tied", [(False, False), (True, False), (False, True)])
def test_runtime_rules_agree_on_ints_and_arrays(moe, tied):
    plans = list(_all_plans())
    columns = {k: np.array([encode(p)[k] for p in plans]) for k in encode(plans[0])}
    mask = runnable(columns, moe=moe, tied=tied)
    assert mask.dtype == bool and len(mask) == len(plans)
    for ok, plan in zip(mask, plans):
        assert bool(ok) == (unsupported(plan, moe=moe, tied=tied) == []) == bool(runnable(encode(plan), moe=moe,
                                                                                         tied=tied))
    assert not mask.all() and mask.any()


def test_refusal_and_summary_come_from_the_rules():
    assert SUPPORTED_SUMMARY == supported_summary()
    assert all(rule.summary in SUPPORTED_SUMMARY for rule in RUNTIME_RULES)
    with pytest.raises(AutoparError) as info:
        check_supported(Plan.parse("tp=2,pp=2:zbv,mb=2,recompute=full"), moe=True)
    msg = str(info.value)
    assert "tp=2 without sp on a mixture-of-experts model" in msg and "'tp=2,sp,pp=2:zbv,mb=2,recompute=full'" in msg
    assert "recompute=full with the zbv schedule" in msg and "recompute=full on a mixture-of-experts model" in msg
    assert SUPPORTED_SUMMARY in msg


def test_encoding_round_trips():
    for plan in _all_plans():
        assert Plan(**decode(encode(plan))) == plan


def test_candidates_are_the_plans_plain_loops_give():
    """Every plan of a small space, built with Plan(...) and kept when it is valid for the model and
    the run, the runtime runs it, the schedule runs its micro-batches and ZeRO has copies to shard."""
    spec, world = DENSE, 4
    space = dict(schedules=("1f1b", "zbv", "interleaved"), cp_variants=("ring", "ulysses"), zero_stages=(0, 2),
                 recompute_modes=("none", "full"))
    got = {str(Plan(**decode(c))) for c in candidates(world, model_facts(spec), seq_len=SEQ, global_batch=GB,
                                                       runnable_only=True, **space)}
    want = set()
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        for sp, variant, sched, vpp, mb, zero, rec in itertools.product(
                (False, True), space["cp_variants"], space["schedules"], (1, 2, 3), divisors(GB // dp),
                space["zero_stages"], space["recompute_modes"]):
            if (zero and dp * cp == 1) or (sched == "interleaved" and mb < pp):  # what the search prices
                continue
            try:
                plan = Plan(tp=tp, sp=sp, cp=cp, cp_variant=variant if cp > 1 else "ring", pp=pp,
                            schedule=sched if pp > 1 else "1f1b", vpp=vpp if sched == "interleaved" and pp > 1 else 1,
                            dp=dp, mb=mb, zero=zero, recompute=rec)
                check_supported(plan)
                plan.validate(world_size=world, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                              vocab=spec.vocab, num_layers=spec.num_layers, num_experts=0, global_batch=GB,
                              seq_len=SEQ)
            except AutoparError:
                continue
            want.add(str(plan))
    assert got == want


def test_axis_groups_are_the_device_mesh():
    for pp, dp, cp, tp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2), (1, 2)):
        grid = np.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)  # init_device_mesh's layout
        degrees = dict(pp=pp, dp=dp, cp=cp, tp=tp)
        for i, axis in enumerate(("pp", "dp", "cp", "tp")):
            mesh = np.moveaxis(grid, i, -1).reshape(-1, grid.shape[i]).tolist()
            assert sorted(axis_groups(axis, **degrees)) == sorted(mesh), axis
        flat = np.moveaxis(grid.reshape(pp, dp * cp, tp), 1, -1).reshape(-1, dp * cp).tolist()
        assert sorted(axis_groups("dp_cp", **degrees)) == sorted(flat)
        for ep in divisors(dp * cp):
            by_ep = grid.reshape(pp, dp * cp // ep, ep, tp)
            assert axis_groups("ep", **degrees, ep=ep) == by_ep.transpose(0, 1, 3, 2).reshape(-1, ep).tolist()
            assert axis_groups("edp", **degrees, ep=ep) == by_ep.transpose(0, 2, 1, 3).reshape(
                -1, dp * cp // ep * tp).tolist()


def test_plan_space_imports_neither_torch_nor_numpy():
    code = "import sys, autopar.plan_space; assert not {'torch', 'numpy'} & set(sys.modules), 'imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_pack_buckets_greedy_in_order():
    """Buckets close before the tensor that would take them past the cap; order is kept."""
    # cap 10: 4+5 = 9 (+3 would be 12); 3+7 = 10 (equal to the cap fits); 12 alone (over the
    # cap); then 1+2.
    assert [list(r) for r in pack_buckets([4, 5, 3, 7, 12, 1, 2], 10)] == [[0, 1], [2, 3], [4], [5, 6]]
    assert [list(r) for r in pack_buckets([2, 11, 2], 10)] == [[0], [1], [2]]
    assert [list(r) for r in pack_buckets([11], 10)] == [[0]]
    assert pack_buckets([], 10) == []
    assert [list(r) for r in pack_buckets([1] * 5, 100)] == [[0, 1, 2, 3, 4]]
