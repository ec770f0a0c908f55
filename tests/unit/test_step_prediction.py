"""``pm.last_step_stats``'s cost-model prediction (autopar.planning.autoplan.predict_step).

On a GPU the runtime adds the cost model's step time, MFU and tokens/s for its plan; on a
CPU, which the model is not calibrated for, nothing.  The GPU path is checked here by
naming the GPU, as ``local_gpu()`` would on an H100, against the cost model's figures for
the example model's sizes written out in the test.
"""
from __future__ import annotations

import autopar
from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.planning import autoplan
from tests.support.models import MODELS, make_batch


def _structure():
    factory, loss_fn, kwargs = MODELS["example"]
    ids, _ = make_batch(128, 4, 16, seed=0)
    return analyze(trace_model(factory(), (ids,), kwargs, loss_fn).gm)


def test_no_prediction_on_a_cpu(monkeypatch):
    monkeypatch.setattr(autoplan, "local_gpu", lambda: "cpu")
    assert autoplan.predict_step(_structure(), autopar.Plan.parse("dp=2"), 16, 4) == {}


def test_prediction_on_a_gpu_is_the_cost_models(monkeypatch):
    monkeypatch.setattr(autoplan, "local_gpu", lambda: "h100")
    plan = autopar.Plan.parse("tp=2,sp,dp=2")
    got = autoplan.predict_step(_structure(), plan, 16, 4, dtype_bytes=4)
    # The expected figures from the example model's sizes written out here (examples/model.py's
    # DecoderConfig defaults: a gated MLP, RMSNorm, untied head), not from what the runtime
    # read off the traced graph, on the 4 H100s of one node that the plan's world needs.
    spec = autopar.ModelSpec(name="example", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                             ffn=128, vocab=128, gated_mlp=True, tied_embeddings=False, norm="rmsnorm")
    cost = autopar.estimate(spec, autopar.Cluster(gpu="h100", num_nodes=1, gpus_per_node=4), plan, seq_len=16,
                            global_batch=4, dtype_bytes=4)
    assert got == {"predicted_seconds": cost.step_time, "predicted_mfu": cost.mfu,
                   "predicted_tokens_per_s": 16 * 4 / cost.step_time}  # tokens of a step over its time
    assert got["predicted_seconds"] > 0 and 0 < got["predicted_mfu"] < 1
