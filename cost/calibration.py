"""Calibration against published Megatron-LM runs (calibration.md sets A, B, C).

``calibration_rows()`` turns every row of the three tables into a spec, cluster, plan and
options; ``calibration_table()`` predicts each one and returns predicted vs published
MFU (and iteration time, and memory for set C) with the relative errors;
``fit_constants()`` is how time.CALIBRATED was obtained (a coarse grid then coordinate
refinement minimising the median plus a quarter of the maximum absolute relative MFU
error). docs/cost-model.md prints the table and tests/unit/test_calibration.py holds its
error bounds.

Assumptions, since the tables do not say: set A models are GPT layers (MHA, FFN 4h,
GeLU, LayerNorm) run with micro-batch 1, SP, the distributed optimizer (ZeRO-1), TP
communication overlap and the plain 1F1B schedule; set B ran full recompute, no SP,
2-byte gradients (16 B per parameter, which the 1T row needs to fit 80 GB); set C is
Megatron of 2022 (fp32 main gradients: 18 B per parameter, no DP). The published MFUs
count FLOPs by Megatron's formula (flops.megatron_flops): 72*B*s*l*h^2*(1 + s/6h +
V/12lh) for sets A and C, and set B's hardware FLOPs with the recompute pass,
96*B*s*l*h^2*(1 + s/6h + V/16lh). We compare in their convention: predicted MFU =
their FLOPs / (predicted step time * GPUs * peak).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .estimate import Cost, estimate
from .flops import megatron_flops
from .hardware import Cluster
from .spec import ModelSpec

__all__ = ["CalibrationRow", "calibration_rows", "calibration_table", "fit_constants", "markdown_table",
           "predict", "GIB"]

GIB = 2**30


@dataclass(frozen=True)
class CalibrationRow:
    set: str
    name: str
    spec: ModelSpec
    cluster: Cluster
    plan: str
    seq_len: int
    global_batch: int
    mfu: float                        # published, in its FLOP convention
    recompute_flops: bool = False     # set B counts the recompute pass
    time: float | None = None         # published iteration time (set C)
    weights_optimizer_gib: float | None = None
    activations_gib: float | None = None
    options: dict = field(default_factory=dict)


def _gpt(name, heads, hidden, layers, vocab) -> ModelSpec:
    return ModelSpec(name=name, num_layers=layers, hidden=hidden, num_heads=heads, vocab=vocab,
                     ffn=4 * hidden, gated_mlp=False, norm="layernorm", qkv_bias=True, tied_embeddings=True)


def _plan(tp, pp, dp, mb, *, sp=False, vpp=1, zero=0, recompute="none"):
    parts = [f"tp={tp}"] if tp > 1 else []
    if sp and tp > 1:
        parts.append("sp")
    if pp > 1:
        parts.append(f"pp={pp}:{'interleaved' if vpp > 1 else '1f1b'}")
        if vpp > 1:
            parts.append(f"vpp={vpp}")
    parts += [f"dp={dp}", f"mb={mb}", f"zero={zero}", f"recompute={recompute}"]
    return ",".join(parts)


# (size, heads, hidden, layers, TP, PP, DP, GPUs, batch, TFLOP/s, MFU)
_SET_A = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
# (params, heads, hidden, layers, TP, PP, GPUs, batch, micro-batch, TFLOP/s, vpp)
_SET_B = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137, 1),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 138, 1),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 142, 1),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 135, 1),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 138, 1),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 140, 3),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 148, 2),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 155, 2),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 163, 3),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 163, 1),
]
# (model, heads, hidden, layers, TP, PP, GPUs, batch, micro-batch, time full, time SP+sel, MFU,
#  weights+optimizer GiB, activations none GiB, activations SP+selective GiB, vpp)
_SET_C = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10, 0.415, 45.56, 59.25, 9.56, 1),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75, 0.514, 45.56, 66.84, 12.35, 3),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83, 0.560, 31.64, 114.02, 23.08, 3),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49, 0.563, 32.96, 131.25, 26.56, 1),
]


def calibration_rows() -> list[CalibrationRow]:
    rows = []
    for size, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops in _SET_A:
        mb = batch // dp
        rows.append(CalibrationRow(
            "A", size, _gpt(f"A-{size}", heads, hidden, layers, 131072), Cluster.for_world("h100", gpus),
            _plan(tp, pp, dp, mb, sp=True, zero=1), 4096, batch, tflops / 989,
            options=dict(tp_comm_overlap=True, zero_overlap=True)))
    for size, heads, hidden, layers, tp, pp, gpus, batch, micro, tflops, vpp in _SET_B:
        dp = gpus // (tp * pp)
        rows.append(CalibrationRow(
            "B", size, _gpt(f"B-{size}", heads, hidden, layers, 51200), Cluster.for_world("a100", gpus),
            _plan(tp, pp, dp, batch // (dp * micro), vpp=vpp, recompute="full"), 2048, batch, tflops / 312,
            recompute_flops=True, options=dict(grad_bytes=2, flash_attention=False)))
    for (size, heads, hidden, layers, tp, pp, gpus, batch, micro, t_full, t_sel, mfu, wo, act_none,
         act_sel, vpp) in _SET_C:
        spec = _gpt(f"C-{size}", heads, hidden, layers, 51200)
        cluster = Cluster.for_world("a100", gpus)
        dp = gpus // (tp * pp)
        mb = batch // (dp * micro)
        opts = dict(activation_formula="korthikanti", flash_attention=False)
        f72 = megatron_flops(spec, 2048, batch)
        rows.append(CalibrationRow(
            "C", f"{size} SP+selective", spec, cluster, _plan(tp, pp, dp, mb, sp=True, vpp=vpp, recompute="selective"),
            2048, batch, mfu, time=t_sel, weights_optimizer_gib=wo, activations_gib=act_sel, options=opts))
        rows.append(CalibrationRow(
            "C", f"{size} full recompute", spec, cluster, _plan(tp, pp, dp, mb, vpp=vpp, recompute="full"),
            2048, batch, f72 / (t_full * gpus * cluster.peak_flops), time=t_full, options=opts))
        rows.append(CalibrationRow(
            "C", f"{size} no recompute (memory only)", spec, cluster, _plan(tp, pp, dp, mb, vpp=vpp),
            2048, batch, float("nan"), activations_gib=act_none, options=opts))
    return rows


def predict(row: CalibrationRow, constants: dict | None = None,
            gemm: dict | None = None) -> tuple[Cost, float]:
    """(Cost, predicted MFU in the row's published FLOP convention); ``gemm`` overrides the
    GEMM efficiency per GPU name."""
    cluster = row.cluster
    if gemm and cluster.gpu in gemm:
        cluster = cluster.replace(gemm_efficiency=gemm[cluster.gpu])
    cost = estimate(row.spec, cluster, row.plan, row.seq_len, row.global_batch,
                    constants=constants, **row.options)
    flops = megatron_flops(row.spec, row.seq_len, row.global_batch, recompute=row.recompute_flops)
    return cost, flops / (cost.step_time * row.cluster.world_size * row.cluster.peak_flops)


def calibration_table(constants: dict | None = None, gemm: dict | None = None) -> list[dict]:
    """One dict per row: published and predicted MFU, time, memory, and relative errors."""
    table = []
    for row in calibration_rows():
        cost, mfu = predict(row, constants, gemm)
        mem = cost.memory(0)  # Korthikanti et al.'s memory figures are the first pp rank's
        entry = dict(set=row.set, name=row.name, plan=row.plan, gpus=row.cluster.world_size,
                     mfu=row.mfu, mfu_pred=mfu, mfu_err=(mfu - row.mfu) / row.mfu if row.mfu == row.mfu else None,
                     time=row.time, time_pred=cost.step_time,
                     time_err=(cost.step_time - row.time) / row.time if row.time else None,
                     fits=cost.fits, memory_gib=cost.memory_per_gpu / GIB,
                     pipeline_buffers_gib=cost.memory()["pipeline_buffers"] / GIB)
        if row.weights_optimizer_gib is not None:
            wo = (mem["params"] + mem["grads"] + mem["optimizer"]) / GIB
            entry.update(wo=row.weights_optimizer_gib, wo_pred=wo,
                         wo_err=(wo - row.weights_optimizer_gib) / row.weights_optimizer_gib)
        if row.activations_gib is not None:
            act = mem["activations"] / GIB
            entry.update(act=row.activations_gib, act_pred=act,
                         act_err=(act - row.activations_gib) / row.activations_gib)
        table.append(entry)
    return table


def _score(constants: dict, gemm: dict | None = None) -> float:
    errs = sorted(abs(e["mfu_err"]) for e in calibration_table(constants, gemm) if e["mfu_err"] is not None)
    return errs[len(errs) // 2] + 0.25 * errs[-1]


def fit_constants(start: dict | None = None, rounds: int = 2) -> tuple[dict, dict, float]:
    """Coordinate search over the GEMM efficiency per GPU and kappa, epsilon, phi.

    Slow-ish (tens of seconds); not run by the tests. Returns (constants, gemm_efficiency by
    GPU, score).
    """
    from .hardware import GPU_PRESETS
    from .time import CALIBRATED

    grids = dict(kappa=[0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], epsilon=[0.6, 0.7, 0.8, 0.9],
                 phi=[0.5, 0.7, 0.8, 0.9, 0.95])
    eta_grid = [0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    best = dict(start or CALIBRATED)
    gemm = {g: GPU_PRESETS[g]["gemm_efficiency"] for g in ("a100", "h100")}
    best_score = _score(best, gemm)
    for _ in range(rounds):
        for gpu in gemm:
            for value in eta_grid:
                trial = {**gemm, gpu: value}
                score = _score(best, trial)
                if score < best_score:
                    gemm, best_score = trial, score
        for name, grid in grids.items():
            for value in grid:
                trial = {**best, name: value}
                score = _score(trial, gemm)
                if score < best_score:
                    best, best_score = trial, score
    return best, gemm, best_score


def markdown_table(table: list[dict] | None = None) -> str:
    """The calibration table as docs/cost-model.md prints it."""
    table = calibration_table() if table is None else table
    pct = lambda x: "" if x is None else f"{x * 100:+.1f}%"  # noqa: E731
    lines = ["| set | run | plan | GPUs | MFU published | MFU predicted | error | time published (s) "
             "| time predicted (s) | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for e in table:
        if e["mfu_err"] is None:
            continue
        t_pub = "" if e["time"] is None else f"{e['time']:.2f}"
        lines.append(f"| {e['set']} | {e['name']} | `{e['plan']}` | {e['gpus']} | {e['mfu'] * 100:.1f}% | "
                     f"{e['mfu_pred'] * 100:.1f}% | {pct(e['mfu_err'])} | {t_pub} | {e['time_pred']:.2f} | "
                     f"{pct(e['time_err'])} |")
    lines += ["", "| set C run | weights + optimizer published (GiB) | predicted | error "
              "| activations published (GiB) | predicted | error |", "|---|---|---|---|---|---|---|"]
    for e in table:
        if e.get("act") is None:
            continue
        wo = (f"{e['wo']:.2f} | {e['wo_pred']:.2f} | {pct(e['wo_err'])}" if e.get("wo") is not None
              else " | | ")
        lines.append(f"| {e['name']} | {wo} | {e['act']:.2f} | {e['act_pred']:.2f} | {pct(e['act_err'])} |")
    return "\n".join(lines)
