"""``autopar plan`` and ``autopar explain`` run in-process through autopar.cli.main.

Expected numbers are derived here from the inputs (plan, batch, sequence, model sizes),
not read back from the cost model: the world size of every printed plan, tokens/s from
the step time, and the bytes of the SP all-gather and the pipeline message.
"""
from __future__ import annotations

import json

import pytest

from autopar import cli
from autopar.plan import Plan

MiB = 2**20
COMMON = ["--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--global-batch", "16"]


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- plan
def test_plan_prints_a_ranked_table(capsys):
    rc, out, err = run(capsys, "plan", *COMMON, "--top", "2")
    assert rc == 0
    assert "scored" in err and "candidate plans" in err          # progress on stderr
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "plan" in line and "MFU" in line)
    for column in ("step", "mem/GPU", "tokens/s", "dominant terms"):
        assert column in lines[header]
    body = [line for line in lines[header + 2:] if line.strip()]
    assert [line.split()[0] for line in body] == ["1", "2"]
    for line in body:
        plan = Plan.parse(line.split()[1])
        assert plan.world_size == 8                              # pp * dp * cp * tp
        assert "%" in line and "GiB" in line


def test_plan_json(capsys):
    rc, out, _ = run(capsys, "plan", *COMMON, "--top", "3", "--json", "--no-progress")
    assert rc == 0
    data = json.loads(out)
    assert data["gpus"] == 8 and data["seq_len"] == 4096 and data["global_batch"] == 16
    assert data["candidates"] >= len(data["plans"]) >= 1
    steps = [p["step_time_s"] for p in data["plans"]]
    assert steps == sorted(steps)
    for i, p in enumerate(data["plans"], start=1):
        assert p["rank"] == i
        plan = Plan.parse(p["plan"])
        assert plan.world_size == 8
        assert 16 % (plan.dp * plan.mb) == 0
        assert p["tokens_per_s"] == pytest.approx(16 * 4096 / p["step_time_s"])
        assert 0 < p["mfu"] < 1
        assert p["memory_per_gpu_bytes"] <= 80 * 2**30
        assert p["dominant_terms"] and all(0 < d["share"] <= 1 for d in p["dominant_terms"])


# ---------------------------------------------------------------------- explain
def test_explain_prints_every_section(capsys):
    rc, out, _ = run(capsys, "explain", *COMMON, "--plan", "tp=2,sp,dp=4,mb=2")
    assert rc == 0
    for section in ("Collectives of one rank", "Memory per GPU", "Time per step",
                    "Pipeline bubble", "all_gather", "reduce_scatter", "optimizer"):
        assert section in out, section


def test_explain_json_with_formulas(capsys):
    plan = "tp=2,sp,pp=2,dp=2,mb=4"
    rc, out, _ = run(capsys, "explain", *COMMON, "--plan", plan, "--pp-rank", "1", "--json",
                     "--formulas")
    assert rc == 0
    data = json.loads(out)
    b, seq, h, w, tp = 16 // (2 * 4), 4096, 4096, 2, 2
    assert data["microbatch_size"] == b and data["pp_rank"] == 1
    ag = [r for r in data["comm"] if r["collective"] == "all_gather" and r["axis"] == "tp"]
    assert ag
    for r in ag:                                   # (tp - 1) shards of [b, seq/tp, h]
        assert r["bytes_sent"] == pytest.approx((tp - 1) * b * (seq // tp) * h * w)
        assert r["group_size"] == tp
    pp_recv = [r for r in data["comm"] if r["axis"] == "pp" and r["collective"] == "recv"]
    assert pp_recv                                 # the SP-sharded boundary activation
    assert all(r["bytes_recv"] == pytest.approx(b * (seq // tp) * h * w) for r in pp_recv)
    assert {"params", "grads", "optimizer", "activations"} <= set(data["memory"])
    assert all("formula" in m for m in data["memory"].values() if m["bytes"] > 0)
    assert data["time"] and all("formula" in t for t in data["time"])
    assert data["bubble"]["pp"] == 2 and data["bubble"]["seconds"] > 0
    assert 0 < data["bubble"]["fraction_of_step"] < 1


def test_explain_header_and_breakdown_give_one_memory_figure(capsys):
    """Issue 38 item 5: the header's memory/GPU is the fullest pp rank's peak, the breakdown shown is
    that rank's, its ``peak`` line repeats the header's figure and is the sum of the parts marked
    alive at the peak, and the sum of every term is labelled as a sum (it is more than the peak)."""
    argv = ["--model", "llama3-70b", "--gpus", "1024", "--seq", "8192", "--global-batch", "512",
            "--plan", "tp=8,sp,pp=4,dp=32,zero=1,mb=8"]
    rc, out, _ = run(capsys, "explain", *argv)
    assert rc == 0
    header = next(line for line in out.splitlines() if "memory/GPU" in line)
    figure = header.split("memory/GPU", 1)[1].split(":")[0].strip()          # e.g. "74.98 GiB"
    fullest = int(header.split("pp rank", 1)[1].split(",")[0])
    section = out.split("Memory per GPU, pp rank ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert int(section[0].split()[0]) == fullest and "the fullest" in section[0]
    peak_line = next(line for line in section if line.split()[:1] == ["peak"])
    assert peak_line.split()[1] + " " + peak_line.split()[2] == figure
    assert any(line.split()[:4] == ["sum", "of", "all", "terms"] and "a sum" in line for line in section)
    marked = [line for line in section[2:] if line.rstrip().endswith("*")]
    assert marked and all(line.split()[0] not in ("peak", "sum") for line in marked)

    rc, out, _ = run(capsys, "explain", *argv, "--json")
    data = json.loads(out)
    peak = data["memory_peak"]
    assert peak["pp_rank"] == data["memory_pp_rank"]
    assert peak["peak_bytes"] == pytest.approx(data["memory_per_gpu_bytes"], rel=1e-12)
    assert sum(m["at_peak_bytes"] for m in data["memory"].values()) == pytest.approx(peak["peak_bytes"], rel=1e-12)
    assert peak["sum_of_terms_bytes"] > peak["peak_bytes"]
    assert all(0 <= m["at_peak_bytes"] <= m["bytes"] * (1 + 1e-12) for m in data["memory"].values())


def test_explain_reads_a_config_json(tmp_path, capsys):
    config = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 512,
              "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1408,
              "vocab_size": 1024}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc, out, _ = run(capsys, "explain", "--model", str(path), "--gpus", "2", "--seq", "256",
                     "--global-batch", "4", "--plan", "tp=2", "--json")
    assert rc == 0
    data = json.loads(out)
    # TP without SP: all-reduce of [b, seq, h] activations, b = 4 sequences on one replica
    ar = [r for r in data["comm"] if r["collective"] == "all_reduce" and r["dimension"] == "tp"]
    assert ar
    assert all(r["bytes_sent"] == pytest.approx(2 * (2 - 1) / 2 * 4 * 256 * 512 * 2) for r in ar)


# ---------------------------------------------------------------------- explain --measure
def test_explain_measures_memory_on_local_processes(capsys):
    rc, out, _ = run(capsys, "explain", "--plan", "dp=2,zero=1", "--measure",
                     "examples/model.py:build_tiny", "--world", "2", "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["gpus"] == 2 and data["seq_len"] == 16 and data["global_batch"] == 4
    # build_tiny: vocab 128, hidden 64, 2 layers, 4 heads of 16, 2 KV heads, FFN 128, untied.
    v, h, kv, f = 128, 64, 2 * 16, 128
    layer = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h      # q, k, v, o, gate/up/down, 2 norms
    full = 4 * (v * h + 2 * layer + h + v * h)                   # fp32 bytes of every parameter
    ranks = data["measured_memory"]["ranks"]
    assert len(ranks) == 2
    for r in ranks:   # zero=1 over dp=2: full params and grads, AdamW m, v halved, no master copy
        assert (r["params"], r["grads"], r["optimizer"], r["master_params"]) == (full, full, full, 0)
        assert r["activations"] > 0
    rows = {row["category"]: row for row in data["measured_memory"]["comparison"]}
    assert set(rows) == {"params", "grads", "optimizer", "activations", "master_params"}
    for cat in ("params", "grads", "optimizer"):
        assert rows[cat]["measured"] == full and rows[cat]["predicted"] == pytest.approx(full)
    act = rows["activations"]
    assert act["measured"] == max(r["activations"] for r in ranks)
    assert act["diff"] == pytest.approx((act["measured"] - act["predicted"]) / act["predicted"])
    assert abs(act["diff"]) <= 0.10
    assert rows["master_params"]["predicted"] is None


@pytest.mark.parametrize("argv, needle", [
    (["explain", "--plan", "dp=2", "--measure", "examples/model.py:build_tiny", "--world", "4"],
     "--world 2"),
    (["explain", "--plan", "dp=2", "--measure", "examples/model.py:build_tiny", "--world", "2",
      "--seq", "16"], "drop --seq"),
    (["explain", "--plan", "dp=2", "--measure", "examples/model.py:no_such_function", "--world", "2"],
     "no function"),
    (["explain", "--plan", "dp=2", "--gpus", "2", "--seq", "16", "--global-batch", "4"],
     "needs --model"),
])
def test_explain_measure_errors(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("autopar:") and needle in err


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "llama9-1t", "--gpus", "8", "--seq", "4096", "--global-batch", "16"],
     "llama3-70b"),
    (["plan", "--model", "missing/config.json", "--gpus", "8", "--seq", "4096",
      "--global-batch", "16"], "does not exist"),
    (["plan", "--model", "llama3-8b", "--gpus", "12", "--seq", "4096", "--global-batch", "16"],
     "whole nodes of 8"),
    (["plan", "--model", "llama3-8b", "--gpu", "v100", "--gpus", "8", "--seq", "4096",
      "--global-batch", "16"], "unknown GPU"),
    (["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "0", "--global-batch", "16"],
     "--seq"),
    (["explain", *COMMON, "--plan", "tp=2,dp=2"], "uses pp*dp*cp*tp = 4 GPUs"),
    (["explain", *COMMON, "--plan", "tp=two"], "needs an integer"),
    (["explain", *COMMON, "--plan", "tp=2,dp=4", "--stage", "3"], "outside the pipeline"),
])
def test_errors_are_clear(capsys, argv, needle):
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert err.startswith("autopar:")
    assert needle in err


def test_missing_required_option_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["plan", "--gpus", "8", "--seq", "4096", "--global-batch", "16"])
    assert exc.value.code == 2
    assert "--model" in capsys.readouterr().err
