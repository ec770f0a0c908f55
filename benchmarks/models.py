"""Small models the benchmarks and the test suite share: the example decoder and a tiny HF Llama.

``example_module()`` loads ``examples/model.py`` (the example decoder, ``lm_loss``, ``make_batch``)
by path; ``example_model`` / ``example_moe`` build it with deterministic weights; ``hf_llama`` is a
tiny ``transformers.LlamaForCausalLM`` from a config (no downloads).  The suite's wider zoo of
models is tests/support/models.py, which imports these from here: benchmarks never import the
test suite (tests/unit/test_layers.py).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

__all__ = ["example_module", "example_model", "example_moe", "lm_loss", "make_batch", "hf_llama", "hf_loss", "hf_model"]

_EXAMPLE_PATH = Path(__file__).resolve().parents[1] / "examples" / "model.py"
_EXAMPLE_NAME = "autopar_examples_model"


def example_module():
    """examples/model.py as a module (loaded by path: ``examples/`` is not a package)."""
    module = sys.modules.get(_EXAMPLE_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_EXAMPLE_NAME, _EXAMPLE_PATH)
        module = importlib.util.module_from_spec(spec)
        # Registered before exec so that dataclasses and pickling can find the module.
        sys.modules[_EXAMPLE_NAME] = module
        spec.loader.exec_module(module)
    return module


def example_model(seed: int = 0, **cfg_overrides):
    """The example ``Decoder`` with ``DecoderConfig(**cfg_overrides)``, weights from ``seed``."""
    mod = example_module()
    torch.manual_seed(seed)
    return mod.Decoder(mod.DecoderConfig(**cfg_overrides))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return example_module().lm_loss(logits, target)


def make_batch(vocab_size: int, batch: int, seq: int, seed: int):
    return example_module().make_batch(vocab_size, batch, seq, seed)


def hf_model(config_name: str, model_name: str, seed: int, defaults: dict, overrides: dict):
    """``transformers.<model_name>(<config_name>(**defaults, **overrides))`` with weights from ``seed``."""
    import transformers

    config = getattr(transformers, config_name)(**{**defaults, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    model.train()
    return model


def hf_llama(seed: int = 0, tie: bool = False, **overrides):
    """A tiny ``transformers.LlamaForCausalLM`` (vocab 128, hidden 64, 2 layers, 4 heads, 2 KV heads)."""
    return hf_model("LlamaConfig", "LlamaForCausalLM", seed, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, attn_implementation="sdpa"),
        overrides)


def hf_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy from a Hugging Face ``CausalLMOutput`` (its ``.logits``)."""
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def example_moe(seed: int = 0, **overrides):
    """The example decoder with a 4-expert top-2 MoE (ModuleList experts) in every layer."""
    kwargs = dict(num_experts=4, top_k=2, intermediate_size=64)
    kwargs.update(overrides)
    return example_model(seed, **kwargs)
