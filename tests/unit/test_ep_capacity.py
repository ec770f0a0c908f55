"""MoE capacity factor (``capacity=F``) in one process: token dropping with residual pass-through.

Dropping is a semantic change, so the unparallelized model is not the reference.  Instead
the compiled program equals the example model whose MoE is rewritten here, independently,
to drop the pairs beyond ``ceil(F * T * k / E)`` per expert in token order (loss and every
gradient).  That expert parallelism does not change what is dropped, and that a capacity no
expert reaches is dropless, is tested on 2 ranks in tests/dist/test_ep_capacity.py.
"""
from __future__ import annotations

import math
import types

import torch

from autopar.runtime import compile_program
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

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
