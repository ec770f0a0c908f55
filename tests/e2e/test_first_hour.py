"""The first hour's frictions, shown gone: a bad plan under torchrun is one ``autopar:`` line (the root
cause torchrun's summary names), before any data is read; finetune_hf.py's held-out split does not depend
on ``--eval-every``; train_llama.py's default data is learnable (its loss falls).

The CLI's own frictions (``--version``, help texts, ``inspect``'s ``--world``) are argparse-level:
tests/unit/test_cli_first_hour.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"autopar_examples_{name}", REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _torchrun(port: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_bad_plan_under_torchrun_is_one_line():
    out = _torchrun(29581, str(REPO / "examples" / "train_llama.py"), "--plan", "tp=4", "--steps", "1")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    lines = [line for line in text.splitlines() if "autopar:" in line]
    assert len(lines) == 1, text[-4000:]
    assert "tp=4" in lines[0] and "world size is 2" in lines[0]
    root = text[text.index("Root Cause"):]  # torchrun's summary names it as the root cause
    assert "autopar:" in root
    assert "AutoparError" not in text and "train_llama.py\", line" not in text  # no rank's traceback


def test_finetune_checks_the_plan_before_reading_data(tmp_path, capsys):
    """The plan is refused before the data is read (here: the data file does not even exist)."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    finetune = _script("finetune_hf")
    rc = finetune.main(["--model", str(tmp_path), "--data", str(tmp_path / "missing.jsonl"), "--plan", "tp=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("autopar: plan 'tp=2'"), err


def test_finetune_holds_out_the_same_records_whatever_eval_every(tmp_path):
    finetune = _script("finetune_hf")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * (3 + i % 5)}) + "\n" for i in range(40)))
    tokenizer = finetune.ByteTokenizer(256, eos_token_id=3)
    run = finetune._Run(0, 1)

    def loaded(eval_every: int):
        args = argparse.Namespace(data=str(data), eval_frac=0.25, eval_every=eval_every, eval_batches=2,
                                  seq=8, batch=4, pack=True, seed=7)
        return finetune._load_data(args, tokenizer, run)

    with_eval, resumed_without = loaded(5), loaded(0)
    assert with_eval[0].equal(resumed_without[0]) and with_eval[1].equal(resumed_without[1])
    assert with_eval[2] and not resumed_without[2]  # evaluated only when asked; held out either way
    train, held = finetune.split_records(finetune.read_records(str(data)), 0.25, 7)
    assert len(held) == 10 and not {r["text"] for r in train} & {r["text"] for r in held}


def test_train_llama_learns_by_default(capsys):
    script = _script("train_llama")
    assert script.main(["--plan", "none", "--steps", "5"]) == 0
    losses = [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+)$", capsys.readouterr().out, re.M)]
    assert len(losses) == 5 and losses[-1] < losses[0] - 0.2, losses
