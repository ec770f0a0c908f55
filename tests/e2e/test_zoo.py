"""The CI subset of the zoo sweep: a few dozen (model type, plan) pairs keep the outcome recorded.

benchmarks/zoo.py trains every causal LM type of transformers, shrunk from its default config,
under four plans on 2 gloo ranks against one process, and docs/zoo.md is its table.  This file
runs the same code (``benchmarks.zoo_engine.run_types``: the same shrinking, batches, reference and
comparison) on pairs chosen to cover the classes of architecture -- dense GQA, multi-query
attention, mixtures of experts, sliding windows, ALiBi, Conv1D weights, parallel attention and
MLP, tied heads, an encoder used as a causal LM, a linear-attention mixer, state-space and hybrid
models
-- a handful of model types per pool call on the session's pooled gloo workers
(tests/support/harness.py), and checks that each pair's outcome is the one the sweep recorded:
``equal`` stays equal, ``refused`` stays refused (with an ``autopar:`` message) and nothing
fails.  Only pairs that pass are listed; :data:`EXPECTED` is the data.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from benchmarks.zoo_engine import run_types  # noqa: E402
from tests.support.harness import JobTimeout, RankError, run_distributed  # noqa: E402

E, R, T = "equal", "refused", "refused (trace)"
# model type -> {plan: outcome, or (outcome, a phrase of the refusal)}, as the sweep recorded them.
EXPECTED: dict[str, dict[str, object]] = {
    # dense, grouped-query attention
    "llama": {"tp=2,sp": E, "cp=2:ring": E, "pp=2,mb=2": E},
    # multi-query attention: one KV head fused with the query heads in c_attn, whose KV rows tp keeps whole
    # (the odd vocabulary 50257 is padded)
    "gpt_bigcode": {"tp=2,sp": E, "cp=2:ring": E},
    # 5 KV heads, which tp=2 does not divide: replicated on both ranks (KV-head replication)
    "bitnet": {"tp=2,sp": E},
    # mixtures of experts: stacked experts; shared experts
    "mixtral": {"tp=2,sp": E, "pp=2,mb=2": E},
    "qwen2_moe": {"dp=2,zero=3": E},
    "qwen3_moe": {"tp=2,sp": E, "cp=2:ring": E},
    # experts run as traced under dp, their routing proven per token (passes/token_order.py): GPT-OSS
    # (expert biases gathered by the sorted expert ids; sliding windows of 16 below the sequence);
    # under tp and ep the rewritten experts carry the biases, read at each row's local expert id
    "gpt_oss": {"dp=2,zero=3": E, "tp=2,sp": E, "dp=2,ep=2": E},
    # PhiMoE's train-mode router samples experts (Gumbel noise: exponential_ on the rank's rows): each dp
    # rank draws the whole batch's noise and keeps its rows; its slots are max picks (no top-k), found
    # as a routing from the ids' dataflow, so ep splits its experts
    "phimoe": {"dp=2,zero=3": E, "dp=2,ep=2": E},
    # LongCat's zero experts: choices past the routed experts folded onto them by a where, whose keys
    # are ranged branch by branch; its router's top-k runs in torch.no_grad(), a graph of its own
    # placed node by node on the rank's sequence shard under cp; under tp and ep the rewrite sorts by
    # the folded ids (the routing found inside the no_grad region)
    "longcat_flash": {"dp=2,zero=3": E, "cp=2:ring": E, "tp=2,sp": E, "dp=2,ep=2": E},
    # an input check over the batch (XLM's assert lengths.max() <= slen): each rank checks its rows;
    # under tp its scores are masked in place (masked_fill_ keeps its destination's placement)
    "xlm": {"dp=2,zero=3": E, "tp=2,sp": E},
    # DeepSeek-V2's rotary through complex numbers (view_as_complex of the rank's heads)
    "deepseek_v2": {"tp=2,sp": E},
    # sliding-window attention: the mask proven a causal window, which ring attention applies by
    # position, skipping the blocks out of every query's window (cohere2: windowed and full layers)
    "mistral": {"tp=2,sp": E, "cp=2:ring": E},
    "cohere2": {"tp=2,sp": E, "cp=2:ring": E},
    # Llama 4's chunked attention: neither causal nor a window, so under cp it runs whole over the
    # gathered sequence (passes/cp_cores.py); its dense experts (every expert on every token, the tokens
    # repeated per expert) run as traced on token shards, the repeat the rank's share of every copy;
    # under ep each rank runs its experts on the ep group's gathered tokens, the sums reduce-scattered
    "llama4_text": {"cp=2:ring": E, "tp=2,sp": E, "dp=2,ep=2": E},
    # top-1 routing (HunYuan-MoE): the sorted expert rows are [tokens, hidden] like the block's output,
    # which is where the rows go back to token order
    "hunyuan_v1_moe": {"tp=2,sp": E},
    # a row per (token, slot) routed with unit weights, weighted after the experts (Ergo); under tp its
    # attention's fused projection is split by sizes, which tp refuses
    "ergo": {"dp=2,ep=2": E},
    # experts split by per-expert counts, one weight slice per chunk (JetMoE's MLP), split over ep;
    # its attention experts (halves around attention) stay whole on every rank under ep
    "jetmoe": {"dp=2,ep=2": E},
    # 7 experts (5 shrunk) over ep=2: the last rank's stacked experts padded with a zero expert
    "flex_olmo": {"dp=2,ep=2": E},
    # (DeepSeek-V4's hash routing, equal under dp=2,ep=2 in the sweep, is in tests/dist/test_hash_routing.py:
    # its shrunk model is the slowest of the zoo to build and trace)
    # eager attention under cp, run whole over the gathered sequence, its mask built again at the
    # global length: soft-capped scores (Gemma 2), ALiBi (MPT), a relative position embedding projected
    # by a weight (XLNet), a rotary table indexed by positions (GPT-J), and a sparse-attention indexer
    # whose keys are copied into an empty tensor in place before the attention reads them (Dots3: the
    # gather must follow the writes, or the attention reads the empty tensor)
    "gemma2": {"cp=2:ring": E},
    "mpt": {"cp=2:ring": E},
    # XLNet's projections are einsums with [h, n, d] parameters (columns and a row split by heads);
    # its relative position encoding enters the attention replicated
    "xlnet": {"cp=2:ring": E, "tp=2,sp": E, "tp=2": E},
    "gptj": {"tp=2,sp": E, "cp=2:ring": E},
    "dots3_note_text": {"tp=2,sp": E, "cp=2:ring": E},
    # tied input and output embeddings
    "gemma": {"tp=2,sp": E, "dp=2,zero=3": E},
    # Conv1D weights ([in, out], addmm); the full-size vocabulary 50257 is odd: padded to 2 x 25129 rows
    "gpt2": {"dp=2,zero=3": E, "pp=2,mb=2": E, "tp=2,sp": E},
    # parallel attention and MLP
    "phi": {"tp=2,sp": E},
    "gpt_neox": {"cp=2:ring": E},
    "falcon": {"cp=2:ring": E, "tp=2,sp": (R, "does not divide the 71 attention heads")},
    # ALiBi: eager attention with a bias over every head, the heads merged into the batch (under tp
    # the bias is cut at the rank's runs of heads); in train mode its GeLU is a custom
    # autograd.Function, run whole with its own backward (autopar/frontend/custom_functions.py),
    # placed from its traced ops
    "bloom": {"dp=2,zero=3": E, "pp=2,mb=2": E, "tp=2,sp": E},
    # RecurrentGemma bounds a square root's derivative in a custom autograd.Function
    "recurrent_gemma": {"dp=2,zero=3": E},
    # Reformer's reversible layers: a Function handed the layer modules, whose parameters it reads
    "reformer": {"dp=2,zero=3": (R, "it is handed the module")},
    # decoder layers that flatten batch and sequence: SP's collectives split the merged dim back out
    "opt": {"tp=2,sp": E},
    # an encoder built as a causal LM
    "bert": {"tp=2,sp": E},
    # Gemma 4's per-layer inputs: a stream activation read inside the gate's region
    # (gate(h) * per_layer_input), entered like the columns' input (gathered under SP)
    "gemma4_text": {"tp=2,sp": E},
    # an LM head from a width other than the embedding's (RemBERT's decoupled output embedding), found
    # by the loss reading its logits: the MLM transform before it runs on sequence shards
    "rembert": {"tp=2,sp": E},
    # state-space mixers split by channels (Mamba: its scan loops over the positions, so the sequence
    # is traced at a fixed length, found by SP by its size; x_proj a row read again in the mixer) and
    # by heads (Mamba-2 in Falcon-H1: z|x|B|C|dt part by part, B and C whole on every rank, a length
    # padded to whole chunks); hybrids with attention and experts (Jamba)
    "mamba": {"tp=2,sp": E},
    "jamba": {"dp=2,zero=3": E, "tp=2,sp": E},
    "falcon_h1": {"dp=2,zero=3": E, "tp=2,sp": E, "cp=2:ring": E},
    # Zamba2's hybrid layer: its own linear on the shared transformer's output (no region) and its
    # Mamba-2 mixer (a region of its own); LoRA adapters on the shared MLP's fused gate_up
    "zamba2": {"tp=2,sp": E, "tp=2": E},
    # HRM's recurrent blocks: each call of a module a region of its own
    "hrm_text": {"tp=2,sp": E},
    # a linear-attention mixer (Qwen3-Next's gated delta net) split by heads: q|k|v concatenated and
    # convolved per channel laid out by blocks, its recurrence per head; under cp the mixer (its
    # convolution and chunked scan) runs whole over the gathered sequence
    "qwen3_next": {"dp=2,zero=3": E, "tp=2,sp": E, "cp=2:ring": E},
    # a short convolution (LFM3): in_proj fused B|C|x, transposed to channels first before its chunk
    "lfm3": {"tp=2,sp": E},
    # Qwen3.5's gated delta net: in_proj_qkv's parts split after its depthwise convolution, the gated
    # norm's rows viewed back to [b, s, heads * head_dim]
    "qwen3_5_text": {"tp=2,sp": E},
    # multi-head latent attention: the latents whole on every tp rank, the up-projections split by heads
    "deepseek_v3": {"tp=2,sp": E},
    # linears outside the layers (an embedding projection, a generator head) make no region
    "electra": {"tp=2,sp": E},
    # lightning attention: a state built with zeros over every head, met by the rank's heads; under cp
    # its blocks of min(256, s) positions run whole over the gathered sequence
    "minimax": {"tp=2,sp": E, "cp=2:ring": E},
    # xLSTM's chunked mLSTM under cp, run whole: export bounds its length below (s >= 32), which the
    # global batch meets and a cp rank's half does not (the runtime checks the global shapes)
    "xlstm": {"cp=2:ring": E},
    # interleaved rotary tables (cos.repeat_interleave(2, dim=-1)) on sequence shards
    "glm": {"cp=2:ring": E},
    # Moshi: gate and up stacked by a view (fc1(x).view(b, s, 2, -1), halves read by select), an LM head
    # one row narrower than the embedding table
    "moshi": {"tp=2,sp": E},
    # differential attention: value and output heads chunked into halves that pair head h with head
    # h + heads/2; q, k and v laid out by those head groups so each rank holds whole pairs
    "diffllama": {"tp=2,sp": E, "tp=2": E},
    # Dots3: MLA with a sparse-attention indexer under torch.no_grad(), whose hidden_states.to(dtype)
    # export routes the per-head gate's input through (read as the operand it is): above, with cp
    # a learned-scalar activation (XIELU: min / max of the input with learned scalars)
    "apertus": {"tp=2,sp": E},
    # a layer whose output crossing the pipeline cut is a strided view (made contiguous to be sent)
    "inkling2_text": {"pp=2,mb=2": E},
    # rotary over part of each head (q[..., :rotary_dim] of the per-head view): not parts of the weight
    # (gptj, above)
}

GROUP = 4  # model types per pool call


@pytest.fixture(scope="module")
def outcomes(dist_pool):
    """Every pair of :data:`EXPECTED`, run once for the module (``dist_pool``: shut down at the end)."""
    return run_types({t: list(plans) for t, plans in EXPECTED.items()}, group=GROUP, runner=run_distributed,
                     runner_errors=(RankError, JobTimeout))


PAIRS = [(t, p) for t, plans in EXPECTED.items() for p in plans]


@pytest.mark.parametrize("model_type,plan", PAIRS, ids=[f"{t}-{p}" for t, p in PAIRS])
def test_zoo_pair_keeps_its_outcome(outcomes, model_type, plan):
    expected = EXPECTED[model_type][plan]
    kind, phrase = expected if isinstance(expected, tuple) else (expected, None)
    got = outcomes[model_type][plan]
    detail = f"{got['outcome']}: {got.get('reason', '')} at {got.get('where')}"
    assert got["outcome"] == kind, detail
    if kind in (R, T):
        assert got["reason"].startswith("autopar:"), detail
        if phrase:
            assert phrase in got["reason"], detail
