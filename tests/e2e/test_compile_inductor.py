"""``parallelize(..., compile=True)`` with torch.compile's default backend, Inductor, which
generates C++ on this CPU (Triton kernels on GPUs): training agrees with the eager
program within floating-point reassociation, recomputed regions included (each body compiled
on its own).  Bitwise and multi-rank checks with ``aot_eager`` (pipelines under every schedule
too): tests/unit/test_compile.py, tests/dist/test_compile.py."""
from __future__ import annotations

from tests.support.harness import assert_equivalent
from tests.unit.test_compile import train


def test_inductor_trains_like_eager():
    """The suite's bounds (loss 1e-5, parameters 1e-4 after 3 AdamW steps, fp32)."""
    eager, want = train(False, "example")
    compiled, got = train(True, "example")
    assert_equivalent((want, eager.state_dict()), (got, compiled.state_dict()))


def test_inductor_compiles_recomputed_regions():
    """``recompute=full``: each layer's body compiled by Inductor on its own, run again in backward."""
    one_layer = {"num_layers": 1}  # one body to compile
    eager, want = train(False, "example", plan="recompute=full", overrides=one_layer)
    compiled, got = train(True, "example", plan="recompute=full", overrides=one_layer)
    assert_equivalent((want, eager.state_dict()), (got, compiled.state_dict()))
    assert compiled.step_context.counters["recomputed_regions"] == eager.step_context.counters["recomputed_regions"]
