"""examples/finetune_hf.py on a tiny Llama saved as a sharded Hugging Face directory, on the CPU.

One fixture writes the model (several safetensors shards), a copy of it with a WordLevel tokenizer,
and a small prompt/completion JSONL; then four runs of the script:

* ``tp=2,sp`` on 2 ranks: load_pretrained, steps 1-2, checkpoint;
* ``dp=2,zero=3`` on 2 ranks: resumes that checkpoint (another plan), steps 3-4, exports;
* ``--plan none`` in one process: steps 1-4 from the same directory, exports;
* ``--resume auto`` (a directory of checkpoints, saved in the background, the newest kept): 2 ranks
  under ``dp=2`` for steps 1-2, then one process for steps 3-4, resumed from the newest;
* ``dp=2,zero=3`` on 2 ranks with 0 steps on the directory without a tokenizer (byte-level
  fallback, packed rows): load_pretrained then export_weights at once.

The 2-rank losses (train and eval) equal the one-process losses (fp32, 1e-5); the exports load with
``from_pretrained`` and hold the same weights; loading then exporting gives back the original
tensors bit for bit.  The data helpers of the script are checked in-process.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "finetune_hf.py"
VOCAB = 256
WORDS = ("the cat dog sat ran on a mat log red blue big small fast slow and then it was very "
         "happy sad here there over under jumped slept saw one two three").split()


def _script_module():
    spec = importlib.util.spec_from_file_location("finetune_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("finetune_hf", module)  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        pick = lambda k: " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (k,), generator=g))  # noqa: E731
        out.append({"prompt": pick(int(torch.randint(2, 6, (1,), generator=g))),
                    "completion": " " + pick(int(torch.randint(3, 14, (1,), generator=g)))})
    return out


def _save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<s>", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("finetune")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=2, eos_token_id=3, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    plain = root / "hf"                       # weights only: the byte-level fallback
    model.save_pretrained(plain, max_shard_size="100KB")
    assert len(list(plain.glob("*.safetensors"))) >= 3 and (plain / "model.safetensors.index.json").exists()
    with_tokenizer = root / "hf_tok"          # the same weights and a WordLevel tokenizer
    shutil.copytree(plain, with_tokenizer)
    _save_tokenizer(with_tokenizer)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(40)))
    text = root / "train.txt"
    text.write_text("\n\n".join(" ".join(r.values()) for r in _records(12)))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"root": root, "plain": plain, "tok": with_tokenizer, "data": data, "text": text, "state": state}


def _run(args: list[str], ranks: int = 1) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(_free_port())]
    out = subprocess.run(cmd + [str(SCRIPT)] + args, cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def _losses(stdout: str, kind: str = "step") -> dict[int, float]:
    pattern = r"^step (\d+) loss (\S+)" if kind == "step" else r"^eval step (\d+) loss (\S+)"
    return {int(n): float(v) for n, v in re.findall(pattern, stdout, re.M)}


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


COMMON = ["--seq", "16", "--batch", "4", "--lr", "1e-3", "--warmup", "1", "--max-grad-norm", "1.0",
          "--eval-every", "2", "--eval-frac", "0.2", "--eval-batches", "1", "--max-shard-size", "100KB"]


@pytest.fixture(scope="module")
def single(setup):
    """One process, steps 1-4 from the directory with a tokenizer, exported: the reference run."""
    common = COMMON + ["--model", str(setup["tok"]), "--data", str(setup["data"])]
    return _run(common + ["--plan", "none", "--steps", "4", "--out", str(setup["root"] / "out_single")])


def test_finetune_under_two_plans_resumed_equals_one_process(setup, single):
    from transformers import AutoModelForCausalLM

    root, common = setup["root"], COMMON + ["--model", str(setup["tok"]), "--data", str(setup["data"])]
    ckpt, out_parallel, out_single = root / "ckpt", root / "out_parallel", root / "out_single"
    first = _run(common + ["--plan", "tp=2,sp", "--steps", "2", "--ckpt", str(ckpt), "--save-every", "2"], ranks=2)
    second = _run(common + ["--plan", "dp=2,zero=3", "--steps", "4", "--ckpt", str(ckpt),
                            "--out", str(out_parallel)], ranks=2)
    assert "resumed from" in second and "byte-level" not in single

    parallel = {**_losses(first), **_losses(second)}
    reference = _losses(single)
    assert sorted(reference) == sorted(parallel) == [1, 2, 3, 4], (first, second, single)
    assert all(abs(parallel[k] - reference[k]) <= 1e-5 for k in reference), (parallel, reference)
    evals = {**_losses(first, "eval"), **_losses(second, "eval")}
    assert sorted(evals) == sorted(_losses(single, "eval")) == [0, 2, 4]
    assert all(abs(evals[k] - v) <= 1e-5 for k, v in _losses(single, "eval").items()), (evals, single)
    assert reference[4] < reference[1]  # it learns

    a, b = _tensors(out_parallel), _tensors(out_single)
    assert sorted(a) == sorted(b) == sorted(setup["state"])
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-4, worst
    assert any(not torch.equal(a[k], setup["state"][k]) for k in a)  # trained
    assert (out_parallel / "model.safetensors.index.json").exists()
    assert (out_parallel / "config.json").exists() and (out_parallel / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out_parallel)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, a[k]), k


def test_resume_auto_goes_on_from_the_newest_checkpoint(setup, single):
    """``--resume auto``: background saves into a directory, keeping one; a second run (another plan,
    one process) resumes from the newest, and the four losses are the uninterrupted run's."""
    common = COMMON + ["--model", str(setup["tok"]), "--data", str(setup["data"])]
    ckpt = setup["root"] / "ckpts"
    # (--steps 2 then 4, as above: the cosine's rates of steps 1-2 do not depend on --steps)
    first = _run(common + ["--plan", "dp=2", "--steps", "2", "--ckpt", str(ckpt), "--resume", "auto",
                           "--save-every", "1", "--keep", "1"], ranks=2)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_symlink()) == ["step-00000002"]  # keep 1
    second = _run(common + ["--plan", "none", "--steps", "4", "--ckpt", str(ckpt), "--resume", "auto",
                            "--save-every", "1"])
    assert f"resumed from {ckpt / 'step-00000002'} at step 2" in second
    losses, reference = {**_losses(first), **_losses(second)}, _losses(single)
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(abs(losses[k] - reference[k]) <= 1e-5 for k in reference), (losses, reference)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_symlink()) == ["step-00000003", "step-00000004"]  # keep 2


def test_load_then_export_is_exact(setup):
    from transformers import AutoModelForCausalLM

    out = setup["root"] / "out_exact"
    stdout = _run(["--model", str(setup["plain"]), "--data", str(setup["text"]), "--plan", "dp=2,zero=3",
                   "--seq", "16", "--batch", "4", "--pack", "--steps", "0", "--out", str(out),
                   "--max-shard-size", "100KB"], ranks=2)
    assert "byte-level fallback" in stdout and not _losses(stdout)
    assert len(list(out.glob("*.safetensors"))) >= 3
    exported = _tensors(out)
    assert sorted(exported) == sorted(setup["state"])
    for k, v in setup["state"].items():
        assert exported[k].dtype == v.dtype and torch.equal(exported[k], v), k
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, setup["state"][k]), k


def test_data_helpers(tmp_path):
    m = _script_module()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text('{"text": "ab"}\n\n{"prompt": "x", "completion": "yz"}\n')
    records = m.read_records(str(jsonl))
    assert records == [{"text": "ab"}, {"prompt": "x", "completion": "yz"}]
    text = tmp_path / "d.txt"
    text.write_text("first doc\nstill first\n\n\nsecond\n")
    assert m.read_records(str(text)) == [{"text": "first doc\nstill first"}, {"text": "second"}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": 1}\n')
    with pytest.raises(m.UsageError, match="^autopar: "):
        m.read_records(str(bad))

    tok = m.ByteTokenizer(vocab_size=100, eos_token_id=99)
    assert tok.encode("a\xff") == [ord("a") % 100] + [b % 100 for b in "\xff".encode()]
    examples = m.encode_records(records, tok)
    assert examples[0] == ([97, 98, 99], [97, 98, 99])
    assert examples[1] == ([20, 21, 22, 99], [-100, 21, 22, 99])  # the prompt's token is not learned

    ids, targets = m.build_rows(examples, seq=3, pack=False, pad_id=0)  # one row per document, padded
    assert ids.tolist() == [[97, 98, 99], [20, 21, 22]]
    assert targets.tolist() == [[98, 99, -100], [21, 22, 99]]
    ids, targets = m.build_rows(examples, seq=2, pack=True, pad_id=0)  # 7 tokens -> 2 rows of 3
    assert ids.tolist() == [[97, 98], [20, 21]] and targets.tolist() == [[98, 99], [21, 22]]
    ids, _ = m.build_rows([([5, 6], [-100, -100])], seq=4, pack=False, pad_id=0)
    assert len(ids) == 0  # nothing to learn in that row

    first = [m.batch_rows(5, 3, step, seed=7) for step in range(4)]
    assert first == [m.batch_rows(5, 3, step, seed=7) for step in range(4)]  # a function of the step
    stream = sum(first, [])
    assert sorted(stream[:5]) == sorted(stream[5:10]) == list(range(5))  # each epoch a permutation
    assert m.lr_factor(0, warmup=2, total=10, min_ratio=0.1) == 0.5
    assert abs(m.lr_factor(10, warmup=2, total=10, min_ratio=0.1) - 0.1) < 1e-12
