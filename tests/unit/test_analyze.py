"""Tracing and structure recognition on the example decoder and HF Llama (one process)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar.frontend.analyze import analyze
from autopar.frontend.model_dims import model_dims
from autopar.errors import AutoparError
from autopar.frontend.trace import trace_model
from tests.support.models import MODELS, example_model, hf_llama, make_batch


def _structure(name, **overrides):
    factory, loss_fn, kwargs = MODELS[name]
    model = factory(**overrides) if overrides else factory()
    ids, _ = make_batch(128, 4, 16, 0)
    return analyze(trace_model(model, (ids,), kwargs, loss_fn).gm)


@pytest.mark.parametrize("name", ["example", "example_tied", "example_fused", "hf_llama"])
def test_regions_found_by_structure(name):
    s = _structure(name)
    assert s.num_layers == 2
    assert [r.kind for r in s.regions].count("attention") == 2
    assert [r.kind for r in s.regions].count("mlp") == 2
    for r in s.regions:
        assert len(r.rows) == 1
        if r.kind == "attention":
            assert (r.num_heads, r.num_kv_heads, r.head_dim) == (4, 2, 16)
            assert r.rows[0].module.endswith("o_proj")
    assert (s.hidden, s.vocab, s.ffn) == (64, 128, 128)
    assert s.lm_head is not None and s.loss is not None
    assert len(s.norm_weights) == 2 * 2 + 1


def test_fused_projections_record_their_parts():
    s = _structure("example_fused")
    attn = next(r for r in s.regions if r.kind == "attention")
    mlp = next(r for r in s.regions if r.kind == "mlp")
    (qkv,) = attn.columns
    assert qkv.split_sizes == [64, 32, 32]  # q: 4 heads x 16, k and v: 2 heads x 16
    (gate_up,) = mlp.columns
    assert gate_up.split_sizes == [128, 128]


def test_a_fused_projection_split_by_heads_records_its_parts():
    """Ergo's ``qkv(x).view(b, s, -1, d).split((heads, kv, kv), dim=-2)``: parts in counts of heads
    after the view are the projection's parts in features."""
    s = _structure("example_head_split")
    (qkv,) = next(r for r in s.regions if r.kind == "attention").columns
    assert qkv.split_sizes == [64, 32, 32]
    # its weights reach the projections through casts to fp32: every region and the LM head are found
    assert [r.kind for r in s.regions].count("attention") == 2 and [r.kind for r in s.regions].count("mlp") == 2
    assert s.lm_head is not None and s.lm_head.module == "model.lm_head" and s.lm_head.weight == "model.lm_head.weight"


def test_tied_embeddings_detected():
    assert _structure("example_tied").tied_embeddings
    assert not _structure("example").tied_embeddings


def test_model_dims_feed_the_cost_model():
    ids, _ = make_batch(128, 4, 16, 0)
    dims = model_dims(hf_llama(), (ids,), {"use_cache": False})
    assert dims["num_layers"] == 2 and dims["num_heads"] == 4 and dims["num_kv_heads"] == 2
    assert dims["gated_mlp"] and dims["vocab"] == 128 and dims["ffn"] == 128


def test_graph_has_symbolic_batch_and_sequence():
    ids, _ = make_batch(128, 4, 16, 0)
    traced = trace_model(example_model(), (ids,), None, MODELS["example"][1])
    assert traced.batch_symbol is not None and traced.seq_symbol is not None
    # the same graph runs on another batch and sequence size (what each rank sees)
    ids2, tgt2 = make_batch(128, 2, 8, 1)
    model = example_model()
    expected = MODELS["example"][1](model(ids2), tgt2)
    torch.testing.assert_close(traced.gm(ids2, tgt2), expected)


def test_trace_does_not_modify_the_model():
    model = example_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, _ = make_batch(128, 4, 16, 0)
    trace_model(model, (ids,), None, MODELS["example"][1])
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.float().sum() > 0:  # data-dependent Python control flow
            return self.proj(x.float())
        return x.float()


def test_export_failure_is_an_autopar_error():
    with pytest.raises(AutoparError, match=r"^autopar: torch.export .* could not trace _Untraceable") as info:
        trace_model(_Untraceable(), (torch.ones(2, 8, dtype=torch.long),), None, None)
    assert "try:" in str(info.value)


def test_bad_example_inputs():
    with pytest.raises(AutoparError, match="example_inputs must be a non-empty tuple"):
        trace_model(example_model(), (), None, None)


def test_conv1d_style_model_regions():
    s = _structure("hf_gpt2")
    attn = [r for r in s.regions if r.kind == "attention"]
    assert len(attn) == 2 and all(r.columns[0].in_out for r in attn)
    assert attn[0].columns[0].split_sizes == [64, 64, 64]  # fused c_attn behind a view
    assert s.tied_embeddings and s.lm_head is not None


def test_a_fused_projection_transposed_before_its_split_records_its_parts():
    """LFM's short convolution: ``in_proj(x).transpose(-1, -2).chunk(3, dim=-2)`` splits the
    features after they moved to dim -2; a split of another dim is not the projection's parts."""
    pytest.importorskip("transformers")
    s = _structure("hf_lfm3")
    (conv,) = [c for r in s.regions for c in r.columns if c.module.endswith("conv.in_proj")]
    assert conv.split_sizes == [64, 64, 64]

    class ChunkOther(nn.Module):  # the chunk cuts the sequence, not the features
        def __init__(self):
            super().__init__()
            self.emb, self.proj, self.out = nn.Embedding(128, 64), nn.Linear(64, 96), nn.Linear(32, 64)

        def forward(self, ids):
            parts = self.proj(self.emb(ids)).transpose(-1, -2).chunk(2, dim=-1)
            return self.out(torch.cat(parts, dim=-2).transpose(-1, -2)[..., :32])

    ids, _ = make_batch(128, 4, 16, 0)
    gm = trace_model(ChunkOther(), (ids,), None, lambda out, t: out.float().mean()).gm
    from autopar.frontend.analyze import _split_sizes
    (linear,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
                 and n.meta["val"].shape[-1] == 96]
    assert _split_sizes(linear) is None


class _ConvolvedQKV(nn.Module):
    """Qwen3.5's gated delta net in small: ``in_proj_qkv(x)`` through a causal depthwise convolution
    (channels first, padded, cut back to the sequence, SiLU) before ``split([q, k, v])``; or, with
    ``mix``, a convolution mixing the channels (not depthwise), which keeps no part whole."""

    def __init__(self, mix: bool = False):
        super().__init__()
        self.emb, self.proj = nn.Embedding(128, 32), nn.Linear(32, 48)
        self.conv = nn.Conv1d(48, 48, 3, padding=2, groups=1 if mix else 48)
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        qkv = self.proj(self.emb(ids)).transpose(1, 2)
        qkv = torch.nn.functional.silu(self.conv(qkv)[..., :ids.shape[1]]).transpose(1, 2)
        q, k, v = torch.split(qkv, [8, 8, 32], dim=-1)
        return self.out((q * k).sum(-1, keepdim=True) * v[..., :16])


@pytest.mark.parametrize("mix,parts", [(False, [8, 8, 32]), (True, None)])
def test_a_fused_projection_convolved_channel_by_channel_records_its_parts(mix, parts):
    from autopar.frontend.analyze import _split_sizes

    ids, _ = make_batch(128, 4, 16, 0)
    gm = trace_model(_ConvolvedQKV(mix), (ids,), None, lambda out, t: out.float().mean()).gm
    (linear,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
                 and n.meta["val"].shape[-1] == 48]
    assert _split_sizes(linear) == parts


class _StackedGate(nn.Module):
    """Moshi in small: ``fc1(x).view(b, s, 2, -1)``, its halves read by ``[..., 0, :]`` and
    ``[..., 1, :]`` (a gate and an up-projection stacked by a view), and an LM head one row narrower
    than the embedding table (Moshi's padding token has an embedding, no logit)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc1, self.fc2 = nn.Embedding(129, 32), nn.Linear(32, 64), nn.Linear(32, 32)
        self.head = nn.Linear(32, 128)

    def forward(self, ids):
        h = self.fc1(self.emb(ids))
        h = h.view(h.shape[0], h.shape[1], 2, -1)
        return self.head(self.fc2(torch.relu(h[..., 0, :]) * h[..., 1, :]))


def test_parts_stacked_by_a_view_and_a_head_narrower_than_the_table_are_found():
    ids, _ = make_batch(128, 4, 16, 0)
    ce = lambda out, t: torch.nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    s = analyze(trace_model(_StackedGate(), (ids,), None, ce, ids).gm)
    (fc1,) = [c for r in s.regions for c in r.columns if c.module == "model.fc1"]
    assert fc1.split_sizes == [32, 32]
    assert s.lm_head is not None and s.lm_head.module == "model.head" and s.vocab == 129
