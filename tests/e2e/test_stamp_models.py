"""Layer stamping on the Hugging Face architectures of the matrix: the stamped graph equals
the full export (node for node; losses and gradients bitwise), or the model is exported in
full with the reason logged.  The unit tests (tests/unit/test_stamp.py) cover the conditions."""
from __future__ import annotations

import pytest
import torch

from tests.support import models as M
from tests.unit.test_stamp import assert_same_program

CASES = [
    # (builder, layers, expected log fragment)
    ("hf_gemma2", 8, "exported 5 of 8 layers of model.layers (2 kinds), stamped 3"),  # sliding / global
    ("hf_deepseek_v3", 5, "exported 3 of 5 layers of model.layers (2 kinds), stamped 2"),  # dense first, MoE
    ("hf_falcon", 5, "exported 3 of 5 layers of transformer.h (1 kind), stamped 2"),  # constants in forward
    ("hf_mixtral", 5, "exported 3 of 5 layers of model.layers (1 kind), stamped 2"),
    ("hf_gpt2", 5, "exported 3 of 5 layers of transformer.h (1 kind), stamped 2"),
    ("hf_bert", 5, "exported 3 of 5 layers of bert.encoder.layer (1 kind), stamped 2"),
    # the router logits of every layer reach the loss: not stamped
    ("hf_mixtral_aux", 5, "exporting all 5 layers of model.layers (not stamped: layer 0 passes 2 tensors on"),
]


@pytest.mark.parametrize("name, num_layers, expected", CASES, ids=[c[0] for c in CASES])
def test_stamped_equals_full_export(name, num_layers, expected):
    key = "n_layer" if name == "hf_gpt2" else "num_hidden_layers"
    model = getattr(M, name)(**{key: num_layers})
    vocab = model.config.vocab_size
    torch.manual_seed(0)
    ids, target = torch.randint(0, vocab, (2, 16)), torch.randint(0, vocab, (2, 16))
    kwargs = {} if name == "hf_bert" else {"use_cache": False}
    loss = M.aux_loss if name == "hf_mixtral_aux" else M.hf_loss
    log = assert_same_program(model, (ids,), target, kwargs, loss=loss)
    assert expected in log[0], log
