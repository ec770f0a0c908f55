"""The refusals the README's architecture matrix lists, each before the first step and with its
reason (tests/dist/test_architectures.py proves the plans the matrix marks T).

One process, no training: ``compile_program`` for 2 ranks raises while compiling."""
from __future__ import annotations

import pytest

from autopar.errors import AutoparError
from autopar.runtime import compile_program
from tests.support.models import MODELS, make_batch

REFUSALS = [
    # The load-balancing statistic is over the whole batch: per micro-batch it would differ.
    ("hf_mixtral_aux", "pp=2,mb=2", ["is a statistic over the whole batch's tokens", "modeling_mixtral.py"]),
    # DeepSeek-V3: MoE under tp needs sp (tp=2,sp: tests/dist/test_architectures.py).
    ("hf_deepseek_v3", "tp=2", ["without sp on a mixture-of-experts model", "'tp=2,sp'"]),
]


@pytest.mark.parametrize("model_name,plan,phrases", REFUSALS, ids=[f"{m}-{p}" for m, p, _ in REFUSALS])
def test_matrix_refusal_names_its_reason(model_name, plan, phrases):
    factory, loss_fn, kwargs = MODELS[model_name]
    ids, _ = make_batch(128, 4, 16, 0)
    with pytest.raises(AutoparError) as info:
        compile_program(factory(), (ids,), kwargs, plan, loss_fn, world_size=2)
    msg = str(info.value)
    assert msg.startswith("autopar: ")
    for phrase in phrases:
        assert phrase in msg, (phrase, msg)
