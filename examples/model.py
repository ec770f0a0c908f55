"""A small Llama-style decoder language model in plain PyTorch, used by the examples and tests.

Nothing here knows about autopar: it is the kind of model a user hands to
``autopar.parallelize`` unchanged. It has the structures the analysis
(``autopar/frontend/analyze.py``) must recognise: RMSNorm modules, rotary embeddings whose
position ids are built inside ``forward`` with ``torch.arange`` over the sequence
length, grouped-query attention by expanding K/V, a SwiGLU MLP, optionally fused
q/k/v and gate/up projections, and a tied or untied LM head.  With ``num_experts > 0``
the MLP of every layer is a mixture of experts (:class:`MoE`): a linear router, top-k
selection, and a ``ModuleList`` of SwiGLU experts run on the tokens routed to them.
Optional dropout (``hidden_dropout``, ``attention_dropout``, ``mlp_dropout``; none by
default, and then no dropout op in the graph) covers replicated and tp-sharded regions.

``tests/support/models.py`` builds it (and a tiny Hugging Face Llama) for the test suite;
``examples/train_llama.py`` trains it; ``autopar inspect examples/model.py:build_tiny`` (or
``build_tiny_moe``)
prints its parallel program.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DecoderConfig",
    "RMSNorm",
    "Attention",
    "MLP",
    "MoE",
    "DecoderLayer",
    "Decoder",
    "lm_loss",
    "make_batch",
    "build_tiny",
    "build_tiny_moe",
]


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Sizes and options of :class:`Decoder`. ``head_dim = hidden_size // num_heads``."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    num_experts: int = 0  # > 0: every layer's MLP is a mixture of experts
    top_k: int = 2
    softmax_before_topk: bool = True  # else: top-k of the logits, softmax over the k chosen
    normalize_topk: bool = True  # renormalise the top-k weights to sum to 1 (softmax first only)
    router_bias: tuple[float, ...] | None = None  # fixed logit offsets per expert (skewed routing)
    # Dropout in train mode (0: none, and no dropout op in the graph): on the embedding output
    # and each residual branch (Megatron's hidden dropout), on the attention probabilities,
    # and on the MLP's hidden activations before the down projection (as T5 does).
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    mlp_dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"DecoderConfig: hidden_size {self.hidden_size} is not a multiple of "
                f"num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DecoderConfig: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"DecoderConfig: top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.router_bias is not None and len(self.router_bias) != self.num_experts:
            raise ValueError(f"DecoderConfig: router_bias needs {self.num_experts} entries, got {len(self.router_bias)}")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig: rotary embeddings need an even head_dim, got {self.head_dim}")
        for name in ("hidden_dropout", "attention_dropout", "mlp_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"DecoderConfig.{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in float32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """``F.dropout`` when ``p > 0`` (so a model without dropout has no dropout op at all)."""
    return F.dropout(x, p, training) if p > 0 else x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, S, head_dim]; cos/sin: [S, head_dim], broadcast over batch and heads.
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with rotary embeddings and grouped-query K/V."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        if cfg.fused_qkv:
            self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
            self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
            self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.attention_dropout = cfg.attention_dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _apply_rotary(q, cos, sin)
        k = _apply_rotary(k, cos, sin)
        # Grouped-query attention: each KV head serves num_heads // num_kv_heads query heads.
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            k = k.unsqueeze(2).expand(batch, self.num_kv_heads, group, seq, self.head_dim)
            k = k.reshape(batch, self.num_heads, seq, self.head_dim)
            v = v.unsqueeze(2).expand(batch, self.num_kv_heads, group, seq, self.head_dim)
            v = v.reshape(batch, self.num_heads, seq, self.head_dim)
        p = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **({"dropout_p": p} if p > 0 else {}))
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        if cfg.fused_gate_up:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        else:
            self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
            self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.dropout = cfg.mlp_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_dropout(F.silu(gate) * up, self.dropout, self.training))


class MoE(nn.Module):
    """Mixture of experts: ``sum_k w[t, k] * expert[idx[t, k]](x[t])`` over the top-k experts.

    The experts are a ``ModuleList`` of :class:`MLP` and each runs only on the tokens
    routed to it (a loop with data-dependent token counts, as many MoE codebases write it).
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.softmax_before_topk, self.normalize_topk = cfg.softmax_before_topk, cfg.normalize_topk
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg) for _ in range(cfg.num_experts))
        bias = torch.tensor(cfg.router_bias or [0.0] * cfg.num_experts)
        self.register_buffer("router_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(-1, shape[-1])
        logits = self.router(x) + self.router_bias
        if self.softmax_before_topk:
            weights, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
            if self.normalize_topk:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            values, index = torch.topk(logits, self.top_k, dim=-1)
            weights = values.softmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            routed = expert(x[token]) * weights[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, routed)
        return out.view(shape)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)
        self.dropout = cfg.hidden_dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + _dropout(self.attn(self.input_norm(x), cos, sin), self.dropout, self.training)
        return x + _dropout(self.mlp(self.post_attn_norm(x)), self.dropout, self.training)


class Decoder(nn.Module):
    """Decoder-only language model: ``forward(input_ids [B, S]) -> logits [B, S, V]``.

    Weights are drawn from the global RNG, so ``torch.manual_seed(s)`` before
    construction makes them deterministic.
    """

    def __init__(self, config: DecoderConfig | None = None):
        super().__init__()
        cfg = config if config is not None else DecoderConfig()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        )
        # Derived from the config, so it is not part of the state dict.
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        # Positions are built here from the sequence length, so a traced graph has a
        # position-dependent subgraph (what context parallelism must rewrite).
        positions = torch.arange(seq, device=input_ids.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)
        x = _dropout(self.embed_tokens(input_ids), self.config.hidden_dropout, self.training)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_batch(vocab_size: int, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int64 tokens ``(input_ids, target)``, target = the input shifted left by one."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=gen, dtype=torch.int64)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build_tiny() -> tuple[Decoder, tuple[torch.Tensor]]:
    """The default tiny model and an example batch (4 x 16), for ``autopar inspect``."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig())
    input_ids, _ = make_batch(model.config.vocab_size, batch=4, seq=16, seed=0)
    return model, (input_ids,)


def build_tiny_moe() -> tuple[Decoder, tuple[torch.Tensor]]:
    """The tiny model with a 4-expert top-2 MoE in every layer, for ``autopar inspect``."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(num_experts=4, top_k=2, intermediate_size=64))
    input_ids, _ = make_batch(model.config.vocab_size, batch=4, seq=16, seed=0)
    return model, (input_ids,)
