"""A module's own linears and those of a module inside it with linears of its own (Zamba2's hybrid
layer: its ``linear`` on the shared transformer's output, then the Mamba mixer's ``in_proj`` and
``out_proj``) make separate regions: an inner module whose own linears make a region, one of whose
columns would be a row of the outer region, is left to its own (taken together, the mixer's
``in_proj`` would be a row-parallel projection of the outer ``linear``, and its ``out_proj`` a row
with no column before it).  A module called several times (HRM's recurrent blocks) makes a region
per call (``nn_module_stack`` keys its calls): taken together, the second call's columns would be
rows of the first's.  Zamba2 and HRM under ``tp=2,sp`` against one device: tests/e2e/test_zoo.py.
"""
from __future__ import annotations

import pytest
import torch.nn as nn
import torch.nn.functional as F

from autopar.frontend.analyze import analyze
from autopar.frontend.trace import trace_model
from autopar.runtime import compile_program
from tests.support.harness import make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build


class Mixer(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.out_proj(F.silu(self.in_proj(x)))


class HybridLayer(nn.Module):
    """Its own linear, then a mixer with linears of its own."""

    def __init__(self, hidden=32):
        super().__init__()
        self.linear, self.mixer = nn.Linear(hidden, hidden, bias=False), Mixer(hidden)

    def forward(self, h):
        return h + self.mixer(F.layer_norm(h + self.linear(h), (h.shape[-1],)))


class HybridDecoder(nn.Module):
    def __init__(self, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList([HybridLayer(hidden) for _ in range(2)])
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _inputs():
    (inputs, _), = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)
    return inputs


def test_the_inner_module_makes_its_own_region():
    _, loss_fn, _ = build("example", {})
    s = analyze(trace_model(HybridDecoder(), _inputs(), {}, loss_fn).gm)
    regions = {r.module.split("layers.0.")[-1]: ([c.module.rsplit(".", 1)[-1] for c in r.columns],
                                                 [w.module.rsplit(".", 1)[-1] for w in r.rows])
               for r in s.regions if "layers.0" in r.module}
    assert regions == {"mixer": (["in_proj"], ["out_proj"])}  # the layer's own linear: no region


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sp"])
def test_the_hybrid_layer_compiles_under_tp(plan):
    _, loss_fn, _ = build("example", {})
    _, program = compile_program(HybridDecoder(), _inputs(), {}, plan, loss_fn, world_size=2)
    layout = {name.split("layers.0.")[-1]: axes["tp"].dim for name, axes in program.param_shards.items()
              if "layers.0." in name and "tp" in axes and name.endswith("weight")}
    assert layout == {"mixer.in_proj.weight": 0, "mixer.out_proj.weight": 1}


class RecurrentDecoder(nn.Module):
    """One mixer called twice on the hidden states (HRM's recurrent blocks): a region per call."""

    def __init__(self, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.layers = nn.ModuleList([Mixer(hidden)])
        self.lm_head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for _ in range(2):
            h = h + self.layers[0](F.layer_norm(h, (h.shape[-1],)))
        return self.lm_head(h)


def test_a_module_called_twice_makes_a_region_per_call():
    _, loss_fn, _ = build("example", {})
    s = analyze(trace_model(RecurrentDecoder(), _inputs(), {}, loss_fn).gm)
    regions = [([c.module.rsplit(".", 1)[-1] for c in r.columns], [w.module.rsplit(".", 1)[-1] for w in r.rows])
               for r in s.regions]
    assert regions == [(["in_proj"], ["out_proj"])] * 2
    _, program = compile_program(RecurrentDecoder(), _inputs(), {}, "tp=2,sp", loss_fn, world_size=2)
    assert {n.split("layers.0.")[-1]: a["tp"].dim for n, a in program.param_shards.items()
            if "layers.0." in n and n.endswith("weight")} == {"in_proj.weight": 0, "out_proj.weight": 1}
