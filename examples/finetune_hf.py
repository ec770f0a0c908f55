"""Fine-tune a Hugging Face causal LM from a local directory with autopar.

    # one process (no process group), the whole model on this device:
    python examples/finetune_hf.py --model path/to/hf_dir --data train.jsonl --plan none --steps 100

    # N ranks (gloo on CPUs, NCCL on GPUs: autopar.init_distributed()):
    torchrun --nproc-per-node 8 examples/finetune_hf.py --model path/to/hf_dir --data train.jsonl \\
        --plan auto --seq 2048 --batch 64 --steps 1000 --lr 2e-5 --warmup 50 --bf16 \\
        --max-grad-norm 1.0 --eval-every 100 --save-every 200 --ckpt ckpt/run1 --out finetuned/

    # restarted after a failure, on the ranks that are left, from the newest checkpoint:
    torchrun --nnodes 1:2 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 \
        examples/finetune_hf.py --model path/to/hf_dir --data train.jsonl --plan auto --steps 1000 \
        --save-every 100 --ckpt ckpt/run1/ --resume auto --keep 3

What it does, on every rank:

1. **Model**: ``AutoConfig.from_pretrained(--model)`` and the model built from it on the meta
   device (``AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")``, fp32: no memory
   for weights), ``autopar.parallelize`` for ``--plan`` (``auto``: the cost model picks a plan for
   this world size), then ``pm.load_pretrained(--model)``: each rank reads only the slices of the
   safetensors files it keeps.  ``--from-scratch`` initialises the weights with the model's own
   ``_init_weights`` instead (``parallelize(..., init_weights=...)``).  With ``--ckpt`` pointing
   at an existing checkpoint, training resumes from it (``pm.load``: weights, optimizer, LR
   schedule and step count, written under any plan).  With ``--resume auto``, ``--ckpt`` is a
   directory of checkpoints instead: training resumes from the newest complete one
   (``autopar.latest_checkpoint``), and saves go to ``<ckpt>/step-<n>`` in the background
   (``pm.save(..., blocking=False, keep=--keep)``), so a job restarted by ``torchrun
   --max-restarts`` after a failure, on as many ranks as are left, goes on where it stopped
   (docs/fault-tolerance.md).
2. **Data** (``--data``): a ``.jsonl`` file of ``{"text": ...}`` records, or of
   ``{"prompt": ..., "completion": ...}`` records (the loss is on the completion only: the
   prompt's targets are -100), or a plain text file (documents separated by blank lines).
   Tokens come from the directory's tokenizer (``AutoTokenizer.from_pretrained(--model)``, local
   files only) when it has one; otherwise from a **byte-level fallback**: each UTF-8 byte ``b``
   of the text is the token ``b % vocab_size`` (and the config's ``eos_token_id``, if it is in
   the vocabulary, ends each document) -- enough to exercise the pipeline on a model without a
   tokenizer, meaningless for a pretrained one (a note says so).  A fraction ``--eval-frac`` of
   the records (chosen by ``--seed``) is held out for evaluation, always, whether or not
   ``--eval-every`` evaluates it: a run resumed with other flags trains on the same records
   (``--eval-frac 0`` trains on every record).
3. **Batches**: each row holds ``--seq + 1`` tokens; the input is its first ``--seq`` and the
   target its last ``--seq`` (next-token prediction).  ``--pack`` concatenates the documents
   (each ended by EOS) and cuts the stream into rows (attention crosses document boundaries,
   as in most packed pre-training); otherwise each document is one row, truncated to
   ``--seq + 1`` tokens and padded at the end with targets -100 (causal attention: padding at
   the end changes nothing before it, so no attention mask is needed).  Step ``i``'s global
   batch is a deterministic function of ``--seed`` and ``i`` (an epoch-wise shuffle), so a
   resumed run sees the batches it would have seen.  Every rank tokenises the file (fine for
   a fine-tuning set; stream from a ``DistributedBatchSampler`` for a corpus) and passes only
   its part of each batch to the step (``pm.batch_slice(...)``, ``train_step(..., local=True)``).
4. **Training**: AdamW, linear warm-up over ``--warmup`` steps then cosine decay to
   ``--min-lr-ratio`` of ``--lr`` at ``--steps`` (a ``LambdaLR`` factory), ``--max-grad-norm``
   clipping, ``--bf16`` mixed precision (bf16 compute, fp32 masters).  Every
   ``--eval-every`` steps the held-out split is evaluated with ``pm.eval_step``; every
   ``--save-every`` steps (and at the end) ``pm.save(--ckpt)``; at the end
   ``pm.export_weights(--out)`` writes a sharded Hugging Face directory (no rank gathers the
   model), with the tokenizer copied next to it, for ``from_pretrained(--out)``.

Output (rank 0), one line per step, machine-readable by its first four words::

    step 3 loss 5.412345 lr 1.000e-03 grad_norm 2.1034 tokens/s 1234.5 mem 12.3MiB peak 512.0MiB
    eval step 3 loss 5.398765 tokens 96

``mem`` is what ``pm.memory_report()`` measured on this rank in the step (parameters,
gradients, optimizer state, masters, saved activations); ``peak`` is the process's peak
resident memory on CPUs, or ``torch.cuda.max_memory_allocated`` on GPUs.  Errors in the
arguments or the data are reported as ``autopar: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import shutil
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["read_records", "load_tokenizer", "ByteTokenizer", "encode_records", "build_rows",
           "split_records", "batch_rows", "lr_factor", "main"]

IGNORE = -100  # targets the loss skips (F.cross_entropy's default ignore_index)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class UsageError(Exception):
    """A problem with the arguments or the data; main() prints it and exits with status 2."""


# --- data ------------------------------------------------------------------------------------

def read_records(path: str) -> list[dict]:
    """``path`` -> records ``{"text": str}`` or ``{"prompt": str, "completion": str}``.

    JSONL (a ``.jsonl``/``.json`` name, or a first non-empty line starting with ``{``): one JSON
    object per line with a ``text`` field or ``prompt`` and ``completion`` fields.  Anything else is
    plain text, one document per block of lines separated by blank lines."""
    if not os.path.isfile(path):
        raise UsageError(f"autopar: --data {path}: no such file; expected a .jsonl or text file.")
    with open(path, encoding="utf-8") as f:
        content = f.read()
    first = next((line for line in content.splitlines() if line.strip()), "")
    if not (path.endswith((".jsonl", ".json")) or first.lstrip().startswith("{")):
        docs = [block.strip() for block in content.replace("\r\n", "\n").split("\n\n")]
        return [{"text": d} for d in docs if d]
    records = []
    for number, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"autopar: --data {path} line {number} is not JSON ({exc.msg}); "
                             "expected one object per line.") from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            records.append({"text": obj["text"]})
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("completion"), str):
            records.append({"prompt": obj["prompt"], "completion": obj["completion"]})
        else:
            raise UsageError(f"autopar: --data {path} line {number} has neither a string 'text' field nor "
                             "string 'prompt' and 'completion' fields.")
    if not records:
        raise UsageError(f"autopar: --data {path} holds no records.")
    return records


class ByteTokenizer:
    """The fallback for a model directory without a tokenizer: UTF-8 byte ``b`` -> token ``b % vocab_size``.

    No BOS; documents end with ``eos_token_id`` when the config has one inside the vocabulary.
    Padding uses token 0 (its targets are -100, and padding sits after the text, so its value
    does not matter)."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id if eos_token_id is not None and 0 <= eos_token_id < vocab_size else None
        self.pad_token_id = 0
        self.bos_token_id = None

    def encode(self, text: str, first: bool = True) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


class HFTokenizer:
    """A transformers tokenizer behind the same two-method interface as :class:`ByteTokenizer`."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.eos_token_id if self.eos_token_id is not None else 0)

    def encode(self, text: str, first: bool = True) -> list[int]:
        """``first``: the start of a document (special tokens such as BOS added), else a continuation."""
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])


def _eos_of(config) -> int | None:
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def load_tokenizer(model_dir: str, config, announce=print):
    """The directory's tokenizer if it has one (local files only), else :class:`ByteTokenizer`."""
    vocab = config.vocab_size
    if any(os.path.exists(os.path.join(model_dir, name)) for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:  # a broken or unsupported tokenizer: say so, do not guess
            raise UsageError(f"autopar: the tokenizer in {model_dir} does not load ({type(exc).__name__}: {exc}); "
                             "fix it or remove its files to use the byte-level fallback.") from None
        if len(tok) > vocab:
            raise UsageError(f"autopar: the tokenizer in {model_dir} has {len(tok)} tokens but the model's "
                             f"vocab_size is {vocab}; they must match.")
        return HFTokenizer(tok, vocab)
    announce(f"note: {model_dir} has no tokenizer ({', '.join(TOKENIZER_FILES)}); using the byte-level "
             f"fallback: token = UTF-8 byte % {vocab}. Fine for smoke tests, meaningless for a pretrained model.")
    return ByteTokenizer(vocab, _eos_of(config))


def encode_records(records: list[dict], tokenizer) -> list[tuple[list[int], list[int]]]:
    """Each record -> ``(ids, labels)``: ``labels[t]`` is ``ids[t]``, or -100 where no loss is wanted
    (prompt tokens).  Each document ends with EOS when the tokenizer has one."""
    eos = tokenizer.eos_token_id
    out = []
    for record in records:
        if "text" in record:
            ids = tokenizer.encode(record["text"], first=True)
            labels = list(ids)
        else:
            prompt = tokenizer.encode(record["prompt"], first=True)
            completion = tokenizer.encode(record["completion"], first=False)
            ids = prompt + completion
            labels = [IGNORE] * len(prompt) + completion
        if eos is not None:
            ids, labels = ids + [eos], labels + [eos]
        out.append((ids, labels))
    return out


def build_rows(examples: list[tuple[list[int], list[int]]], seq: int, pack: bool,
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs [N, seq], targets [N, seq])``: row ``r``'s target at ``t`` is the label of token ``t+1``.

    ``pack``: the examples concatenated and cut into rows of ``seq + 1`` tokens (the remainder
    dropped).  Otherwise one row per example, truncated to ``seq + 1`` tokens and padded (inputs
    with ``pad_id``, targets with -100).  Rows without a single target to learn are dropped."""
    width = seq + 1
    rows_ids, rows_labels = [], []
    if pack:
        stream_ids = [t for ids, _ in examples for t in ids]
        stream_labels = [t for _, labels in examples for t in labels]
        for start in range(0, len(stream_ids) - width + 1, width):
            rows_ids.append(stream_ids[start:start + width])
            rows_labels.append(stream_labels[start:start + width])
    else:
        for ids, labels in examples:
            ids, labels = ids[:width], labels[:width]
            missing = width - len(ids)
            rows_ids.append(ids + [pad_id] * missing)
            rows_labels.append(labels + [IGNORE] * missing)
    if not rows_ids:
        return torch.empty(0, seq, dtype=torch.long), torch.empty(0, seq, dtype=torch.long)
    ids = torch.tensor(rows_ids, dtype=torch.long)
    labels = torch.tensor(rows_labels, dtype=torch.long)
    inputs, targets = ids[:, :-1], labels[:, 1:]
    keep = (targets != IGNORE).any(dim=1)
    return inputs[keep].contiguous(), targets[keep].contiguous()


def split_records(records: list, eval_frac: float, seed: int) -> tuple[list, list]:
    """``(train, held_out)``: ``round(eval_frac * n)`` records (at least one when ``eval_frac > 0``),
    chosen by a shuffle from ``seed``, the same on every rank."""
    if eval_frac <= 0:
        return list(records), []
    n = len(records)
    held = max(1, round(eval_frac * n))
    if held >= n:
        raise UsageError(f"autopar: --eval-frac {eval_frac} leaves no training records of {n}.")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = set(order[:held])
    return ([r for i, r in enumerate(records) if i not in held_out],
            [r for i, r in enumerate(records) if i in held_out])


def batch_rows(num_rows: int, batch: int, step: int, seed: int) -> list[int]:
    """The row indices of global batch ``step`` (0-based): consecutive rows of an endless stream of
    epochs, each epoch a permutation from ``seed + epoch``.  A function of the step alone, so a
    resumed run continues exactly."""
    out: list[int] = []
    position = step * batch
    while len(out) < batch:
        epoch, offset = divmod(position, num_rows)
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        take = min(num_rows - offset, batch - len(out))
        out.extend(order[offset:offset + take].tolist())
        position += take
    return out


# --- schedule and reporting ------------------------------------------------------------------

def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux: KiB


def _held_mib(pm, mixed_precision: bool) -> float:
    report = pm.memory_report()
    total = sum(report.get(k, 0) for k in ("params", "grads", "optimizer", "activations"))
    if not mixed_precision:  # under mixed precision the masters are counted in "optimizer" already
        total += report.get("master_params", 0)
    return total / 2**20


def _loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    # The plain mean cross-entropy: autopar proves it from the graph and weighs each rank's piece
    # of the batch by its share of the non-ignored targets (docs/troubleshooting.md, "Padded batches").
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


@dataclass
class _Run:
    rank: int
    world: int

    def say(self, *parts) -> None:
        if self.rank == 0:
            print(*parts, flush=True)


# --- main ------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="local Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--data", required=True, help="a .jsonl file (text, or prompt/completion) or a plain text file")
    p.add_argument("--plan", default="auto", help="autopar plan, e.g. 'tp=2,sp,dp=2', 'dp=2,zero=3', 'auto', 'none'")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (input length)")
    p.add_argument("--batch", type=int, default=8, help="global batch size in rows")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--lr", type=float, default=2e-5, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0, help="linear warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at this fraction of --lr")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 masters, gradients and loss)")
    p.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm")
    p.add_argument("--pack", action="store_true", help="pack documents into full rows (else pad each document)")
    p.add_argument("--eval-frac", type=float, default=0.1, help="fraction of the records held out for evaluation")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate the held-out split every N steps (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="at most this many held-out batches per evaluation")
    p.add_argument("--save-every", type=int, default=0, help="pm.save(--ckpt) every N steps (and at the end)")
    p.add_argument("--ckpt", default=None, help="checkpoint path: resumed from when it exists, written by --save-every "
                   "(with --resume auto: a directory of checkpoints)")
    p.add_argument("--resume", choices=("auto",), default=None,
                   help="auto: resume from the newest complete checkpoint in the --ckpt directory, save there "
                        "in the background as step-<n>")
    p.add_argument("--keep", type=int, default=2, help="with --resume auto: checkpoints kept")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds a collective waits for a dead or stuck peer (default: autopar's, 10 min)")
    p.add_argument("--out", default=None, help="export the trained weights here as a Hugging Face directory")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard of --out")
    p.add_argument("--from-scratch", action="store_true",
                   help="initialise the weights with the model's _init_weights instead of loading --model's")
    p.add_argument("--seed", type=int, default=0, help="data split, order and dropout seed")
    return p


def _check_args(args) -> None:
    for name in ("seq", "batch"):
        if getattr(args, name) < 1:
            raise UsageError(f"autopar: --{name} {getattr(args, name)}; expected a positive number.")
    if args.steps < 0:
        raise UsageError(f"autopar: --steps {args.steps}; expected 0 or more.")
    if args.save_every and not args.ckpt:
        raise UsageError("autopar: --save-every needs --ckpt PATH to save to.")
    if args.resume and not args.ckpt:
        raise UsageError("autopar: --resume auto needs --ckpt DIR, the directory of checkpoints.")
    if args.keep < 1:
        raise UsageError(f"autopar: --keep {args.keep}; expected 1 or more checkpoints to keep.")
    if not 0 <= args.eval_frac < 1:
        raise UsageError(f"autopar: --eval-frac {args.eval_frac}; expected a fraction in [0, 1).")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"autopar: --model {args.model} has no config.json; expected a local Hugging Face "
                         "model directory (as written by save_pretrained).")


def _init_process_group(timeout: float | None) -> _Run:
    """torchrun sets WORLD_SIZE: then NCCL on GPUs, gloo on CPUs; else one process, no process group."""
    import autopar
    import torch.distributed as dist

    if "WORLD_SIZE" in os.environ:
        autopar.init_distributed(timeout=timeout)
    if dist.is_initialized():
        return _Run(dist.get_rank(), dist.get_world_size())
    return _Run(0, 1)


def _check_plan(text: str, world: int) -> None:
    """A plan's syntax and degrees against this job's world size (``autopar:`` errors), before any data is
    read: the model's own checks (heads, vocabulary) come with ``parallelize``."""
    from autopar.plan import Plan

    if text.strip().lower() != "auto":
        Plan.parse(text).validate(world_size=world)


def _build_model(args):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.model, local_files_only=True)
    with torch.device("meta"):  # no memory for the weights: each rank gets its slices below
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return config, model


def _load_data(args, tokenizer, run):
    """(training ids, training targets, the fixed held-out batches)."""
    records = read_records(args.data)
    # Held out whatever --eval-every says, so that a run resumed with other flags never trains on them.
    train_records, eval_records = split_records(records, args.eval_frac, args.seed)
    train_ids, train_targets = build_rows(encode_records(train_records, tokenizer), args.seq, args.pack,
                                          tokenizer.pad_token_id)
    if len(train_ids) == 0:
        raise UsageError(f"autopar: --data {args.data} gives no training rows of {args.seq + 1} tokens"
                         + (" (--pack needs at least that many tokens in all)" if args.pack else "") + ".")
    eval_batches = []
    if eval_records and args.eval_every:
        eval_ids, eval_targets = build_rows(encode_records(eval_records, tokenizer), args.seq, args.pack,
                                            tokenizer.pad_token_id)
        if len(eval_ids) == 0:
            raise UsageError("autopar: the held-out records give no rows; raise --eval-frac or lower --seq.")
        count = min(args.eval_batches, max(1, math.ceil(len(eval_ids) / args.batch)))
        for b in range(count):  # fixed batches; a short split is repeated to fill them
            rows = [(b * args.batch + i) % len(eval_ids) for i in range(args.batch)]
            eval_batches.append((eval_ids[rows], eval_targets[rows]))
    run.say(f"data: {len(train_records)} training records -> {len(train_ids)} rows of {args.seq} tokens "
            f"({'packed' if args.pack else 'padded'}); {len(eval_records)} held-out records")
    return train_ids, train_targets, eval_batches


def _parallelize(args, model, example, run):
    import autopar

    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=functools.partial(
        lr_factor, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio))
    pm = autopar.parallelize(
        model,
        example_inputs=(example,),
        example_kwargs={"use_cache": False},
        plan=args.plan,
        loss_fn=_loss_fn,
        optimizer=functools.partial(torch.optim.AdamW, lr=args.lr, weight_decay=args.weight_decay),
        mixed_precision="bf16" if args.bf16 else None,
        max_grad_norm=args.max_grad_norm,
        lr_scheduler=schedule,
        init_weights=model._init_weights if args.from_scratch else None,
    )
    run.say(f"plan: {pm.plan} on {run.world} rank(s), device {pm.device}")
    return pm


def _resume_from(args) -> str | None:
    """The checkpoint to resume from: the newest in the --ckpt directory (--resume auto), or --ckpt."""
    import autopar

    if args.resume == "auto":
        return autopar.latest_checkpoint(args.ckpt)
    return args.ckpt if args.ckpt and os.path.lexists(args.ckpt) else None


def _save(args, pm, step: int) -> str:
    """Save step ``step``: in the background into the --ckpt directory (--resume auto), else to --ckpt."""
    if args.resume == "auto":
        path = os.path.join(args.ckpt, f"step-{step:08d}")
        pm.save(path, blocking=False, keep=args.keep)
        return path
    pm.save(args.ckpt)
    return args.ckpt


def _restore(args, pm, run) -> int:
    """Resume from a checkpoint, or load the pretrained weights; the step to start at."""
    start = 0
    checkpoint = _resume_from(args)
    if checkpoint:
        pm.load(checkpoint)  # weights, optimizer, schedule and step, saved under any plan
        start = pm.num_steps_taken
        # The checkpoint's next rate followed the saved run's --steps; a run resumed with a longer
        # --steps continues on its own cosine (the same rate when --steps is unchanged).
        for group, base in zip(pm.optimizer.param_groups, pm.lr_scheduler.base_lrs):
            group["lr"] = base * lr_factor(start, warmup=args.warmup, total=args.steps, min_ratio=args.min_lr_ratio)
        run.say(f"resumed from {checkpoint} at step {start}")
    elif not args.from_scratch:
        pm.load_pretrained(args.model)
        run.say(f"loaded {args.model}")
    return start


def _train_loop(args, pm, run, start, train_ids, train_targets, eval_batches) -> None:
    slc = pm.batch_slice(args.batch, seq_len=args.seq)  # this rank's rows (and cp positions)
    mine = list(slc.rows)

    def local_part(ids: torch.Tensor, targets: torch.Tensor):
        ids, targets = ids[mine], targets[mine]
        return slc.take_positions(ids).to(pm.device), slc.take_positions(targets).to(pm.device)

    def evaluate(step: int) -> None:
        total = count = 0.0
        for ids, targets in eval_batches:
            valid = int((targets != IGNORE).sum())
            ids, targets = local_part(ids, targets)
            loss = pm.eval_step((ids,), targets, local=True)
            total += loss * valid
            count += valid
        run.say(f"eval step {step} loss {total / count:.6f} tokens {int(count)}")

    saved_at = start
    if eval_batches and start == 0:
        evaluate(0)  # the loaded model, before any update
    for step in range(start, args.steps):
        rows = batch_rows(len(train_ids), args.batch, step, args.seed)
        ids, targets = local_part(train_ids[rows], train_targets[rows])
        lr = pm.optimizer.param_groups[0]["lr"]
        loss = pm.train_step((ids,), targets, local=True)
        n = step + 1
        stats = pm.last_step_stats
        norm = "-" if pm.last_grad_norm is None else f"{pm.last_grad_norm:.4f}"
        run.say(f"step {n} loss {loss:.6f} lr {lr:.3e} grad_norm {norm} "
                f"tokens/s {stats.get('tokens_per_s', float('nan')):.1f} "
                f"mem {_held_mib(pm, args.bf16):.1f}MiB peak {_peak_mib(pm.device):.1f}MiB")
        if eval_batches and n % args.eval_every == 0:
            evaluate(n)
        if args.save_every and n % args.save_every == 0:
            saved_at = n
            run.say(f"saved {_save(args, pm, n)} at step {n}")
    if args.ckpt and saved_at < max(start, args.steps):
        run.say(f"saved {_save(args, pm, args.steps)} at step {args.steps}")
    pm.wait_checkpoint()  # a background save is complete (and switched in) before the run ends


def _export(args, pm, run, tokenizer) -> None:
    pm.export_weights(args.out, max_shard_size=args.max_shard_size)
    if run.rank == 0:
        if isinstance(tokenizer, HFTokenizer):
            tokenizer.tokenizer.save_pretrained(args.out)
        generation = os.path.join(args.model, "generation_config.json")
        if os.path.isfile(generation):
            shutil.copy(generation, os.path.join(args.out, "generation_config.json"))
    run.say(f"exported {args.out}")


def train(args) -> int:
    run = _init_process_group(args.timeout)
    torch.manual_seed(args.seed)  # every rank alike (dropout streams derive from it)
    _check_plan(args.plan, run.world)  # before the data is read and tokenised
    config, model = _build_model(args)
    tokenizer = load_tokenizer(args.model, config, announce=run.say)
    train_ids, train_targets, eval_batches = _load_data(args, tokenizer, run)
    example = train_ids[batch_rows(len(train_ids), args.batch, 0, args.seed)]
    pm = _parallelize(args, model, example, run)
    start = _restore(args, pm, run)
    _train_loop(args, pm, run, start, train_ids, train_targets, eval_batches)
    if args.out:
        _export(args, pm, run, tokenizer)

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from autopar.errors import AutoparError

    try:
        _check_args(args)
        return train(args)
    except (UsageError, AutoparError) as exc:  # both say "autopar: what, and what to do"
        from autopar.error_report import report_error

        return report_error(exc)  # one line, once per torchrun job


if __name__ == "__main__":
    sys.exit(main())
