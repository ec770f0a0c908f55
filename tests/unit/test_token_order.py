"""Token order on a data axis (passes/token_order.py): an experts region's routing in one process.

A tiny language model whose MoE block is written the way transformers 5.x writes its experts
(sort the (token, slot) pairs by expert, gather each pair's token, count the pairs per expert with
a histogram, a grouped matmul over the sorted rows, the inverse permutation, the sum over slots)
is compiled under ``dp=2`` and micro-batches: placement propagation proves the region per-token,
with every step of the glue placed by a token-order rule.  The same region altered so that the
tokens of different ranks would mix (sorted rows read as if in token order, a prefix sum along the
sorted rows, keys whose range the graph does not bound, a constant paired with sorted positions)
is refused with an ``autopar:`` error naming the node, its module and its source line, and so
is random noise drawn per sorted row (one device draws it in the batch's order; noise per token in
token order is drawn for the whole batch, tests/unit/test_random_draws.py).  The
multi-rank half (models trained against one device) is the zoo subset, tests/e2e/test_zoo.py.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.runtime import compile_program

transformers = pytest.importorskip("transformers")
from transformers.integrations import moe as _hf_moe  # noqa: E402,F401  (registers grouped_mm_fallback)

VOCAB, HIDDEN, EXPERTS, TOP_K = 32, 16, 4, 2


class Experts(nn.Module):
    """Stacked experts on the tokens sorted by expert; ``mix`` alters the region."""

    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN ** 0.5)
        self.table = nn.Parameter(torch.zeros(VOCAB, TOP_K), requires_grad=False)

    def forward(self, x, index, weights, ids):
        if self.mix.startswith("loop"):
            return self.loop(x, index, weights)
        if self.mix == "lookup":  # keys read from a table: no bound the graph proves
            index = self.table[ids.reshape(-1)].long()
        if self.mix == "zero-experts":  # LongCat: choices past the experts folded onto them
            index = torch.where(index >= EXPERTS, (index - EXPERTS) * EXPERTS // 2, index)
        if self.mix == "fold-below":  # the same fold, one short: choice EXPERTS lands on key -1
            index = torch.where(index >= EXPERTS, index - EXPERTS - 1, index)
        if self.mix == "noise":  # sampling noise per token: drawn for the whole batch, the rank's rows kept
            weights = weights * (1 + 0.01 * torch.rand_like(weights))
        keys, perm = index.reshape(-1).sort()
        rows = x[perm // TOP_K]
        if self.mix == "noise-sorted":  # noise per sorted row: one device draws it in the batch's order
            rows = rows * (1 + 0.01 * torch.rand_like(rows))
        bins, lo, hi = {"one-bin": (1, 0, 0), "below": (EXPERTS, 1, EXPERTS - 1)}.get(self.mix, (EXPERTS, 0, EXPERTS - 1))
        offsets = torch.histc(keys.float(), bins=bins, min=lo, max=hi).cumsum(0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.weight[:bins], offsets)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        if self.mix == "prefix":  # a running sum along the sorted rows
            out = out.cumsum(0)
        if self.mix == "positions":  # each sorted row scaled by its rank-local position
            out = out * torch.arange(out.shape[0], dtype=out.dtype).unsqueeze(-1)
        if self.mix == "escape":  # sorted rows summed as if they were in token order
            return out.view(-1, TOP_K, HIDDEN).sum(1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, TOP_K, HIDDEN).sum(1)

    def loop(self, x, index, weights):
        """The older style: each expert on the tokens ``where`` selects, added back at them."""
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(index == e)
            rows = (x[token] @ self.weight[e]) * weights[token, slot].unsqueeze(-1)
            # "loop-slot": added at the slot coordinates, not at the tokens
            out = out.index_add(0, slot if self.mix == "loop-slot" else token, rows)
        return out


class TinyMoE(nn.Module):
    def __init__(self, mix: str = ""):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        # "above": two choices past the experts (LongCat's zero experts), left out of every bin
        self.router = nn.Linear(HIDDEN, EXPERTS + 2 * (mix in ("above", "zero-experts", "fold-below")), bias=False)
        self.experts = Experts(mix)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        x = h.reshape(-1, HIDDEN)
        weights, index = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        return self.head(h + self.experts(x, index, weights, ids).view(h.shape))


def _loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _compile(mix: str, plan: str = "dp=2"):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 8))
    return compile_program(TinyMoE(mix), (ids,), {}, plan, _loss, world_size=2)


@pytest.mark.parametrize("mix,plan", [("", "dp=2"), ("", "dp=2,mb=2"), ("loop", "dp=2"),
                                      ("above", "dp=2"), ("one-bin", "dp=2"), ("zero-experts", "dp=2"),
                                      ("noise", "dp=2")])
def test_a_per_token_experts_region_is_proven_and_kept_as_traced(mix, plan):
    traced, _ = _compile(mix, plan)
    targets = {n.target for n in traced.gm.graph.nodes if n.op == "call_function"}
    # the region runs as traced on the rank's tokens: no rewrite, no collective inside it
    glue = {torch.ops.aten.where.default, torch.ops.aten.index_add.default} if mix == "loop" else \
        {torch.ops.aten.sort.default, torch.ops.aten.histc.default, torch.ops.aten.index_put_.default}
    assert glue <= targets


@pytest.mark.parametrize("mix,node,found", [
    ("escape", "view", r"placed Regrouped\(0, by sort\)"),
    ("prefix", "cumsum_1", r"placed Regrouped\(0, by sort\)"),
    ("positions", "mul_1", r"placed Regrouped\(0, by sort\)"),
    ("lookup", "cumsum", r"does not prove at least the start of its range \[0, 3\]"),
    ("below", "cumsum", r"does not prove at least the start of its range \[1, 3\]"),
    ("fold-below", "cumsum", r"does not prove at least the start of its range \[0, 3\]"),
    ("loop-slot", "index_add", r"placed Regrouped\(0, by where\)"),
    ("noise-sorted", "rand_like", r"draws random numbers for rows placed Regrouped\(0, by sort\), this rank's "
                                  r"tokens in a rank-local order"),
])
def test_a_region_that_mixes_the_ranks_tokens_is_refused(mix, node, found):
    with pytest.raises(AutoparError) as info:
        _compile(mix)
    message = str(info.value)
    assert message.startswith(f"autopar: cannot shard node '{node}'"), message
    assert "in module 'model.experts' (Experts)" in message and "test_token_order.py" in message, message
    assert "on mesh axis 'dp'" in message and re.search(found, message), message


class Checked(nn.Module):
    """XLM's input check: the longest row of the batch must fit the sequence."""

    def __init__(self, use: str):
        super().__init__()
        self.use = use
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        lengths = (ids >= 0).sum(1)
        longest = lengths.max()
        h = self.embed(ids)
        if self.use == "check":
            torch._check(longest.item() <= ids.shape[1])
        else:  # the batch's longest row scales every row: a rank's own maximum is not it
            h = h * longest
        return self.head(h)


@pytest.mark.parametrize("use", ["check", "scale"])
def test_a_batch_maximum_only_checked_is_the_ranks_own(use):
    ids = torch.randint(0, VOCAB, (4, 8))
    if use == "check":
        compile_program(Checked(use), (ids,), {}, "dp=2", _loss, world_size=2)
        return
    with pytest.raises(AutoparError, match=r"autopar: cannot shard node 'max(_\d+)?'.*on mesh axis 'dp'"):
        compile_program(Checked(use), (ids,), {}, "dp=2", _loss, world_size=2)


class LanguageAdapters(nn.Module):
    """X-MOD's adapters: each sample's rows through the adapter of its language, picked by a
    boolean mask over the batch (``h[lang == k]``, written back with ``out[lang == k] = ...``)."""

    def __init__(self, mix: str):
        super().__init__()
        self.mix = mix
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.adapters = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        lang = ids[:, 0] % 2
        out = torch.zeros_like(h)
        for k, adapter in enumerate(self.adapters):
            mask = lang == k
            picked = adapter(h[mask])
            if self.mix == "prefix":  # a running sum over the picked samples: they mix across ranks
                picked = picked.cumsum(0)
            out[mask] = picked
        return self.head(h + out)


@pytest.mark.parametrize("mix", ["", "prefix"])
def test_rows_picked_by_a_boolean_mask_are_the_ranks_own(mix):
    ids = torch.randint(0, VOCAB, (4, 8))
    if not mix:
        compile_program(LanguageAdapters(mix), (ids,), {}, "dp=2", _loss, world_size=2)
        return
    with pytest.raises(AutoparError, match=r"autopar: cannot shard node 'cumsum.*placed Regrouped\(0, by eq"):
        compile_program(LanguageAdapters(mix), (ids,), {}, "dp=2", _loss, world_size=2)
