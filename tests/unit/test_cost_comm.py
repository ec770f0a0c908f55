"""Cost.comm_table() against the cost contract's "What the runtime sends" (TP / SP / DP / loss).

Every expected number is written out by hand from the contract's formulas for a tiny
Llama-style spec (L=2, H=64, 4 heads of 16, 2 KV heads, FFN 128, V=128, fp32), S=16 and a
global batch of 4; the runtime's byte-equality test compares the same sums with what it
measures. Also checks CP / EP / PP / ZeRO rows by hand.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from autopar.cost import Cluster, CommRow, ModelSpec, estimate

L, H, HEADS, KV, HD, FFN, V, S, GB, W = 2, 64, 4, 2, 16, 128, 128, 16, 4, 4
SPEC = ModelSpec(name="tiny", num_layers=L, hidden=H, num_heads=HEADS, num_kv_heads=KV, ffn=FFN, vocab=V)
CLUSTER = Cluster(gpu="cpu", num_nodes=1, gpus_per_node=8)

# Parameters by hand: q (64x64), k and v (64x32 each), o (64x64), gate/up/down (3 x 64x128),
# two RMSNorm vectors per layer, embedding and untied head (128x64 each), final norm.
SHARDED_PER_LAYER = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128   # 36864, split by tp
NORMS_PER_LAYER = 2 * 64
EMB = HEAD = 128 * 64


def local_param_bytes(tp):
    return W * (L * (SHARDED_PER_LAYER // tp + NORMS_PER_LAYER) + EMB // tp + HEAD // tp + H)


def totals(rows: list[CommRow]) -> dict:
    out = defaultdict(float)
    for r in rows:
        out[(r.phase, r.collective, r.axis)] += r.bytes_sent * r.count
    return dict(out)


def table(plan):
    return estimate(SPEC, CLUSTER, plan, S, GB, dtype_bytes=W).comm_table()


def test_param_count_by_hand():
    assert SPEC.num_params == L * (SHARDED_PER_LAYER + NORMS_PER_LAYER) + EMB + HEAD + H == 90432


def test_tp2_without_sp():
    b = GB  # dp = mb = 1
    A = b * S * H * W
    ar = lambda F, n: 2 * (n - 1) / n * F  # noqa: E731
    expected = {
        ("fwd", "all_reduce", "tp"): (2 * L + 1) * ar(A, 2) + 3 * ar(b * S * 4, 2),  # + loss_parallel
        ("bwd", "all_reduce", "tp"): (2 * L + 1) * ar(A, 2),
    }
    rows = table("tp=2")
    assert totals(rows) == pytest.approx(expected)
    loss = [r for r in rows if r.dimension == "loss_parallel"]
    assert len(loss) == 1 and loss[0].count == 3 and loss[0].bytes_sent == ar(b * S * 4, 2)
    tp_rows = [r for r in rows if r.dimension == "tp"]
    assert {r.count for r in tp_rows} == {2 * L + 1} and all(r.group_size == 2 for r in rows)


def test_tp2_with_sp():
    b, tp = GB, 2
    A = b * S * H * W
    ag = (tp - 1) * A / tp
    rs = (tp - 1) / tp * A
    norms = (2 * L + 1) * H * W
    expected = {
        ("fwd", "all_gather", "tp"): (2 * L + 1) * ag,
        ("fwd", "reduce_scatter", "tp"): (2 * L + 1) * rs,
        ("bwd", "reduce_scatter", "tp"): (2 * L + 1) * rs,
        # duals of the forward reduce-scatters, and the re-gathers of the saved shards (ops/regather.py)
        ("bwd", "all_gather", "tp"): (2 * L + 1) * ag * 2,
        ("grad", "all_reduce", "tp"): 2 * (tp - 1) / tp * norms,
        ("fwd", "all_reduce", "tp"): 3 * 2 * (tp - 1) / tp * b * S * 4,
    }
    assert totals(table("tp=2,sp")) == pytest.approx(expected)


def test_dp2():
    F = local_param_bytes(1)
    assert F == 361728
    expected = {("grad", "all_reduce", "dp"): F, ("loss", "all_reduce", "dp"): 4}
    rows = table("dp=2")
    assert totals(rows) == pytest.approx(expected)
    assert all(r.count == 1 for r in rows)


def test_tp2_sp_dp2():
    tp, dp = 2, 2
    b = GB // dp
    A = b * S * H * W
    F = local_param_bytes(tp)
    assert F == 4 * (2 * (36864 // 2 + 128) + 4096 + 4096 + 64)
    expected = {
        ("fwd", "all_gather", "tp"): (2 * L + 1) * (tp - 1) * A / tp,
        ("fwd", "reduce_scatter", "tp"): (2 * L + 1) * A / 2,
        ("bwd", "reduce_scatter", "tp"): (2 * L + 1) * A / 2,
        ("bwd", "all_gather", "tp"): (2 * L + 1) * A / 2 * 2,  # duals and re-gathers
        ("grad", "all_reduce", "tp"): (2 * L + 1) * H * W,
        ("fwd", "all_reduce", "tp"): 3 * b * S * 4,
        ("grad", "all_reduce", "dp"): F,
        ("loss", "all_reduce", "dp"): 4,
    }
    assert totals(table("tp=2,sp,dp=2")) == pytest.approx(expected)


def test_tp4_sp():
    # tp=4 cannot split 2 KV heads (Plan rejects KV replication), so this plan uses 4 KV heads;
    # the TP/SP rows do not depend on the KV heads.
    tp = 4
    A = GB * S * H * W
    expected = {
        ("fwd", "all_gather", "tp"): (2 * L + 1) * 3 * A / 4,
        ("fwd", "reduce_scatter", "tp"): (2 * L + 1) * 3 / 4 * A,
        ("bwd", "reduce_scatter", "tp"): (2 * L + 1) * 3 / 4 * A,
        ("bwd", "all_gather", "tp"): (2 * L + 1) * 3 * A / 4 * 2,  # duals and re-gathers
        ("grad", "all_reduce", "tp"): 2 * 3 / 4 * (2 * L + 1) * H * W,
        ("fwd", "all_reduce", "tp"): 3 * 2 * 3 / 4 * GB * S * 4,
    }
    rows = estimate(SPEC.replace(num_kv_heads=4), CLUSTER, f"tp={tp},sp", S, GB, dtype_bytes=W).comm_table()
    assert totals(rows) == pytest.approx(expected)


def test_microbatches_multiply_counts_not_bytes():
    one, four = table("tp=2,sp,dp=2"), table("tp=2,sp,dp=2,mb=2")
    # Per call: micro-batch half the size; per step: same activation bytes, same gradient bytes.
    assert totals(one) == pytest.approx(totals(four))
    fwd_ag = [r for r in four if r.phase == "fwd" and r.collective == "all_gather"][0]
    assert fwd_ag.count == 2 * (2 * L + 1)


def test_zero_stages_by_hand():
    F = local_param_bytes(1)
    n = 2
    z1 = totals(table("dp=2,zero=1"))
    assert z1[("grad", "reduce_scatter", "dp")] == pytest.approx((n - 1) / n * F)
    assert z1[("step", "all_gather", "dp")] == pytest.approx((n - 1) * F / n)
    z2 = totals(table("dp=2,zero=2,mb=2"))  # reduce-scatter after each micro-batch
    assert z2[("grad", "reduce_scatter", "dp")] == pytest.approx(2 * (n - 1) / n * F)
    z3 = totals(table("dp=2,zero=3"))       # gather for forward and backward, no step gather
    embedding = V * H * W  # the token table's unit: the lookup's backward reads only the indices
    assert z3[("fwd", "all_gather", "dp")] == pytest.approx((n - 1) * F / n)
    assert z3[("bwd", "all_gather", "dp")] == pytest.approx((n - 1) * (F - embedding) / n)
    assert ("step", "all_gather", "dp") not in z3
    # ZeRO-3 moves 1.5x the bytes of plain DP (Rajbhandari et al.), less the embedding's backward gather.
    dp0 = totals(table("dp=2"))[("grad", "all_reduce", "dp")]
    moved = sum(v for (ph, _, ax), v in z3.items() if ax == "dp" and ph != "loss")
    assert moved == pytest.approx(1.5 * dp0 - (n - 1) / n * embedding)


def _calls(rows) -> dict:
    out = defaultdict(int)
    for r in rows:
        out[(r.phase, r.collective, r.axis)] += r.count
    return dict(out)


def test_gradient_bucket_calls_by_hand():
    """One call per gradient bucket of at most 40000 bytes, counted by hand on the tiny spec (fp32).

    Local bytes: token table and head 32768, q and o 16384, k and v 8192, gate, up and down 32768,
    norms 256.  Backward's order packs [head, final norm, 2 norms of layer 1], [down1], [up1],
    [gate1], [o1, v1, k1] (32768; q1 would make 49152), [q1, 2 norms of layer 0] (spans both
    layers), [down0], [up0], [gate0], [o0, v0, k0], [q0], [token table]: 12 buckets."""
    est = lambda plan: estimate(SPEC, CLUSTER, plan, S, GB, dtype_bytes=W, bucket_bytes=40000)  # noqa: E731
    F = local_param_bytes(1)
    dp = est("dp=2").comm_table()
    assert _calls(dp)[("grad", "all_reduce", "dp")] == 12
    assert totals(dp)[("grad", "all_reduce", "dp")] == pytest.approx(F)  # the bytes do not change: 2 (n-1)/n F
    z1 = _calls(est("dp=2,zero=1").comm_table())
    assert (z1[("grad", "reduce_scatter", "dp")], z1[("step", "all_gather", "dp")]) == (12, 12)
    z2 = _calls(est("dp=2,zero=2,mb=2").comm_table())  # every micro-batch scatters every bucket
    assert (z2[("grad", "reduce_scatter", "dp")], z2[("step", "all_gather", "dp")]) == (24, 12)
    # pp=2 puts one layer on each rank: rank 0 holds the token table and layer 0 (the last 7
    # buckets, the spanning one included), rank 1 layer 1 and the head (the first 6).
    piped = est("pp=2,dp=2,mb=2")
    assert [_calls(piped.comm_table(r))[("grad", "all_reduce", "dp")] for r in (0, 1)] == [7, 6]
    # The default cap (25 MiB) holds this whole model: one call.
    assert _calls(table("dp=2"))[("grad", "all_reduce", "dp")] == 1


def test_context_parallel_variants_by_hand():
    cp = 2
    T = GB * S // cp                       # tokens per rank
    kv = T * KV * HD * W                   # one of K or V
    q = T * HEADS * HD * W
    ring = totals(table("cp=2:ring"))
    assert ring[("fwd", "send", "cp")] == pytest.approx(L * (cp - 1) * 2 * kv)
    assert ring[("bwd", "send", "cp")] == pytest.approx(L * (cp - 1) * 4 * kv)
    ag = totals(table("cp=2:allgather"))
    assert ag[("fwd", "all_gather", "cp")] == pytest.approx(L * (cp - 1) * 2 * kv)
    assert ag[("bwd", "reduce_scatter", "cp")] == pytest.approx(L * (cp - 1) / cp * 2 * kv * cp)
    ul = totals(table("cp=2:ulysses"))
    assert ul[("fwd", "all_to_all", "cp")] == pytest.approx(L * (cp - 1) / cp * (2 * q + 2 * kv))
    assert ul[("bwd", "all_to_all", "cp")] == pytest.approx(L * (cp - 1) / cp * (2 * q + 2 * kv))


def test_pipeline_p2p_by_hand():
    A = GB // 2 * S * H * W                # mb=2 micro-batches of 2
    rows0 = estimate(SPEC, CLUSTER, "pp=2,mb=2", S, GB, dtype_bytes=W).comm_table(pp_rank=0)
    rows1 = estimate(SPEC, CLUSTER, "pp=2,mb=2", S, GB, dtype_bytes=W).comm_table(pp_rank=1)
    # Plus the fp32 loss all-reduced over pp (2 ranks: 2*(2-1)/2 * 4 bytes) so every stage returns it.
    assert totals(rows0) == pytest.approx({("fwd", "send", "pp"): 2 * A, ("bwd", "recv", "pp"): 0.0,
                                           ("loss", "all_reduce", "pp"): 4.0})
    assert {(r.phase, r.collective): r.bytes_recv * r.count for r in rows1} == pytest.approx(
        {("fwd", "recv"): 2 * A, ("bwd", "send"): 0.0, ("loss", "all_reduce"): 4.0})
    with_sp = estimate(SPEC, CLUSTER, "pp=2,tp=2,sp,mb=2", S, GB, dtype_bytes=W).comm_table()
    send = [r for r in with_sp if r.dimension == "pp"][0]
    assert send.bytes_sent == A / 2        # SP-sharded boundary


def test_expert_parallel_by_hand():
    moe = ModelSpec(name="tiny-moe", num_layers=L, hidden=H, num_heads=HEADS, num_kv_heads=KV, ffn=FFN,
                    vocab=V, num_experts=4, top_k=2)
    rows = estimate(moe, CLUSTER, "dp=2,ep=2", S, GB, dtype_bytes=W).comm_table()
    T = GB // 2 * S
    a2a = [r for r in rows if r.dimension == "ep"]
    assert {r.phase for r in a2a} == {"fwd", "bwd"}
    tokens = [r for r in a2a if "token counts" not in r.what]
    # dispatch and combine, forward and backward: half of the T*k rows leave the rank
    assert sum(r.bytes_sent * r.count for r in tokens) == pytest.approx(4 * L * (1 / 2) * T * 2 * H * W)
    # dispatch first exchanges the int64 count of every expert: (ep-1)/ep * E * 8 bytes per layer
    (counts,) = [r for r in a2a if "token counts" in r.what]
    assert (counts.phase, counts.count, counts.bytes_sent) == ("fwd", L, (1 / 2) * 4 * 8)
    # Experts are replicated dp*cp/ep = 1 times: no expert gradient reduction.
    assert all("expert" not in r.what for r in rows if r.dimension == "dp")


def test_size_one_axes_are_never_listed():
    assert table("none") == []
    assert all(r.group_size > 1 for r in table("tp=2,sp,dp=2"))
