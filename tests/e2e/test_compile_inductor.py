"""``parallelize(..., compile=True)`` with torch.compile's default backend, Inductor, which
generates C++ on this CPU (Triton kernels on GPUs): training agrees with the eager
program within floating-point reassociation.  Bitwise and multi-rank checks with
``aot_eager``: tests/unit/test_compile.py, tests/dist/test_compile.py."""
from __future__ import annotations

from tests.support.harness import assert_equivalent
from tests.unit.test_compile import train


def test_inductor_trains_like_eager():
    """The suite's bounds (loss 1e-5, parameters 1e-4 after 3 AdamW steps, fp32)."""
    eager, want = train(False, "example")
    compiled, got = train(True, "example")
    assert_equivalent((want, eager.state_dict()), (got, compiled.state_dict()))
