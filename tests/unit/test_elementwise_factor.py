"""``ModelSpec.elementwise_factor``: a layer's element-wise bytes over a Llama layer's, counted on graphs
(autopar/frontend/elementwise.py), by hand."""
from __future__ import annotations

import pytest
import torch

from autopar.cost import ModelSpec
from autopar.frontend.elementwise import graph_bytes, reference_bytes
from tests.support.models import hf_llama, make_batch

pytest.importorskip("transformers")


class _Tiny(torch.nn.Module):
    def forward(self, x):
        y = x.transpose(0, 1).contiguous()     # a copy: 128 B read, 128 B written
        z = y.view(-1).to(torch.float32)        # a view and a cast to its own dtype: nothing moves
        return (z * 2).sum()                    # mul: 128 + 128; sum: 128 read, 4 written


def test_graph_bytes_by_hand():
    gm = torch.export.export(_Tiny(), (torch.randn(4, 8),), strict=False).module()
    assert graph_bytes(gm.graph.nodes) == 256 + 256 + 132


def test_a_llama_layer_is_the_reference():
    ids, _ = make_batch(128, 2, 16, 0)
    assert ModelSpec.from_module(hf_llama(), (ids,), {"use_cache": False}).elementwise_factor == 1.0


def test_granite_residual_multipliers_add_their_bytes():
    """Granite's layer is Llama's with each residual branch scaled (``h * residual_multiplier``): two
    more element-wise products over [T, H] (read and written, fp32), the attention multiplier being
    SDPA's scale argument."""
    import transformers

    config = transformers.GraniteConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        residual_multiplier=0.5, attn_implementation="sdpa")
    ids, _ = make_batch(128, 2, 16, 0)
    spec = ModelSpec.from_module(transformers.GraniteForCausalLM(config), (ids,), {"use_cache": False})
    T, H = 2 * 16, 64
    ref = reference_bytes(2, 16, H, 4, 2, 16, 128)
    assert spec.elementwise_factor == pytest.approx((ref + 2 * 2 * T * H * 4) / ref, abs=1e-3)
