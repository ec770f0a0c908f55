"""A tiny sampling-router MoE and its per-rank job, for the random-draw tests.

Not a test module.  :class:`SamplingMoE` routes as PhiMoE's sparse mixer does in train mode, with
random numbers drawn from the default generator for every token: input jitter
(``empty_like(h).uniform_``), each slot's expert picked by a Gumbel max over the router's scores
(``empty_like(scores).exponential_()``, the second slot with the first expert masked out), the
picks' indices concatenated into ``[T, 2]`` ids (no top-k), and a per-token weight chosen by a
``rand_like`` coin; its stacked experts run on the tokens sorted by expert (a grouped matmul, as
transformers 5.x writes Mixtral's).  :func:`train_job` trains it under a plan from the default
generator seeded alike on every rank (``sources.seeded_steps``, as verify and the zoo seed) and
returns the losses, the full state dict and what its program holds; :func:`reference` is one
device's run.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import autopar
from autopar.verification.sources import seeded_steps
from tests.support.harness import OPTIMIZERS, make_batches

__all__ = ["SamplingMoE", "loss_fn", "build", "batches", "reference", "train_job", "VOCAB", "HIDDEN", "EXPERTS"]

VOCAB, HIDDEN, WIDTH, EXPERTS = 32, 16, 8, 4
BATCH, SEQ, STEPS, STEP_SEED = 4, 8, 3, 7


class SamplingMoE(nn.Module):
    """``mix``: ``"sample"`` (the random draws above) or ``"max"`` (the same routing without noise)."""

    def __init__(self, mix: str = "sample"):
        super().__init__()
        from transformers.integrations import moe as _hf_moe  # noqa: F401  (registers grouped_mm_fallback)

        self.mix = mix
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH) / HIDDEN ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) / WIDTH ** 0.5)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def noise(self, x: torch.Tensor) -> torch.Tensor:
        """Gumbel noise shaped like ``x`` (none for ``"max"``)."""
        if self.mix != "sample":
            return torch.zeros_like(x)
        return torch.empty_like(x).exponential_().log()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.router(x)
        first = (scores - self.noise(scores)).max(dim=-1)[1].unsqueeze(-1)
        masked = scores.scatter(-1, first, float("-inf"))
        second = (masked - self.noise(masked)).max(dim=-1)[1].unsqueeze(-1)
        index = torch.cat([first, second], dim=-1)
        weights = scores.softmax(-1).gather(-1, index)
        if self.mix == "sample":  # a coin per token: its weights kept whole or halved
            weights = weights * (0.5 + 0.5 * (torch.rand_like(weights[:, :1]) > 0.3).to(weights.dtype))
        return weights, index

    def experts(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        keys, perm = index.reshape(-1).sort()
        rows = x[perm // 2]
        offsets = torch.histc(keys.float(), bins=EXPERTS, min=0, max=EXPERTS - 1).cumsum(0, dtype=torch.int32)
        h = nn.functional.silu(torch.ops.transformers.grouped_mm_fallback(rows, self.up, offsets))
        out = torch.ops.transformers.grouped_mm_fallback(h, self.down, offsets)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        return out[inverse].view(-1, 2, HIDDEN).sum(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.mix == "sample":  # input jitter, per element of every token
            h = h * torch.empty_like(h).uniform_(0.9, 1.1)
        x = h.reshape(-1, HIDDEN)
        weights, index = self.route(x)
        return self.head(h + self.experts(x, index, weights).view(h.shape))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def build(mix: str = "sample") -> SamplingMoE:
    torch.manual_seed(0)
    return SamplingMoE(mix)


def batches():
    return make_batches(VOCAB, BATCH, SEQ, STEPS, seed=1)


def reference(mix: str = "sample", step_seed: int = STEP_SEED) -> tuple[list[float], dict]:
    """One device's run: the losses and the state dict after the steps."""
    model = build(mix)
    opt = OPTIMIZERS["sgd"](model.parameters())
    losses = []
    with seeded_steps(step_seed):
        for inputs, target in batches():
            opt.zero_grad()
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_job(plan: str, mix: str = "sample") -> dict:
    """This rank's run under ``plan``: its losses, the full state dict, and how many draws were made
    for the whole batch (``autopar.ops.draws.rows_draw`` nodes of the program)."""
    from autopar.ops import draws, moe

    data = batches()
    pm = autopar.parallelize(build(mix), example_inputs=data[0][0], plan=plan, loss_fn=loss_fn,
                             optimizer=OPTIMIZERS["sgd"])
    with seeded_steps(STEP_SEED):
        losses = [float(pm.train_step(inputs, target)) for inputs, target in data]
    return {"losses": losses, "state": {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()},
            "rows_draws": sum(n.target is draws.rows_draw for n in pm.gm.graph.nodes),
            "dispatches": sum(n.target is moe.moe_dispatch for n in pm.gm.graph.nodes)}
