"""The cost model's terms beyond the decoder, by hand (cost/comm.py, cost/spec.py; read from the
traced model by autopar/frontend/spec_dims.py and attention_dims.py).

The tiny Llama-style spec of test_cost_comm.py (L=2, H=64, 4 heads of 16, 2 KV heads, FFN 128,
V=128, fp32, S=16, global batch 4) with, one at a time or together: four norms per layer, biased
o/MLP projections, extra embedding tables, a head transform and bias, gathered logits, a
cumulative sum along the sequence, and K/V moved by CP with every query head.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from autopar.cost import Cluster, ModelSpec, estimate

L, H, A, G, D, F, V, S, GB, W = 2, 64, 4, 2, 16, 128, 128, 16, 4, 4
BASE = dict(name="tiny", num_layers=L, hidden=H, num_heads=A, num_kv_heads=G, ffn=F, vocab=V)
EXTRA = dict(layer_norms=4, proj_bias=True, embedding_extra_params=4224, head_extra_params=4288, lm_head_bias=True)
CLUSTER = Cluster(gpu="cpu", num_nodes=1, gpus_per_node=8)


def totals(spec, plan, stage=None) -> dict:
    cost = estimate(spec, CLUSTER, plan, S, GB, dtype_bytes=W)
    out = defaultdict(lambda: [0.0, 0])
    for r in (cost.comm_table() if stage is None else cost.comm_table(stage)):
        out[(r.phase, r.collective, r.axis)][0] += r.bytes_sent * r.count
        out[(r.phase, r.collective, r.axis)][1] += r.count
    return dict(out)


def test_param_count_beyond_the_decoder():
    base = ModelSpec(**BASE).num_params
    # per layer: 2 more norms (2 x 64), biases of o (64), gate and up (2 x 128), down (64)
    assert ModelSpec(**BASE, **EXTRA).num_params == base + L * (128 + 384) + 4224 + 4288 + V


def test_dp_gradients_carry_every_parameter():
    spec = ModelSpec(**BASE, **EXTRA)
    assert totals(spec, "dp=2")[("grad", "all_reduce", "dp")] == [W * spec.num_params, 1]  # 2 (n-1)/n F = F


def test_sp_partial_gradients_beyond_the_decoder():
    # (4 norms x 2 layers + final norm) x 64, row biases 2 x 2 x 64, the tables and the head transform
    partial = (4 * L + 1) * H + 2 * L * H + 4224 + 4288
    assert totals(ModelSpec(**BASE, **EXTRA), "tp=2,sp")[("grad", "all_reduce", "tp")] == [W * partial, 1]


def test_gathered_logits_replace_the_vocab_parallel_loss():
    t = totals(ModelSpec(**BASE, gathered_logits=True), "tp=2")
    assert t[("fwd", "all_gather", "tp")] == [64 * (V // 2) * W, 1]  # T = 4 x 16 tokens, shard [b, s, V/2]
    assert t[("fwd", "all_reduce", "tp")][1] == 2 * L + 1  # o/down and the embedding; no loss all-reduces


def test_sequence_cumsum_all_gathers_chunk_totals():
    t = totals(ModelSpec(**BASE, seq_cumsums=1, seq_cumsum_bytes=4), "cp=2:allgather")
    kv = 32 * G * (D + D) * W  # T = 4 x 8 tokens per rank
    assert t[("fwd", "all_gather", "cp")] == [L * kv + 2 * 4 * 4, L + 1]  # shard [2 chunks, b=4] fp32


@pytest.mark.parametrize("heads", [G, A])
def test_ring_moves_the_heads_the_attention_receives(heads):
    t = totals(ModelSpec(**BASE, cp_kv_heads=heads), "cp=2:ring")
    assert t[("fwd", "send", "cp")] == [L * 32 * heads * (D + D) * W, L]


def test_traced_fields():
    """ModelSpec.from_module reads the fields from the traced models (tests/support/models.py; BERT's and
    Falcon's, and every field's bytes, in tests/dist/test_architectures.py)."""
    from tests.support.harness import make_batches
    from tests.support.jobs import BATCH, SEQ, VOCAB, build

    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    expect = {
        "hf_gemma2": dict(num_heads=4, num_kv_heads=2, head_dim=16, layer_norms=4, gathered_logits=True),
        "hf_opt": dict(proj_bias=True, embedding_extra_params=66 * 64, seq_cumsums=1, seq_cumsum_bytes=4),
    }
    for name, fields in expect.items():
        model, _, kwargs = build(name, {})
        spec = ModelSpec.from_module(model, inputs, kwargs)
        assert {k: getattr(spec, k) for k in fields} == fields, name


def test_embedding_norm_is_the_first_stages():
    """A norm of the embeddings (BERT's) is a first-stage parameter: its gradient is reduced there,
    and under ZeRO-3 it makes backward re-gather the embedding unit (a lookup alone reads no weight)."""
    plain, normed = ModelSpec(**BASE), ModelSpec(**BASE, embedding_norm=True)
    assert normed.num_params == plain.num_params + H
    key = ("grad", "all_reduce", "dp")
    for stage, extra in ((0, H), (1, 0)):  # one layer a stage; 2 (n-1)/n bytes = the gradient's at dp=2
        assert totals(normed, "pp=2,dp=2,mb=2", stage)[key][0] == totals(plain, "pp=2,dp=2,mb=2", stage)[key][0] + W * extra
    bwd = ("bwd", "all_gather", "dp")
    first_plain, first_normed = (totals(x, "pp=2:gpipe,dp=2,zero=3", 0)[bwd] for x in (plain, normed))
    assert first_normed[1] == first_plain[1] + 1  # the layer's unit, and now the embedding's
    assert first_normed[0] == first_plain[0] + W * (V * H + H) / 2  # its shard of 2 gathered


@pytest.mark.parametrize("tied,offset,calls,unread", [
    (False, False, 3, V * H),  # the embedding's unit: the lookup's backward reads only the indices
    (True, False, 4, 0),       # the tied head's backward reads the table: every unit again
    (True, True, 3, H),        # ... but not the head's unit, a final norm of x * (1 + w) alone (Gemma)
])
def test_zero3_backward_regathers_what_backward_reads(tied, offset, calls, unread):
    spec = ModelSpec(**BASE, tied_embeddings=tied, norm_weight_offset=offset)
    t = totals(spec, "dp=2,zero=3")
    assert t[("fwd", "all_gather", "dp")] == [spec.num_params * W / 2, L + 2]  # (n-1)/n of the fp32 params
    assert t[("bwd", "all_gather", "dp")] == [(spec.num_params - unread) * W / 2, calls]
