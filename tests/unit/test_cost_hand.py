"""Hand derivations of the cost model's memory and pipeline terms, at two sets of numbers.

Every expected value is computed here from the model's dimensions and the plan, never
read back from autopar.cost: parameter / gradient / optimizer bytes under ZeRO 0-3 with
TP and PP sharding; activation bytes per layer under each recompute mode with and
without SP; Korthikanti et al.'s GPT activation table (calibration.md set C); and, for
each pipeline schedule, the peak micro-batches in flight and the bubble.
"""
from __future__ import annotations

import pytest
import sympy

from autopar.cost import Cluster, ModelSpec, estimate

GiB = 2**30


def cluster(num_gpus: int) -> Cluster:
    return Cluster(gpu="h100", num_nodes=max(1, num_gpus // 8), gpus_per_node=min(8, num_gpus))


# Two dense Llama-style models (RMSNorm, SwiGLU, GQA, untied head).
LLAMA8B = dict(num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               ffn=14336, vocab=128256)
SMALL = dict(num_layers=12, hidden=2048, num_heads=16, num_kv_heads=4, head_dim=128,
             ffn=5632, vocab=32000)


def spec_of(dims: dict) -> ModelSpec:
    return ModelSpec(name="hand", **dims)


# ---------------------------------------------------------------------- parameter state
def stage_param_sum(dims: dict, tp: int) -> float:
    """Parameters held by one rank of each pipeline stage, summed over the stages."""
    h, a, g, d, f, V, L = (dims[k] for k in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                            "ffn", "vocab", "num_layers"))
    attention = (h * (a + 2 * g) * d + a * d * h) / tp     # q, k, v column-, o row-sharded
    mlp = 3 * h * f / tp                                   # gate, up, down
    norms = 2 * h                                          # replicated
    return L * (attention + mlp + norms) + 2 * V * h / tp + h   # + embedding, head, final norm


STATE_CASES = [
    # dims, tp, pp, dp, grad_bytes (None: the default fp32 main grads), bytes per held grad
    (LLAMA8B, 2, 2, 4, None, 4),
    (SMALL, 4, 3, 2, 2, 2),
]


@pytest.mark.parametrize("dims, tp, pp, dp, grad_bytes, wg", STATE_CASES)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_parameter_gradient_optimizer_memory(dims, tp, pp, dp, grad_bytes, wg, zero):
    world = tp * pp * dp
    plan = f"tp={tp},pp={pp},dp={dp},mb={pp}" + (f",zero={zero}" if zero else "")
    cost = estimate(spec_of(dims), cluster(world), plan, 2048, dp * pp,
                    **({"grad_bytes": grad_bytes} if grad_bytes else {}))
    P = stage_param_sum(dims, tp)
    n = dp                                    # ranks holding copies (dp * cp, cp = 1)
    # bf16 params (2 B), held grads (wg B), fp32 master + Adam m, v (12 B); ZeRO divides by n.
    # ZeRO-3 holds no bf16 shard: the fp32 master shard (in the 12 B) is what it gathers.
    expected = {
        "params": 0 if zero == 3 else 2 * P,
        "grads": wg * P / (n if zero >= 2 else 1),
        "optimizer": 12 * P / (n if zero >= 1 else 1),
    }
    for category, value in expected.items():
        got = sum(cost.memory(r)[category] for r in range(pp))
        assert got == pytest.approx(value, rel=1e-12), category


# ---------------------------------------------------------------------- activations
def layer_activation_bytes(dims: dict, *, b: int, seq: int, tp: int, cp: int, sp_on: bool,
                           recompute: str, w: int = 2) -> float:
    """Bytes one decoder layer keeps for backward (pre-RMSNorm, SwiGLU, flash attention).

    Saved tensors, T = b*seq/cp tokens on the rank, T_sp = T/tp under SP:
      each RMSNorm (computed in fp32, as Llama's): the fp32 copy of its input [T_sp, h]
        (saved by x.pow(2) and x * rstd), the normalised input cast back to w bytes (saved
        by the weight's multiply) and fp32 1/rms per token;
      each column group (q/k/v, gate/up): its input, which under SP is the rank's sequence
        shard [T/tp, h] (the GEMMs' saved input is re-gathered in backward, Korthikanti et al.);
      flash attention: q, k, v, the output, fp32 log-sum-exp per head; K and V are the
        model's expand + reshape copies at a/tp heads when a rank holds two or more KV heads
        (g/tp >= 2) and cp = 1 (one local KV head: the reshape is a view of the g/tp heads;
        CP attention takes K, V unexpanded);
      MLP: gate and up outputs, silu(gate), silu(gate)*up.
    Selective recompute drops the attention output + LSE and silu(gate), the product.
    Full recompute keeps the layer input only.
    """
    h, a, g, d, f = (dims[k] for k in ("hidden", "num_heads", "num_kv_heads", "head_dim", "ffn"))
    T = b * seq / cp
    t_sp = T / tp if sp_on else T
    if recompute == "full":
        return t_sp * h * w
    norms = 2 * (t_sp * h * 4 + t_sp * h * w + 4 * t_sp)
    linear_inputs = 2 * t_sp * h * w  # under SP the GEMMs keep the sequence shard (re-gathered in backward)
    kv_heads_seen = a if (g // tp >= 2 and cp == 1) else g
    qkv = T * (a + 2 * kv_heads_seen) * d * w / tp
    attn_out = T * a * d * w / tp + 4 * T * a / tp
    mlp = 4 * T * f * w / tp
    total = norms + linear_inputs + qkv + attn_out + mlp
    if recompute == "selective":
        total -= attn_out + 2 * T * f * w / tp
    return total


ACT_CASES = [
    # dims, micro-batch, seq, tp, cp
    (LLAMA8B, 2, 4096, 4, 1),
    (SMALL, 4, 2048, 2, 2),
]


@pytest.mark.parametrize("dims, b, seq, tp, cp", ACT_CASES)
@pytest.mark.parametrize("sp_on", [False, True])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_memory_per_layer(dims, b, seq, tp, cp, sp_on, recompute):
    plan = f"tp={tp}" + (",sp" if sp_on else "") + (f",cp={cp}" if cp > 1 else "")
    plan += f",recompute={recompute}" if recompute != "none" else ""
    cost = estimate(spec_of(dims), cluster(tp * cp), plan, seq, b)   # dp = mb = 1
    per_layer = layer_activation_bytes(dims, b=b, seq=seq, tp=tp, cp=cp, sp_on=sp_on,
                                       recompute=recompute)
    assert cost.memory()["activations"] == pytest.approx(dims["num_layers"] * per_layer, rel=1e-12)


@pytest.mark.parametrize("dims, b, seq, tp, cp", ACT_CASES)
def test_full_recompute_working_set_is_one_layer(dims, b, seq, tp, cp):
    plan = f"tp={tp}" + (f",cp={cp}" if cp > 1 else "") + ",recompute=full"
    cost = estimate(spec_of(dims), cluster(tp * cp), plan, seq, b)
    one_layer = layer_activation_bytes(dims, b=b, seq=seq, tp=tp, cp=cp, sp_on=False,
                                       recompute="none")
    assert cost.memory()["recompute_buffer"] == pytest.approx(one_layer, rel=1e-12)


# ---------------------------------------------------------------------- Korthikanti, set C
def gpt(num_layers: int, hidden: int, num_heads: int) -> ModelSpec:
    return ModelSpec(name="gpt", num_layers=num_layers, hidden=hidden, num_heads=num_heads,
                     ffn=4 * hidden, vocab=51200, gated_mlp=False, norm="layernorm",
                     tied_embeddings=True)


# model, heads, hidden, layers, pp, interleaving v, global batch (= micro-batches), micro-batch,
# table GiB (activations none, SP + selective)
SET_C = [
    ("22B", 64, 6144, 48, 1, 1, 4, 4, 59.25, 9.56),
    ("175B", 96, 12288, 96, 8, 3, 64, 1, 66.84, 12.35),
    ("530B", 128, 20480, 105, 35, 3, 280, 1, 114.02, 23.08),
    ("1T", 160, 25600, 128, 64, 1, 512, 1, 131.25, 26.56),
]


@pytest.mark.parametrize("name, a, h, L, pp, v, gb, mbs, none_gib, sel_gib", SET_C,
                         ids=[row[0] for row in SET_C])
@pytest.mark.parametrize("mode", ["none", "sp+selective"])
def test_korthikanti_set_c(name, a, h, L, pp, v, gb, mbs, none_gib, sel_gib, mode):
    t, s = 8, 2048
    m = gb // mbs
    sbh = s * mbs * h
    if mode == "none":
        per_layer = sbh * (10 + 24 / t + 5 * a * s / (h * t))
    else:
        per_layer = 34 * sbh / t
    # the first pipeline rank holds L/pp layers and p micro-batches in flight under 1F1B;
    # interleaved: p + (p-1)/v (Megatron: 2(p-1) + (v-1)p warm-up chunks + 1, of 1/v each)
    inflight = 1 if pp == 1 else (pp if v == 1 else pp + (pp - 1) / v)
    expected = per_layer * (L / pp) * inflight
    assert round(expected / GiB, 2) == (none_gib if mode == "none" else sel_gib)
    sched = "" if pp == 1 else (f",pp={pp}:interleaved,vpp={v}" if v > 1 else f",pp={pp}")
    extra = ",sp,recompute=selective" if mode != "none" else ""
    cost = estimate(gpt(L, h, a), cluster(t * pp), f"tp={t}{sched},mb={m}{extra}", s, gb,
                    activation_formula="korthikanti")
    assert cost.memory(0)["activations"] == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------- pipeline schedules
PIPE_DIMS = dict(num_layers=8, hidden=1024, num_heads=8, num_kv_heads=8, head_dim=128,
                 ffn=2816, vocab=256)   # tiny head: every rank gets L/pp layers
PIPE_SEQ = 512


def pipe_cost(plan: str, m: int, pp: int):
    return estimate(spec_of(PIPE_DIMS), cluster(pp), plan + f",mb={m}", PIPE_SEQ, m)  # b = 1


def expected_inflight(schedule: str, p: int, m: int, rank: int, v: int = 2) -> float:
    """Peak micro-batches of a rank's activations held, in units of the rank's layers."""
    if schedule == "gpipe":
        return m                                      # every forward before any backward
    if schedule == "1f1b":
        return min(p - rank, m)                       # p - rank - 1 warm-up forwards + 1
    if schedule == "interleaved":                    # Megatron: 2(p-r-1) + (v-1)p warm-up chunks
        return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v
    if schedule == "zbv":
        return min(p, m)                              # 2p half-size chunks (ZB-V = 1F1B's peak)
    if schedule == "dualpipev":
        # DualPipeV on rank r: 2(p-r-1) F0, then (r+1) x (F0, F1), then (B1, W, F1) pairs:
        # 2p chunks held, one more while a fused F&B runs: 2p + 1 chunks of half a rank.
        return (2 * p + 1) / 2
    raise AssertionError(schedule)


PIPE_CASES = [(4, 8), (2, 4)]   # (pp, micro-batches)
SCHEDULE_PLANS = {"gpipe": ":gpipe", "1f1b": "", "interleaved": ":interleaved,vpp=2",
                  "zbv": ":zbv", "dualpipev": ":dualpipev"}


@pytest.mark.parametrize("p, m", PIPE_CASES)
@pytest.mark.parametrize("schedule", list(SCHEDULE_PLANS))
def test_inflight_microbatches(p, m, schedule):
    flat = pipe_cost("", m, 1).memory()["activations"]       # all L layers, 1 micro-batch held
    per_layer = flat / PIPE_DIMS["num_layers"]
    cost = pipe_cost(f"pp={p}{SCHEDULE_PLANS[schedule]}", m, p)
    layers_per_rank = PIPE_DIMS["num_layers"] // p
    for rank in range(p):
        got = cost.memory(rank)["activations"] / (per_layer * layers_per_rank)
        assert got == pytest.approx(expected_inflight(schedule, p, m, rank)), rank


@pytest.mark.parametrize("p, m", PIPE_CASES)
@pytest.mark.parametrize("schedule, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_bubble_fraction(p, m, schedule, v):
    plan = f"pp={p}{SCHEDULE_PLANS[schedule]}"
    one, two = pipe_cost(plan, m, p), pipe_cost(plan, 2 * m, p)
    # step = m*X + bubble + optimizer with X = T_f + T_b of one micro-batch (dp = tp = 1):
    # doubling m at a fixed micro-batch size adds m*X and nothing else.
    x = (two.step_time - one.step_time) / m
    assert one.bubble == pytest.approx((p - 1) * x / v, rel=1e-9)
    fraction = one.bubble / (m * x + one.bubble)
    assert fraction == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


T_f, T_b, T_w = sympy.symbols("T_f T_b T_w", nonnegative=True)


def chunk_times(tf: float, tb: float, tw: float):
    """Stage-level forward, full backward and weight-grad time -> per-chunk (two chunks)."""
    return tf / 2, (tb - tw) / 2, tw / 2, tb / 2   # F, B (input grads only), W, full backward


@pytest.mark.parametrize("p, tf, tb, tw", [(4, 1.0, 2.0, 0.7), (8, 3.0, 5.0, 2.5)])
def test_zbv_bubble(p, tf, tb, tw):
    from autopar.cost.pipeline import bubble_expr

    F, Bin, W, _ = chunk_times(tf, tb, tw)
    expected = (p - 1) * max(F + Bin - 2 * W, 0)     # ZB-V: zero when F = B = W per chunk
    got = float(bubble_expr("zbv").subs({sympy.Symbol("pp", positive=True): p,
                                         T_f: tf, T_b: tb, T_w: tw}))
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("p, tf, tb, tw", [(4, 1.0, 2.0, 0.7), (8, 3.0, 5.0, 2.5)])
def test_dualpipev_bubble(p, tf, tb, tw):
    from autopar.cost.pipeline import bubble_expr

    F, _, W, Bfull = chunk_times(tf, tb, tw)
    # DeepSeek's table: (ranks - 1)(F&B + B - 3W) per chunk, B a full backward, F&B a
    # forward fused with a full backward (no faster than F + B without overlap).
    expected = (p - 1) * max((F + Bfull) + Bfull - 3 * W, 0)
    got = float(bubble_expr("dualpipev").subs({sympy.Symbol("pp", positive=True): p,
                                               T_f: tf, T_b: tb, T_w: tw}))
    assert got == pytest.approx(expected)


# ---------------------------------------------------------------------- expert weights
@pytest.mark.parametrize("tp, dp, ep", [(2, 4, 4), (4, 2, 2)])
def test_expert_weights_per_rank_follow_design_replication(tp, dp, ep):
    # Experts are sharded by expert index over ep and kept whole on each TP rank (expert
    # tensor parallelism 1, as Megatron-Core's default): each rank holds 1/ep of them, and
    # each expert has tp*dp*cp/ep replicas; routers are replicated on every rank.
    dims = dict(num_layers=4, hidden=1024, num_heads=8, num_kv_heads=8, ffn=2816, vocab=1000,
                top_k=2, moe_ffn=2816)
    h, f, L = dims["hidden"], dims["moe_ffn"], dims["num_layers"]

    def params(num_experts):
        spec = ModelSpec(name="moe", num_experts=num_experts, **dims)
        return estimate(spec, cluster(tp * dp), f"tp={tp},dp={dp},ep={ep}", 512, dp).memory()["params"]

    extra_experts = 16 - 8
    expected = 2 * L * (extra_experts * 3 * h * f / ep + h * extra_experts)
    assert params(16) - params(8) == pytest.approx(expected)
