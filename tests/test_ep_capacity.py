"""MoE capacity factor (``capacity=F``): token dropping with residual pass-through.

Dropping is a semantic change, so the unparallelized model is not the reference.  Instead:
- in one process, the compiled program equals the example model whose MoE is rewritten
  here, independently, to drop the pairs beyond ``ceil(F * T * k / E)`` per expert in token
  order (loss and every gradient);
- on 2 ranks, expert parallelism does not change what is dropped: ``ep=2,dp=2`` trains
  exactly like ``dp=2`` with the same capacity (each rank applies it to its own tokens, as
  Megatron-Core does);
- a capacity no expert reaches is dropless: equivalent to the original model.
"""
from __future__ import annotations

import math
import types

import pytest
import torch

from autopar.runtime import compile_program
from tests.harness import make_batches
from tests.jobs import BATCH, SEQ, VOCAB, build, train_job
from tests.test_equivalence import _check

FACTOR = 0.5


def _dropping_forward(self, x):
    shape = x.shape
    x = x.view(-1, shape[-1])
    weights, index = torch.topk((self.router(x) + self.router_bias).softmax(dim=-1), self.top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    capacity = math.ceil(FACTOR * x.shape[0] * self.top_k / self.num_experts)
    out = torch.zeros_like(x)
    for e, expert in enumerate(self.experts):
        token, slot = torch.where(index == e)  # row-major: token order, then slot
        token, slot = token[:capacity], slot[:capacity]
        out = out.index_add(0, token, expert(x[token]) * weights[token, slot].unsqueeze(-1))
    return out.view(shape)


def test_capacity_drops_the_overflow_like_a_hand_written_moe():
    model, loss_fn, _ = build("example_moe", {})
    (inputs, target), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    traced, _ = compile_program(model, inputs, {}, f"capacity={FACTOR}", loss_fn, world_size=1)
    reference, _, _ = build("example_moe", {})
    for layer in reference.layers:
        layer.mlp.forward = types.MethodType(_dropping_forward, layer.mlp)
    want = loss_fn(reference(*inputs), target)
    want.backward()
    got = traced.gm(*inputs, target)
    got.backward()
    assert abs(got.item() - want.item()) < 1e-6
    ref_grads = dict(reference.named_parameters())
    for name, p in traced.gm.named_parameters():
        expected = ref_grads[name.removeprefix("model.")].grad
        assert torch.allclose(p.grad, expected, atol=1e-6, rtol=1e-5), name
    dropless = loss_fn(build("example_moe", {})[0](*inputs), target)
    assert abs(dropless.item() - want.item()) > 1e-4  # tokens really were dropped


def test_ep_does_not_change_what_capacity_drops(dist_pool):
    plan = f"dp=2,capacity={FACTOR}"
    local = dist_pool(train_job, "example_moe", plan, "sgd", {}, world=2)
    expert_parallel = dist_pool(train_job, "example_moe", "ep=2," + plan, "sgd", {}, world=2)
    assert expert_parallel[0]["losses"] == pytest.approx(local[0]["losses"], abs=1e-6)
    for key, value in local[0]["state"].items():
        assert torch.allclose(expert_parallel[0]["state"][key], value, atol=1e-6), key


def test_capacity_no_expert_reaches_is_dropless(dist_pool):
    _check(dist_pool, "example_moe", "ep=2,dp=2,capacity=4", 2, "sgd", overrides={})
