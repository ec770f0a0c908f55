"""Context parallelism in one process: plan errors, the inspected program, block attention, and
eager attention run whole (passes/cp_cores.py: the gathers, the global length, the rows kept, a
gather placed after the model's writes in place, the refusals).

The multi-rank half (equivalence with single-process training, bytes against
``autopar.estimate(...).comm_table()``, load balance, inspect bytes against a run) is
tests/dist/test_cp.py.
"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import AutoparError
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

MODEL_NAMES = ["example", "hf_llama"]


@pytest.mark.parametrize("model_name,overrides,plan,world", [
    ("example", {}, "cp=2:ulysses,tp=2", 4),                      # 2 K/V heads over tp*cp = 4
    ("example", {"num_heads": 2, "num_kv_heads": 2}, "cp=4:ulysses", 4),  # 2 heads over cp = 4
])
def test_ulysses_heads_not_divisible(model_name, overrides, plan, world):
    from autopar.runtime import compile_program

    model, loss_fn, kwargs = build(model_name, overrides)
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    with pytest.raises(AutoparError, match=r"^autopar: cp=\d:ulysses .*tp\*cp"):
        compile_program(model, inputs, kwargs, plan, loss_fn, world_size=world)


# Per attention op at cp=2: ring sends K,V once forward, K,V and dK,dV backward; allgather
# gathers once and reduce-scatters once; Ulysses has two all-to-alls each way.  2 layers.
@pytest.mark.parametrize("variant,ops", [("ring", ["send on cp (fwd): 2 ", "send on cp (bwd): 4 "]),
                                         ("allgather", ["all_gather on cp (fwd): 2 ", "reduce_scatter on cp (bwd): 2 "]),
                                         ("ulysses", ["all_to_all on cp (fwd): 4 ", "all_to_all on cp (bwd): 4 "])])
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_inspect_shows_cp_collectives(model_name, variant, ops):
    from autopar.views.program import format_program
    from autopar.runtime import compile_program

    model, loss_fn, kwargs = build(model_name, {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    traced, ctx = compile_program(model, inputs, kwargs, f"cp=2:{variant}", loss_fn, world_size=2)
    text = format_program(traced.gm, ctx)
    for op in ops:
        assert op + "in total" in text
    assert text.count(f"{variant}_attention(") == 2 and "<<cp>>" in text
    assert "cp_positions(" in text  # the position arange now yields global positions
    assert "scaled_dot_product_attention(" not in text.replace("tag='cp", "")
    assert "all_reduce over dp_cp" in text


def _ops(gm, target) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_padding_mask_fixing_the_length_is_refused():
    """A padding attention_mask: transformers builds the mask from it by branching on the length, so
    export fixes the sequence length, which cp cannot cut (refused, saying why)."""
    import torch

    from autopar.runtime import compile_program

    model, loss_fn, _ = build("hf_llama", {})
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    kwargs = {"use_cache": False, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}
    with pytest.raises(AutoparError, match=r"^autopar: context parallelism needs the sequence traced with a "
                                           r"symbolic length, but torch.export fixed it to 16 .*padding"):
        compile_program(model, inputs, kwargs, "cp=2:ring", loss_fn, world_size=2)


def test_eager_attention_runs_whole():
    """Eager attention (scores, a causal mask built from the sizes, softmax, @ v): q, k and v gathered,
    the mask built again at the global length (the sizes in the core's arguments times cp), the
    probabilities' product with v cut to this rank's rows before the LM head."""
    import operator

    import torch

    from autopar.ops import cp_attention as CPA

    gm = _compile_toy(_EagerCopiedKeys())
    assert not _ops(gm, CPA.ring_attention) and len(_ops(gm, CPA.cp_gather_sequence)) == 3
    (global_len,) = [n for n in _ops(gm, operator.mul) if n.args[1] == 2]  # s * cp
    assert any(global_len in n.args[0] for n in _ops(gm, torch.ops.aten.ones.default))
    (rows,) = _ops(gm, CPA.cp_table_rows)
    assert rows.args[0].target is torch.ops.aten.matmul.default and rows.users


def test_dropout_in_eager_attention_is_refused():
    with pytest.raises(AutoparError, match=r"^autopar: context parallelism runs eager attention whole, but node "
                                           r"'dropout.*applies dropout"):
        _compile_toy(_EagerCopiedKeys(dropout=0.1))


@pytest.mark.parametrize("n", [2, 3])
def test_cp_gather_sequence_puts_every_rank_chunks_at_their_positions(monkeypatch, n):
    """``cp_gather_sequence`` on every rank gives the whole sequence in global order; its backward
    (the all-gather's reduce-scatter) gives each rank the gradient at its positions."""
    import torch

    from autopar.ops import collectives as C
    from autopar.ops import cp_attention as CPA

    seq = 4 * n
    full = torch.randn(2, seq, 3)
    shards = [full[:, CPA.cp_chunk_indices(seq, r, n)] for r in range(n)]
    monkeypatch.setattr(C, "axis_size", lambda axis: n)
    monkeypatch.setattr(C, "all_gather", lambda x, dim, axis, tag="": torch.cat(
        [x if torch.equal(s, x.detach()) else s for s in shards], dim))
    for r in range(n):
        x = shards[r].clone().requires_grad_()
        got = CPA.cp_gather_sequence(x, 1, "cp")
        torch.testing.assert_close(got, full)
        (got * torch.arange(seq).view(1, seq, 1)).sum().backward()
        assert x.grad[0, :, 0].tolist() == CPA.cp_chunk_indices(seq, r, n).float().tolist()


@pytest.mark.parametrize("causal,d_v,window", [(True, 8, None), (False, 8, None), (True, 5, None),
                                                (True, 8, 3), (True, 8, 6)])
def test_blockwise_attention_matches_sdpa(causal, d_v, window):
    """One process: the block attention with explicit backward, on tokens in load-balanced order
    (chunks 0,3 then 1,2) and GQA (2 query heads per K/V head), equals sdpa on the ordered sequence;
    also with V narrower than K (DeepSeek's latent attention), and under a causal sliding window
    shorter (3) and longer (6) than a block of 4, against sdpa with the band mask."""
    import torch
    import torch.nn.functional as F

    from autopar.ops.cp_attention import _LocalAttention, cp_chunk_indices

    torch.manual_seed(0)
    b, heads, kv_heads, seq, d = 2, 4, 2, 16, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, kv_heads, seq, d_v, dtype=torch.float64, requires_grad=True)
    order = torch.cat([cp_chunk_indices(seq, 0, 2), cp_chunk_indices(seq, 1, 2)])
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    out = _LocalAttention.apply(q[:, :, order], k[:, :, order], v[:, :, order], order, order,
                                d ** -0.5, causal, heads // kv_heads, 4, window)
    band = torch.ones(seq, seq, dtype=torch.bool).tril()
    if window is not None:
        band &= ~torch.ones(seq, seq, dtype=torch.bool).tril(-window)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                         attn_mask=band if window is not None else None,
                                         is_causal=causal and window is None)
    torch.testing.assert_close(out, ref[:, :, order])
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref[:, :, order], (q, k, v), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_ulysses_packing_with_different_head_dims(monkeypatch):
    """Two simulated ranks: the packed all-to-all gives rank r the whole sequence of head group r
    for q, k and a narrower v (MLA), and the inverse returns each rank its sequence chunk."""
    import torch

    from autopar.ops import cp_attention as CPA

    n, b, heads, seq = 2, 2, 4, 8
    full = [torch.randn(b, heads, seq, d) for d in (6, 6, 4)]  # q, k, v
    chunks = [[x[:, :, r * seq // n:(r + 1) * seq // n] for x in full] for r in range(n)]
    sent: dict = {}

    def exchange(fn, per_rank):
        """Run ``fn`` on every rank's parts; the all-to-all swaps dim-0 slices between ranks."""
        monkeypatch.setattr(CPA, "_a2a", lambda buf, *a: sent.setdefault(len(sent), buf.contiguous()) * 0)
        sent.clear()
        for parts in per_rank:
            fn(parts, n, "cp", "fwd", "")
        bufs = dict(sent)
        out = []
        for r, parts in enumerate(per_rank):
            got = torch.stack([bufs[src][r] for src in range(n)])
            monkeypatch.setattr(CPA, "_a2a", lambda buf, *a, got=got: got)
            out.append(fn(parts, n, "cp", "fwd", ""))
        return out

    heads_out = exchange(CPA._seq_to_heads, chunks)
    for r in range(n):
        for got, x in zip(heads_out[r], full):
            torch.testing.assert_close(got, x[:, r * heads // n:(r + 1) * heads // n])
    back = exchange(CPA._heads_to_seq, heads_out)
    for r in range(n):
        for got, want in zip(back[r], chunks[r]):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n", [2, 3])
def test_cp_table_rows_are_the_global_slice(monkeypatch, n):
    """Each rank's ``cp_table_rows(table, 0, S/n)`` equals rows ``0..S-1`` of the table at the
    rank's load-balanced positions, gradient included."""
    import torch

    from autopar.ops import collectives as C
    from autopar.ops import cp_attention as CPA

    seq = 4 * n
    table = torch.randn(seq + 5, 3, requires_grad=True)
    monkeypatch.setattr(C, "axis_size", lambda axis: n)
    for r in range(n):
        monkeypatch.setattr(C, "axis_rank", lambda axis, r=r: r)
        got = CPA.cp_table_rows(table, 0, seq // n, "cp")
        torch.testing.assert_close(got, table[:seq][CPA.cp_chunk_indices(seq, r, n)])
        (grad,) = torch.autograd.grad(got.sum(), table)
        assert grad[:seq][CPA.cp_chunk_indices(seq, r, n)].eq(1).all() and grad.sum() == got.numel()


@pytest.mark.parametrize("window,skipped", [(3, 9), (6, 7), (None, 6)])
def test_window_skips_blocks_out_of_every_query_window(window, skipped):
    """Of the 16 (query chunk, key chunk) pairs of 4 tokens at sequence 16, causality hides the 6
    above the diagonal; a window of 3 keys also the 3 pairs two or three chunks below it (their
    nearest query and key are 5 and 9 apart), a window of 6 the one pair three chunks below."""
    import torch

    from autopar.ops.cp_attention import _pairs

    order = torch.arange(16)
    assert 16 - len(_pairs(order, order, 4, True, window)) == skipped


@pytest.mark.parametrize("model_name,window,overrides", [
    ("hf_mistral_window", 8, {}), ("hf_qwen2_window", 8, {}), ("hf_llama", None, {}),
    # Mistral 7B's own window: proven at 8195 positions, past it
    ("hf_mistral_window", 4096, {"sliding_window": 4096, "max_position_embeddings": 32768})])
def test_sliding_window_mask_is_proven(model_name, window, overrides):
    """The in-graph masks of the windowed test models are proven causal sliding windows of 8 keys
    (past every threshold of their subgraphs), and Mistral's real 4096-token window too; Llama's
    causal mask is not a window."""
    from autopar.frontend.op_sets import SDPA, sdpa_args
    from autopar.runtime import compile_program
    from passes.causal_mask import mask_window

    model, loss_fn, kwargs = build(model_name, overrides)
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    traced, program = compile_program(model, inputs, kwargs, "none", loss_fn, world_size=1)
    masks = {sdpa_args(n).get("attn_mask") for n in traced.gm.graph.nodes
             if n.op == "call_function" and n.target is SDPA} - {None}
    found = {mask_window(m, program) for m in masks}
    assert found == ({window} if window else set()), found


class _EagerCopiedKeys(torch.nn.Module):
    """Eager causal attention whose keys are copied into an empty tensor in place (DeepSeek's and
    Dots3's ``key_states.new_empty(...)`` then ``copy_``), then an LM head."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, dropout: float = 0.0):
        import torch.nn as nn

        super().__init__()
        self.dropout = dropout
        self.embed = nn.Embedding(vocab, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        import torch

        x = self.embed(ids)
        k = self.k(x)
        keys = k.new_empty(k.shape)  # written in two slices: later readers read ``keys`` itself
        keys[..., :8].copy_(k[..., :8])
        keys[..., 8:].copy_(k[..., 8:])
        scores = torch.einsum("bqd,bkd->bqk", self.q(x), keys) / 4.0  # the core reads ``keys`` itself
        s = ids.shape[1]
        allowed = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        probs = torch.nn.functional.dropout(probs, self.dropout, self.training)
        return self.head(probs @ self.v(x))


def test_a_gathered_input_follows_its_writes_in_place():
    """The gather of a core input goes before its first reader in the core, after the model's writes
    into it: gathered right after ``new_empty``, the attention would read the empty tensor (Dots3 under
    cp was silently wrong so)."""
    import torch

    from autopar.ops import cp_attention as CPA

    order = {n: i for i, n in enumerate(_compile_toy(_EagerCopiedKeys()).graph.nodes)}
    copies = [n for n in order if n.op == "call_function" and n.target is torch.ops.aten.copy_.default]
    empty = next(n for n in order if n.op == "call_function" and n.target is torch.ops.aten.new_empty.default)
    gathered = [n for n in order if n.op == "call_function" and n.target is CPA.cp_gather_sequence
                and empty in _ancestors_of(n)]
    assert len(copies) == 2 and gathered and all(order[g] > max(order[c] for c in copies) for g in gathered)


def _compile_toy(model):
    import torch.nn.functional as F

    from autopar.runtime import compile_program

    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    loss_fn = lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
    traced, _ = compile_program(model, inputs, {}, "cp=2:ring", loss_fn, world_size=2)
    return traced.gm


def _ancestors_of(node) -> set:
    seen, todo = set(), [node]
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


class _ConvMixer(torch.nn.Module):
    """A causal depthwise convolution along the sequence, and no attention (a short-convolution mixer)."""

    def __init__(self, vocab: int = VOCAB, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.conv = torch.nn.Conv1d(width, width, 3, groups=width, padding=2)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids).transpose(1, 2)
        return self.head(self.conv(x)[..., : ids.shape[1]].transpose(1, 2))


def test_a_convolution_mixer_runs_whole():
    """A causal convolution along the sequence (no attention): its input gathered into global order,
    the convolution and the slice back to the sequence's length (built again at the global length)
    run whole, the rows of this rank cut before the LM head."""
    import operator

    import torch

    from autopar.ops import cp_attention as CPA

    gm = _compile_toy(_ConvMixer())
    (gather,) = _ops(gm, CPA.cp_gather_sequence)
    (conv,) = _ops(gm, torch.ops.aten.conv1d.default)
    assert conv.args[0] is gather and gather.args[1] == 2  # the channels-first activation, along its length
    (global_len,) = [n for n in _ops(gm, operator.mul) if n.args[1] == 2]  # s * cp
    (cut,) = [n for n in _ops(gm, torch.ops.aten.slice.Tensor) if n.args[0] is conv]
    assert cut.args[3] is global_len
    (rows,) = _ops(gm, CPA.cp_table_rows)
    assert rows.args[0] is cut and rows.args[1] == 2
