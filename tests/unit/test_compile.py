"""``parallelize(..., compile=...)`` in one process (autopar/runtime/stepping/inductor.py): the argument's
checks and the storage keys of aliased buffers.  Training under ``torch.compile`` against the eager
program: tests/e2e/test_compile_inductor.py (one process), tests/dist/test_compile.py (multi-rank)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.compat import storage_key
from autopar.errors import AutoparError
from tests.support.jobs import build


@pytest.mark.parametrize("value, plan, message", [
    ("yes", "none", "compile='yes'; expected False, True or a dict"),
    ({"backend": "aot_eager", "fullgraf": True}, "none", "has 'fullgraf', which torch.compile does not take"),
])
def test_bad_compile_arguments_are_refused_before_tracing(value, plan, message):
    model, loss_fn, kwargs = build("example", {})
    ids = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(AutoparError) as info:
        autopar.parallelize(model, example_inputs=(ids,), plan=plan, loss_fn=loss_fn, compile=value)
    assert str(info.value).startswith("autopar: ") and message in str(info.value)


def test_storage_key_names_every_alias_of_a_buffer():
    """The saved-tensor hooks find a gathered buffer from what autograd saves: a view of it, or
    (a compiled forward) a fresh alias of its storage; another tensor, even equal, is not it."""
    buffer = torch.arange(12.0)
    key = storage_key(buffer)
    assert storage_key(buffer.view(3, 4)[1:]) == key and storage_key(buffer.detach()) == key
    assert storage_key(buffer.clone()) != key
    meta = torch.empty(4, device="meta")
    assert storage_key(meta.view(2, 2)) == storage_key(meta) != storage_key(torch.empty(4, device="meta"))
