"""cost/buckets.py's counts against the definition in its docstring, written out with sets.

``bucket_counts`` packs the runs once per (tp, ep) and counts with numpy (the search asks it for
thousands of layouts); here every pipeline layout is counted the slow way: the runs ``B_k`` of
backward's order, the tensors ``H_r`` a pp rank holds (its chunks', the tied table on the first and
the last chunk's ranks), ``n_b(r) = #{k : B_k ∩ H_r ≠ ∅}``, ``n_u(r) = Σ_k #{owner chunk of j in
B_k ∩ H_r}`` and the largest bucket a rank holds, in elements.
"""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar.cost import ModelSpec
from autopar.cost.buckets import EMBEDDING, HEAD, bucket_counts, param_tensors
from autopar.cost.pipeline import place_layers
from autopar.plan_space import SCHEDULES, chunk_rank, chunks_per_rank, pack_buckets


def _by_definition(spec, *, tp, ep, pp, schedule, vpp, head_layers, param_bytes, bucket_bytes):
    num_chunks = pp * chunks_per_rank(schedule, vpp) if pp > 1 else 1
    layer_chunk = [c for c, n in enumerate(place_layers(spec.num_layers, num_chunks, round(head_layers, 3)))
                   for _ in range(n)]
    rank = (lambda c: chunk_rank(c, pp, schedule)) if pp > 1 else (lambda c: 0)
    tensors = []
    for j, (elems, where, expert) in enumerate(param_tensors(spec, tp, ep)):
        chunk = 0 if where == EMBEDDING else num_chunks - 1 if where == HEAD else layer_chunk[where]
        holders = {rank(chunk)} | ({rank(num_chunks - 1)} if j == 0 and spec.tied_embeddings else set())
        tensors.append((elems, chunk, holders, expert))
    out = {r: {"dense": 0, "dense_units": 0, "expert": 0, "expert_units": 0, "dense_largest": 0.0}
           for r in range(pp)}
    for expert, kind in ((False, "dense"), (True, "expert")):
        order = [t for t in reversed(tensors) if t[3] == expert]
        for run in pack_buckets([t[0] * param_bytes for t in order], bucket_bytes):
            members = [order[i] for i in run]
            for r in range(pp):
                held = [t for t in members if r in t[2]]
                if not held:
                    continue
                out[r][kind] += 1
                out[r][kind + "_units"] += len({t[1] for t in held}) if pp > 1 else 1
                if not expert:
                    out[r]["dense_largest"] = max(out[r]["dense_largest"], float(sum(t[0] for t in held)))
    return [out[r] for r in range(pp)]


SPECS = [dataclasses.replace(ModelSpec.preset("llama3-8b"), num_layers=6),
         dataclasses.replace(ModelSpec.preset("llama3-8b"), num_layers=7, tied_embeddings=True, vocab=32001),
         dataclasses.replace(ModelSpec.preset("mixtral-8x7b"), num_layers=6)]


def _layouts():
    for pp, schedule in itertools.product((1, 2, 3), SCHEDULES):
        if pp == 1 and schedule != "1f1b":
            continue
        yield from ((pp, schedule, vpp) for vpp in ((2,) if schedule in ("zbv", "dualpipev") else (2, 3)
                                                    if schedule == "interleaved" else (1,)))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}-{s.num_layers}")
def test_bucket_counts_follow_their_definition(spec):
    checked = 0
    for (pp, schedule, vpp), tp, ep, (param_bytes, bucket_bytes) in itertools.product(
            _layouts(), (1, 2), (1, 2) if spec.num_experts else (1,), ((2, 25 * 2**20), (4, 2**22))):
        if pp * (vpp if schedule != "1f1b" and schedule != "gpipe" else 1) > spec.num_layers:
            continue
        kw = dict(tp=tp, ep=ep, pp=pp, schedule=schedule, vpp=vpp, head_layers=0.37, param_bytes=param_bytes,
                  bucket_bytes=bucket_bytes)
        got = [dataclasses.asdict(c) for c in bucket_counts(spec, **kw)]
        assert got == _by_definition(spec, **kw), kw
        checked += 1
    assert checked >= 20
