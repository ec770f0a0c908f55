"""Tests for the test-suite models (tests/support/models.py, examples/model.py).

Each model runs forward and backward and is deterministic; the example decoder's exported graph
has the structure the passes expect and matches a Hugging Face Llama given the same weights.
That every model exports with symbolic batch and sequence dimensions and its exported module
matches eager at another size: tests/e2e/test_model_exports.py (an export of every model).
"""

from __future__ import annotations

__all__: list[str] = []  # test module: nothing to export

import pytest
import torch
from torch.export import export

from tests.support.models import MODELS, dynamic_shapes, example_model, example_module, hf_llama, logits_of, make_batch

transformers = pytest.importorskip("transformers")

VOCAB = 128
# Parameters a model itself gives no gradient: the sparse-attention indexers of DeepSeek-V3.2 and
# HY-V4 run under torch.no_grad() in transformers (their real training fits them by a loss of their own).
NO_GRAD = {"hf_deepseek_v32": ".indexer.", "hf_hy_v4": ".indexer."}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward(name):
    factory, loss_fn, kwargs = MODELS[name]
    model = factory(seed=0)
    ids, target = make_batch(VOCAB, 3, 10, seed=1)
    out = model(ids, **kwargs)
    assert logits_of(out).shape == (3, 10, VOCAB)
    loss = loss_fn(out, target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Near-uniform predictions at init: the loss is close to log(vocab).
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5
    loss.backward()
    for pname, p in model.named_parameters():
        if name in NO_GRAD and NO_GRAD[name] in pname:
            assert p.grad is None, pname
            continue
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", sorted(MODELS))
def test_factories_are_deterministic(name):
    factory = MODELS[name][0]
    a, b, c = factory(seed=0), factory(seed=0), factory(seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_example_graph_structure():
    model = example_model(seed=0)
    ids, _ = make_batch(VOCAB, 4, 16, seed=0)
    graph = export(model, (ids,), strict=False, dynamic_shapes=dynamic_shapes({})).graph
    calls = [n for n in graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in calls]
    # The rotary positions come from an arange over the symbolic sequence length.
    aranges = [n for n in calls if "arange" in str(n.target)]
    assert len(aranges) == 1
    end = aranges[0].args[0]
    assert isinstance(end, torch.fx.Node) and "sym_size" in str(end.target)
    assert targets.count("aten.scaled_dot_product_attention.default") == 2
    assert targets.count("aten.linear.default") == 2 * 7 + 1  # q k v o gate up down per layer, head
    assert targets.count("aten.expand.default") == 4  # K and V per layer (GQA, group 2)
    paths = {list(n.meta["nn_module_stack"].values())[-1][0]
             for n in calls if "linear" in str(n.target)}
    assert "layers.0.attn.q_proj" in paths and "layers.1.mlp.down_proj" in paths and "lm_head" in paths


def test_module_names():
    names = {n for n, _ in example_model().named_modules()}
    for expected in ["embed_tokens", "layers.0.input_norm", "layers.0.attn.q_proj",
                     "layers.0.attn.k_proj", "layers.0.attn.v_proj", "layers.0.attn.o_proj",
                     "layers.0.post_attn_norm", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
                     "layers.0.mlp.down_proj", "layers.1.mlp.down_proj", "norm", "lm_head"]:
        assert expected in names
    fused = {n for n, _ in example_model(fused_qkv=True, fused_gate_up=True).named_modules()}
    assert "layers.0.attn.qkv_proj" in fused and "layers.0.mlp.gate_up_proj" in fused
    assert "layers.0.attn.q_proj" not in fused and "layers.0.mlp.gate_proj" not in fused


def test_tied_embeddings_share_one_parameter():
    model = example_model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed_tokens.weight
    n_untied = sum(p.numel() for p in example_model().parameters())
    n_tied = sum(p.numel() for p in model.parameters())
    assert n_untied - n_tied == VOCAB * 64


def _copy_example_into_hf(src, hf, fused: bool) -> None:
    """Load the example decoder's weights into a HF Llama (names mapped by hand)."""
    q, kv = 4 * 16, 2 * 16
    sd = {"model.embed_tokens.weight": src.embed_tokens.weight, "model.norm.weight": src.norm.weight,
          "lm_head.weight": src.lm_head.weight}
    for i, layer in enumerate(src.layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = layer.input_norm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attn_norm.weight
        sd[p + "self_attn.o_proj.weight"] = layer.attn.o_proj.weight
        sd[p + "mlp.down_proj.weight"] = layer.mlp.down_proj.weight
        if fused:
            w = layer.attn.qkv_proj.weight
            sd[p + "self_attn.q_proj.weight"] = w[:q]
            sd[p + "self_attn.k_proj.weight"] = w[q:q + kv]
            sd[p + "self_attn.v_proj.weight"] = w[q + kv:]
            g = layer.mlp.gate_up_proj.weight
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = g[:128], g[128:]
        else:
            for n in ("q_proj", "k_proj", "v_proj"):
                sd[p + f"self_attn.{n}.weight"] = getattr(layer.attn, n).weight
            for n in ("gate_proj", "up_proj"):
                sd[p + f"mlp.{n}.weight"] = getattr(layer.mlp, n).weight
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()},
                                             strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)


@pytest.mark.parametrize("fused", [False, True])
def test_example_matches_hf_llama(fused):
    # Same architecture, so the same weights must give the same logits: an independent
    # check of the example's RMSNorm, rotary embedding, GQA and SwiGLU.
    src = example_model(seed=3, fused_qkv=fused, fused_gate_up=fused, norm_eps=1e-6)
    hf = hf_llama(seed=0, rms_norm_eps=1e-6)
    _copy_example_into_hf(src, hf, fused)
    ids, _ = make_batch(VOCAB, 2, 12, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(src(ids), hf(ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)


def test_make_batch_and_loss():
    ids, target = make_batch(VOCAB, 4, 16, seed=7)
    assert ids.dtype == torch.int64 and ids.shape == (4, 16) and target.shape == (4, 16)
    assert torch.equal(ids[:, 1:], target[:, :-1])
    assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB
    again, _ = make_batch(VOCAB, 4, 16, seed=7)
    assert torch.equal(ids, again)
    # lm_loss on one-hot-ish logits: the correct class at +10, others 0, for every position.
    logits = torch.zeros(4, 16, VOCAB)
    logits.scatter_(-1, target.unsqueeze(-1), 10.0)
    expected = -torch.log(torch.exp(torch.tensor(10.0)) / (torch.exp(torch.tensor(10.0)) + VOCAB - 1))
    torch.testing.assert_close(example_module().lm_loss(logits, target), expected)


def test_build_tiny():
    model, (ids,) = example_module().build_tiny()
    assert ids.shape == (4, 16)
    assert model(ids).shape == (4, 16, VOCAB)


def test_config_errors():
    cfg = example_module().DecoderConfig
    with pytest.raises(ValueError, match="num_kv_heads"):
        cfg(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_heads"):
        cfg(hidden_size=60, num_heads=8)


def test_hf_tie_option():
    model = hf_llama(tie=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert hf_llama(tie=False).lm_head.weight is not hf_llama(tie=False).model.embed_tokens.weight


def test_train_llama_plain_path(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_llama.py"
    spec = importlib.util.spec_from_file_location("autopar_examples_train_llama", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--plan", "none", "--steps", "2", "--batch", "4", "--seq", "8", "--data", "random",
                        "--optimizer", "sgd", "--lr", "0.1", "--seed", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split()[:3] for ln in lines] == [["step", "0", "loss"], ["step", "1", "loss"]]
    # Step 0's loss is the fresh seed-2 model's loss on step 0's batch; step 1's follows one
    # SGD step (recomputed here by hand with p -= lr * grad).
    model = example_model(seed=2)
    params = dict(model.named_parameters())
    losses = []
    for step in range(2):
        ids, target = make_batch(VOCAB, 4, 8, seed=2 * 1_000_003 + step)
        loss = example_module().lm_loss(model(ids), target)
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads):
                p -= 0.1 * g
    assert [float(ln.split()[3]) for ln in lines] == pytest.approx(losses, abs=2e-6)
    assert losses[0] != losses[1]
