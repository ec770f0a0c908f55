"""Tests for autopar.plan: the plan text syntax, its round trip, and every error path."""

from __future__ import annotations

__all__: list[str] = []  # test module: nothing to export

import random

import pytest

from autopar.errors import AutoparError
from autopar.plan import Plan


# ----------------------------------------------------------------------------- parsing
def test_default_plan_spellings():
    for text in ("", "none", "  NONE ", " "):
        assert Plan.parse(text) == Plan()
    assert str(Plan()) == "none"
    p = Plan()
    assert (p.dp, p.tp, p.sp, p.cp, p.ep, p.pp, p.vpp, p.mb, p.zero) == (1, 1, False, 1, 1, 1, 1, 1, 0)
    assert (p.cp_variant, p.schedule, p.recompute, p.capacity) == ("ring", "1f1b", "none", None)


def test_parse_reference_example():
    p = Plan.parse("tp=8,sp,pp=4:interleaved,vpp=2,dp=32,zero=1,mb=8")
    assert p == Plan(tp=8, sp=True, pp=4, schedule="interleaved", vpp=2, dp=32, zero=1, mb=8)
    assert p.world_size == 4 * 32 * 8
    assert p.num_chunks_per_rank == 2
    assert p.degrees == {"pp": 4, "dp": 32, "cp": 1, "tp": 8}
    assert list(p.degrees) == ["pp", "dp", "cp", "tp"]


def test_parse_1024_gpu_reference_config():
    # The reference's TP4 SP PP4 CP2 EP8 DP4 example, written with dp=32 (EP folded into dp*cp).
    p = Plan.parse("tp=4, sp, pp=4, cp=2, dp=32, ep=8, mb=4")
    assert p == Plan(tp=4, sp=True, pp=4, cp=2, dp=32, ep=8, mb=4)
    assert p.world_size == 1024
    assert p.num_chunks_per_rank == 1


def test_parse_variants_whitespace_and_case():
    assert Plan.parse("cp=2:ulysses") == Plan(cp=2, cp_variant="ulysses")
    assert Plan.parse(" CP = 4 : AllGather ,DP=2 ") == Plan(cp=4, cp_variant="allgather", dp=2)
    assert Plan.parse("pp=2:GPipe") == Plan(pp=2, schedule="gpipe")
    assert Plan.parse("Recompute=Selective") == Plan(recompute="selective")
    assert Plan.parse("tp=2,sp,") == Plan(tp=2, sp=True)  # a trailing comma is harmless
    assert Plan.parse("capacity=1.25,dp=2,ep=2") == Plan(dp=2, ep=2, capacity=1.25)
    assert Plan.parse("capacity=2").capacity == 2.0
    assert isinstance(Plan.parse("capacity=2").capacity, float)


def test_parse_accepts_plan_instance():
    p = Plan(tp=2, dp=2)
    assert Plan.parse(p) is p


def test_v_schedules_hold_two_chunks():
    for sched in ("zbv", "dualpipev"):
        a = Plan.parse(f"pp=2:{sched},mb=4")
        b = Plan.parse(f"pp=2:{sched},vpp=2,mb=4")
        c = Plan.parse(f"pp=2:{sched},vpp=1,mb=4")
        assert a == b == c
        assert a.num_chunks_per_rank == 2
        assert a.vpp == 2


def test_num_chunks_per_rank():
    assert Plan(pp=4, schedule="interleaved", vpp=3).num_chunks_per_rank == 3
    assert Plan(pp=4, schedule="gpipe").num_chunks_per_rank == 1
    assert Plan(pp=4, mb=4).num_chunks_per_rank == 1
    assert Plan().num_chunks_per_rank == 1


def test_world_size_excludes_ep():
    assert Plan(dp=4, cp=2, ep=8, tp=2, pp=3, mb=3).world_size == 4 * 2 * 2 * 3


def test_canonical_text():
    assert str(Plan(tp=2, sp=True, dp=2)) == "tp=2,sp,dp=2"
    assert str(Plan(cp=2)) == "cp=2:ring"
    assert str(Plan(pp=2, mb=2)) == "pp=2:1f1b,mb=2"
    assert str(Plan(pp=4, schedule="interleaved", vpp=2, mb=8)) == "pp=4:interleaved,vpp=2,mb=8"
    assert str(Plan(pp=2, schedule="zbv")) == "pp=2:zbv"
    assert str(Plan(recompute="full", zero=3, dp=8)) == "dp=8,zero=3,recompute=full"


# ----------------------------------------------------------------------------- round trip
def _random_fields(rng: random.Random) -> dict:
    """Random field values that satisfy the intrinsic rules (derived here, not from Plan)."""
    tp = rng.choice([1, 1, 2, 4, 8])
    dp = rng.choice([1, 2, 3, 4, 8, 32])
    cp = rng.choice([1, 1, 2, 4])
    pp = rng.choice([1, 1, 2, 4, 8])
    f = {"tp": tp, "dp": dp, "cp": cp, "pp": pp}
    f["sp"] = tp > 1 and rng.random() < 0.5
    if cp > 1:
        f["cp_variant"] = rng.choice(["ring", "allgather", "ulysses"])
    if pp > 1:
        f["schedule"] = rng.choice(["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"])
        if f["schedule"] == "interleaved":
            f["vpp"] = rng.choice([2, 3, 4])
        elif f["schedule"] in ("zbv", "dualpipev"):
            f["vpp"] = 2
    f["ep"] = rng.choice([d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0])
    f["mb"] = rng.choice([m for m in (1, 2, 4, 8, 16) if _schedule_runs(f, m)])
    f["zero"] = rng.choice([0, 1, 2, 3])
    f["recompute"] = rng.choice(["none", "selective", "full"])
    f["capacity"] = rng.choice([None, 1.0, 1.25, 2.0, 0.5])
    return f


def _schedule_runs(f: dict, mb: int) -> bool:
    """torch's schedules' micro-batch rules, written out here: 1f1b needs mb >= pp, interleaved a
    multiple of its rounds max(1, mb // pp), dualpipev mb >= 2 pp; gpipe and zbv run any count."""
    pp, schedule = f["pp"], f.get("schedule", "1f1b")
    if pp == 1 or schedule in ("gpipe", "zbv"):
        return True
    if schedule == "1f1b":
        return mb >= pp
    if schedule == "interleaved":
        return mb % max(1, mb // pp) == 0
    return mb >= 2 * pp


def _text_from_fields(f: dict, rng: random.Random) -> str:
    """Write the fields in the plan syntax, in a random order, case and spacing."""
    tokens = []
    for key in ("dp", "tp", "ep", "mb", "zero"):
        if f[key] != Plan.__dataclass_fields__[key].default or rng.random() < 0.3:
            tokens.append(f"{key}={f[key]}")
    if f["sp"]:
        tokens.append("sp")
    cp = f"cp={f['cp']}"
    if "cp_variant" in f:
        cp += ":" + f["cp_variant"]
    tokens.append(cp)
    pp = f"pp={f['pp']}"
    if "schedule" in f:
        pp += ":" + f["schedule"]
    tokens.append(pp)
    if "vpp" in f:
        tokens.append(f"vpp={f['vpp']}")
    if f["recompute"] != "none" or rng.random() < 0.3:
        tokens.append(f"recompute={f['recompute']}")
    if f["capacity"] is not None:
        tokens.append(f"capacity={f['capacity']}")
    rng.shuffle(tokens)
    out = []
    for t in tokens:
        if rng.random() < 0.3:
            t = t.upper()
        if rng.random() < 0.3:
            t = " " + t.replace("=", " = ") + " "
        out.append(t)
    return ",".join(out)


def test_random_round_trip_fixed_seed():
    rng = random.Random(20240611)
    seen = set()
    for _ in range(600):
        f = _random_fields(rng)
        expected = Plan(**f)
        parsed = Plan.parse(_text_from_fields(f, rng))
        assert parsed == expected
        assert Plan.parse(str(expected)) == expected
        assert str(Plan.parse(str(expected))) == str(expected)
        assert expected.world_size == f["pp"] * f["dp"] * f["cp"] * f["tp"]
        seen.add(str(expected))
    assert len(seen) > 400  # the generator really covers many distinct plans


def test_hand_written_round_trips():
    for text in [
        "none",
        "tp=2",
        "tp=2,sp",
        "dp=4,zero=1",
        "dp=4,zero=3,mb=4",
        "cp=2:ulysses",
        "cp=8:allgather,dp=2,ep=16",
        "pp=4:interleaved,vpp=4,mb=16",
        "pp=2:dualpipev,mb=8",
        "tp=8,sp,cp=2:ring,pp=4:1f1b,dp=32,ep=8,zero=1,mb=8,recompute=selective,capacity=1.5",
    ]:
        p = Plan.parse(text)
        assert str(p) == text
        assert Plan.parse(str(p)) == p


def test_plans_are_hashable_and_frozen():
    a, b = Plan.parse("tp=2,dp=2"), Plan(dp=2, tp=2)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(Exception):
        a.tp = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        Plan(2)  # keyword-only


def test_replace():
    p = Plan(tp=2, sp=True, dp=2)
    assert p.replace(dp=4) == Plan(tp=2, sp=True, dp=4)
    assert p.replace(tp=1) == Plan(dp=2)  # sp goes with tp=1
    z = Plan(pp=2, schedule="zbv")
    assert z.replace(schedule="gpipe") == Plan(pp=2, schedule="gpipe")
    assert Plan(pp=2, schedule="zbv", mb=2).replace(schedule="1f1b") == Plan(pp=2, mb=2)
    assert Plan(pp=4, schedule="interleaved", vpp=2).replace(pp=1) == Plan()
    assert Plan(cp=2, cp_variant="ulysses").replace(cp=1) == Plan()
    with pytest.raises(AutoparError, match="^autopar: .*vpp"):
        Plan(pp=2, mb=2).replace(vpp=2)
    with pytest.raises(AutoparError, match="^autopar: Plan has no field 'tq'"):
        p.replace(tq=2)


def test_integer_like_values_are_normalised():
    import numpy as np

    p = Plan(tp=np.int64(2), dp=np.int32(2))
    assert p == Plan(tp=2, dp=2) and type(p.tp) is int


# ----------------------------------------------------------------------------- parse errors
@pytest.mark.parametrize(
    "text, fragments",
    [
        ("tp=2,foo", ["unknown plan option 'foo' in 'tp=2,foo'", "expected one of dp, tp, sp"]),
        ("tpp=2", ["unknown plan option 'tpp'", "did you mean 'tp'"]),
        ("tp=2,tp=4", ["'tp' is given twice", "once"]),
        ("tp=2,sp,sp", ["'sp' is given twice"]),
        ("tp=x", ["'tp' needs an integer, got 'x'"]),
        ("tp=2.5", ["'tp' needs an integer, got '2.5'"]),
        ("tp", ["'tp' needs a value"]),
        ("tp=", ["'tp' needs a value"]),
        ("tp=2,sp=1", ["'sp' is a flag and takes no value"]),
        ("cp=2:zigzag", ["unknown context-parallel variant 'zigzag'", "ring, allgather, ulysses"]),
        ("pp=2:fancy", ["unknown pipeline schedule 'fancy'", "gpipe, 1f1b, interleaved, zbv, dualpipev"]),
        ("recompute=most", ["unknown recompute mode 'most'", "none, selective, full"]),
        ("capacity=lots", ["capacity needs a number, got 'lots'"]),
        ("auto", ["'auto' is not a fixed plan"]),
    ],
)
def test_parse_errors(text, fragments):
    with pytest.raises(ValueError) as info:
        Plan.parse(text)
    assert isinstance(info.value, AutoparError)
    msg = str(info.value)
    assert msg.startswith("autopar:")
    for frag in fragments:
        assert frag in msg, msg


def test_parse_rejects_non_string():
    with pytest.raises(AutoparError, match="^autopar: a plan must be a string"):
        Plan.parse(8)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- intrinsic errors
@pytest.mark.parametrize(
    "fields, fragments",
    [
        (dict(tp=0), ["tp=0 is not allowed", ">= 1"]),
        (dict(dp=-2), ["dp=-2 is not allowed"]),
        (dict(mb=0), ["mb=0"]),
        (dict(tp=2.0), ["tp must be an integer, got 2.0"]),
        (dict(tp=True), ["tp must be an integer, got True"]),
        (dict(zero=4), ["zero=4 is not a ZeRO stage", "0, 1, 2, 3"]),
        (dict(sp=True), ["tp=1", "tp>=2"]),
        (dict(sp=1, tp=2), ["sp must be True or False"]),
        (dict(cp=2, cp_variant="zigzag"), ["unknown cp_variant 'zigzag'"]),
        (dict(pp=2, schedule="x"), ["unknown schedule 'x'"]),
        (dict(recompute="some"), ["unknown recompute 'some'"]),
        (dict(cp_variant="ulysses"), ["cp=1", "cp=2:ulysses"]),
        (dict(schedule="gpipe"), ["pp=1", "pp=2:gpipe"]),
        (dict(pp=2, vpp=2), ["vpp=2", "interleaved", "pp=2:interleaved,vpp=2"]),
        (dict(vpp=2), ["vpp=2", "pp>=2"]),
        (dict(pp=2, schedule="interleaved"), ["vpp>=2", "vpp=1", "add vpp=2"]),
        (dict(pp=2, schedule="zbv", vpp=3), ["exactly 2 model chunks", "vpp=3"]),
        (dict(dp=2, ep=4), ["ep=4 does not divide dp*cp=2", "one of 1, 2"]),
        (dict(dp=3, cp=2, ep=4), ["dp*cp=6", "one of 1, 2, 3, 6"]),
        (dict(capacity=0.0), ["capacity=0.0", "> 0"]),
        (dict(capacity=float("inf")), ["finite"]),
        (dict(capacity="big"), ["capacity must be a number"]),
    ],
)
def test_intrinsic_errors(fields, fragments):
    with pytest.raises(AutoparError) as info:
        Plan(**fields)
    msg = str(info.value)
    assert msg.startswith("autopar:")
    for frag in fragments:
        assert frag in msg, msg


def test_ep_folds_into_cp_ranks():
    assert Plan(cp=4, ep=4).ep == 4
    assert Plan(dp=2, cp=2, ep=4).world_size == 4


# ----------------------------------------------------------------------------- validate
def _err(plan: str, **kw) -> str:
    with pytest.raises(AutoparError) as info:
        Plan.parse(plan).validate(**kw)
    msg = str(info.value)
    assert msg.startswith("autopar:"), msg
    return msg


def test_validate_ok_returns_self():
    p = Plan.parse("tp=2,sp,cp=2:ulysses,pp=2:interleaved,vpp=2,dp=2,ep=4,mb=2")
    out = p.validate(world_size=16, num_heads=8, num_kv_heads=4, vocab=128, num_layers=4,
                     num_experts=8, global_batch=8, seq_len=32)
    assert out is p
    assert Plan().validate(world_size=1, num_heads=3, vocab=7, num_layers=1, num_experts=0,
                           global_batch=1, seq_len=1) == Plan()


def test_validate_world_size():
    msg = _err("tp=2,dp=2", world_size=8)
    assert "1*2*1*2 = 4 ranks" in msg
    assert "world size is 8" in msg and "dp=4 fits" in msg
    msg = _err("tp=4", world_size=6)
    assert "tp=4" in msg and "does not divide 6" in msg


def test_validate_heads():
    msg = _err("tp=4", num_heads=6)
    assert "tp=4 does not divide the 6 attention heads" in msg
    assert "1, 2, 3, 6" in msg  # divisors of 6, worked out by hand


def test_validate_gqa_kv_heads():
    # tp that does not divide the KV heads replicates them on every tp rank (KV-head replication)
    Plan.parse("tp=4").validate(num_heads=8, num_kv_heads=2)
    Plan.parse("tp=4,sp,dp=2").validate(num_heads=8, num_kv_heads=1)
    Plan.parse("tp=4").validate(num_heads=12, num_kv_heads=6)
    Plan.parse("tp=2,cp=2").validate(num_heads=8, num_kv_heads=2)  # tp divides the KV heads: cp runs
    # ... which context parallelism does not run
    msg = _err("tp=4,cp=2", num_heads=8, num_kv_heads=2)
    assert "2 KV heads" in msg and "KV-head replication" in msg and "cp=1" in msg
    assert "tp that divides the KV heads (2)" in msg
    msg = _err("tp=2,cp=2:ring", num_kv_heads=1)
    assert "1 KV heads" in msg and "use cp=1 with tp=2" in msg
    assert "does not divide the 6 attention heads" in _err("tp=4", num_heads=6, num_kv_heads=2)


def test_validate_vocab():
    """A vocabulary tp does not divide is padded to ceil(V/tp) rows per rank, not refused."""
    from autopar.plan_space import padded_vocab
    Plan.parse("tp=4").validate(vocab=50257)
    Plan(tp=8).validate(vocab=32001)
    Plan(tp=8).validate(vocab=32000)
    assert padded_vocab(50257, 4) == 12565 and padded_vocab(32000, 8) == 4000


def test_validate_layers():
    msg = _err("pp=4:interleaved,vpp=2", num_layers=6)
    assert "8 pipeline chunks" in msg and "only 6 layers" in msg
    _err("pp=2:zbv", num_layers=3)
    Plan.parse("pp=2:zbv").validate(num_layers=4)
    Plan.parse("pp=4,mb=4").validate(num_layers=4)


def test_validate_experts():
    msg = _err("dp=4,ep=4", num_experts=6)  # 2 per rank leaves the last rank none
    assert "ep=4 leaves a rank without any of the 6 experts (2 per rank)" in msg
    assert "valid ep values are 1, 2" in msg  # divisors of dp*cp=4 that give every rank an expert
    Plan.parse("dp=4,ep=4").validate(num_experts=7)  # 2, 2, 2 and 1 + a padding expert
    Plan.parse("dp=2,ep=2").validate(num_experts=7)
    msg = _err("dp=2,ep=2", num_experts=0)
    assert "no experts" in msg
    msg = _err("capacity=1.5", num_experts=0)
    assert "capacity" in msg and "no experts" in msg
    Plan.parse("dp=4,ep=4").validate(num_experts=8)


def test_validate_batch():
    msg = _err("dp=2,mb=4", global_batch=12)
    # each replica gets 6; divisors of 6 are 1, 2, 3, 6; closest to 4 is 3
    assert "dp*mb = 2*4 = 8" in msg and "6 samples" in msg and "nearest valid mb is 3" in msg
    msg = _err("dp=2,mb=3", global_batch=16)
    # per replica 8: divisors 1, 2, 4, 8; 3 sits between 2 and 4
    assert "nearest valid mb is 2 or 4" in msg
    msg = _err("dp=3", global_batch=8)
    assert "dp=3" in msg and "valid dp: 1, 2, 4, 8" in msg
    Plan.parse("dp=2,mb=4").validate(global_batch=8)


def test_validate_seq_len():
    msg = _err("cp=2", seq_len=30)
    assert "2*cp = 4 chunks" in msg and "28 or 32" in msg
    msg = _err("cp=4", seq_len=4)
    assert "8" in msg
    Plan(cp=2).validate(seq_len=4)
    Plan().validate(seq_len=7)
    msg = _err("tp=4,sp", seq_len=30)
    assert "sp" in msg and "28 or 32" in msg


def test_validate_seq_len_sp_with_cp():
    Plan.parse("tp=2,sp,cp=2").validate(seq_len=12)  # 12/cp = 6 tokens, 6 % tp == 0
    msg = _err("tp=4,sp,cp=2", seq_len=12)  # 6 tokens per cp rank do not split over tp=4
    assert "6-token" in msg and "tp=4" in msg


def test_validate_ulysses_heads():
    msg = _err("tp=2,cp=4:ulysses", num_heads=8, num_kv_heads=4)
    # tp*cp = 8 does not divide the 4 KV heads; per tp rank 2 KV heads, so cp=2 is the only cp>1
    assert "tp*cp = 2*4 = 8" in msg and "cp in 2" in msg
    msg = _err("tp=4,cp=2:ulysses", num_heads=16, num_kv_heads=4)
    assert "no cp>1 fits" in msg and "ring or allgather" in msg
    Plan.parse("tp=2,cp=2:ulysses").validate(num_heads=8, num_kv_heads=4)
    Plan.parse("tp=2,cp=4:ring").validate(num_heads=8, num_kv_heads=4)
