"""The model ``autopar verify`` trains, and what both sides of the comparison share.

:func:`resolve_source` turns ``--model`` into a :class:`ModelSource`: a cost-model preset
(``llama3-70b``, see ``autopar.cost`` ``PRESETS``), a transformers model type (``qwen2``:
its default config), a ``config.json`` path (or a directory holding one) or
``MODULE:FUNCTION`` (loaded as ``autopar inspect`` loads it, :mod:`autopar.frontend.target`).
Configs are checked against the plan as they are, then shrunk (:mod:`autopar.verification.shrink`).
A source is picklable: the parent process and every rank (:mod:`autopar.verification.worker`)
call :meth:`ModelSource.build` to get the same model.

The rest is shared by the single-process reference (:mod:`autopar.verification.api`) and the
ranks: :func:`batch_shape`, :func:`make_batches`, :func:`seeded_steps`, :func:`next_token_loss` and :data:`OPTIMIZERS`
(the bounds and the comparison are :mod:`autopar.verification.compare`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import os

import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.frontend.target import load_function, split_target
from autopar.plan import Plan
from autopar.plan_space import batch_ok, cp_seq_ok, sp_seq_ok
from autopar.verification.shrink import KEYS, preset_config, shrink_config
from autopar.verification.shrink_fields import text_model

__all__ = ["ModelSource", "resolve_source", "batch_shape", "make_batches", "next_token_loss", "seeded_steps",
           "OPTIMIZERS", "SGD_LR", "vocab_size"]

SGD_LR = 0.1
OPTIMIZERS = {
    # Plain SGD: the update is -lr * gradient, so the gradient of step 1 is read off the
    # parameters, and a gradient off by a factor shows.  AdamW: sharded state (ZeRO), weight decay.
    "sgd": functools.partial(torch.optim.SGD, lr=SGD_LR),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1),
}


@dataclasses.dataclass
class ModelSource:
    """Where the verified model comes from: a (shrunk) transformers config or ``MODULE:FUNCTION``."""

    name: str                      # what the user gave as --model
    config: dict | None = None     # the transformers config to build (already shrunk)
    function: str | None = None    # MODULE:FUNCTION, a file path made absolute
    notes: list[str] = dataclasses.field(default_factory=list)

    def build(self, seed: int) -> tuple[nn.Module, dict]:
        """A fresh model (weights from ``seed``) and the keyword arguments its forward needs."""
        torch.manual_seed(seed)
        if self.config is not None:
            return _build_hf(self.config), {"use_cache": False}
        func = load_function(self.function)
        model, _, kwargs = split_target(func(), self.function.rsplit(":", 1)[1], allow_module=True)
        if not isinstance(model, nn.Module):
            raise AutoparError(f"autopar: {self.function}() returned a {type(model).__name__}; expected an "
                               "nn.Module (or (model, example_inputs[, example_kwargs])).")
        for module in model.modules():  # verify compares exact numerics: no random masks
            if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                module.p = 0.0
        return model, kwargs


def _build_hf(config: dict) -> nn.Module:
    import transformers

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if "auto_map" in cfg:
        raise AutoparError("autopar: this config names custom model code (auto_map, trust_remote_code); verify "
                           "builds transformers' own architectures only. Write a MODULE:FUNCTION that builds the "
                           "model and pass that to --model.")
    if model_type not in transformers.CONFIG_MAPPING:
        raise AutoparError(f"autopar: transformers {transformers.__version__} does not know model_type "
                           f"{model_type!r}; upgrade transformers or pass a MODULE:FUNCTION.")
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    except Exception as exc:  # noqa: BLE001 - its validators raise their own classes (StrictDataclass...)
        raise AutoparError(f"autopar: transformers refused the shrunk {model_type} config "
                           f"({type(exc).__name__}: {_one_line(exc)}); expected a config its validators accept: "
                           "write a small config.json yourself or pass a MODULE:FUNCTION.") from None
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - any failure of the shrunk config is reported the same way
        raise AutoparError(f"autopar: transformers could not build a causal LM from the shrunk {model_type} "
                           f"config ({type(exc).__name__}: {_one_line(exc)}); write a small config.json yourself "
                           "or pass a MODULE:FUNCTION.") from None
    model.float()
    model.train()
    return model


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def vocab_size(model: nn.Module) -> int:
    """The model's vocabulary: ``config.vocab_size``, else the rows of its first embedding."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int):
        return vocab
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise AutoparError("autopar: verify trains next-token prediction on random token ids, but the model has "
                       "no config.vocab_size and no nn.Embedding; give it a vocab_size in model.config.")


def _read_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise AutoparError(f"autopar: could not read a model config from {path!r} ({exc}); expected a "
                           "transformers config.json.") from None


def _named_config(name: str) -> tuple[dict, list[str]]:
    """A preset's config, or transformers' default config for a model type."""
    from autopar.cost.spec import PRESETS  # here: the ranks unpickle this module and need no cost model

    key = name.lower().replace("_", "-")
    if key in PRESETS:
        spec = PRESETS[key]
        notes = []
        if spec.is_moe and (spec.moe_layer_freq > 1 or spec.first_dense_layers or spec.num_shared_experts):
            notes.append(f"preset {spec.name} built as Mixtral: every layer is a mixture-of-experts layer, "
                         "without shared experts")
        return preset_config(spec), notes
    try:
        import transformers

        return transformers.AutoConfig.for_model(name).to_dict(), [f"transformers' default {name} config"]
    except (ImportError, ValueError, KeyError):
        pass
    raise AutoparError(f"autopar: --model {name!r} is not a preset ({', '.join(sorted(PRESETS))}), a transformers "
                       "model type, a config.json path, or MODULE:FUNCTION; give one of those "
                       "(e.g. --model llama3-8b or --model path/to/config.json).")


def _is_function(model: str) -> bool:
    head, sep, tail = model.rpartition(":")
    return bool(sep) and bool(head) and tail.isidentifier() and not os.path.exists(model)


def resolve_source(model: str, plan: Plan, layers: int | None, seq_len: int) -> ModelSource:
    """The model behind ``--model``, checked against ``plan`` and shrunk (configs only)."""
    model = os.fspath(model)
    if _is_function(model):
        module, func = model.rsplit(":", 1)
        if module.endswith(".py") or os.path.sep in module:
            module = os.path.abspath(module)
        notes = ["MODULE:FUNCTION model used as built (not shrunk)"]
        if layers is not None:
            notes.append("--layers ignored for a MODULE:FUNCTION model")
        return ModelSource(name=model, function=f"{module}:{func}", notes=notes)
    if model.endswith(".json") or os.path.exists(model):
        cfg, notes = _read_config(model), []
    else:
        cfg, notes = _named_config(model)
    _check_original(cfg, plan, layers)
    shrunk, changes = shrink_config(cfg, plan, layers, seq_len)
    return ModelSource(name=model, config=shrunk, notes=notes + changes)


def _check_original(cfg: dict, plan: Plan, layers: int | None) -> None:
    """Refuse a plan that the full-size model would refuse (shrinking must not hide it); a
    multimodal config's language model is what is checked (and verified)."""
    cfg = text_model(cfg)[0]

    def get(field, default=None):
        return next((cfg[k] for k in KEYS[field] if cfg.get(k) is not None), default)

    heads = get("heads")
    if heads is None or get("vocab") is None:
        return  # shrink_config names what is missing
    plan.validate(num_heads=int(heads), num_kv_heads=int(get("kv_heads", heads)), vocab=int(get("vocab")),
                  num_experts=int(get("experts", 0) or 0), num_layers=get("layers"))
    if layers is not None:
        if layers < 1:
            raise AutoparError(f"autopar: --layers {layers}; expected a positive number of decoder layers.")
        try:
            plan.validate(num_layers=layers)
        except AutoparError as exc:
            raise AutoparError(f"{exc}; or give verify more --layers (or none: it then builds one layer per "
                               "pipeline chunk)") from None


def batch_shape(plan: Plan, global_batch: int | None = None, seq_len: int | None = None) -> tuple[int, int]:
    """Global batch and sequence length: the smallest from 4 x 16 on that the plan splits
    (:func:`autopar.plan_space.batch_ok`, :func:`~autopar.plan_space.cp_seq_ok`,
    :func:`~autopar.plan_space.sp_seq_ok`)."""
    if global_batch is None:
        global_batch = next(n for n in itertools.count(4) if batch_ok(n, plan.dp, plan.mb))
    if seq_len is None:
        seq_len = next(n for n in itertools.count(16)
                       if cp_seq_ok(n, plan.cp) & sp_seq_ok(n, plan.cp, plan.tp, plan.sp))
    plan.validate(global_batch=global_batch, seq_len=seq_len)
    return global_batch, seq_len


def make_batches(vocab: int, batch: int, seq: int, steps: int, seed: int):
    """``steps`` batches of ``((input_ids,), target)``, the target shifted by one token."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen, dtype=torch.int64)
        out.append(((tokens[:, :-1].clone(),), tokens[:, 1:].clone()))
    return out


@contextlib.contextmanager
def seeded_steps(seed: int):
    """The training steps run in the block draw from the default (CPU) generator seeded with ``seed``,
    in the reference process and on every rank alike, so that a model drawing random numbers in
    train mode outside dropout (PhiMoE's sampling router) draws one device's numbers on both sides
    (:mod:`autopar.ops.draws`); the caller's generator state is restored after the block."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def next_token_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits (a tensor, a tuple's first element, or ``.logits``)."""
    logits = output
    if hasattr(output, "logits"):
        logits = output.logits
    elif isinstance(output, (tuple, list)):
        logits = output[0]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
