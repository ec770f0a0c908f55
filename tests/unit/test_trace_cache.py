"""The suite's trace cache (tests/support/trace_cache.py): a hit is the program a fresh export gives.

A hit must be the same graph bound to the new model's own tensors (so values, aliasing and
"the user's model is never mutated" are tested as without the cache), and anything the
export can see must change the key.
"""
from __future__ import annotations

import torch

from autopar.frontend import trace
from tests.support import trace_cache
from tests.support.jobs import BATCH, SEQ, VOCAB, build
from tests.support.reference import make_batches


def _trace(model, kwargs, loss_fn, ids, fresh=False):
    if fresh:
        return trace.export_model(model, (ids,), kwargs, loss_fn)
    return trace_cache.memo(trace.export_model, model, (ids,), kwargs, loss_fn)


def test_a_hit_is_the_fresh_program_bound_to_the_new_model():
    (ids,), target = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)[0]
    first, loss_fn, kwargs = build("example", {"num_layers": 3})
    _trace(first, kwargs, loss_fn, ids)  # stored (or already stored by an earlier test)
    second, _, _ = build("example", {"num_layers": 3}, seed=7)  # other values, same structure
    hits = trace_cache.STATS["hits"]
    hit = _trace(second, kwargs, loss_fn, ids)
    assert trace_cache.STATS["hits"] == hits + 1
    fresh = _trace(second, kwargs, loss_fn, ids, fresh=True)
    assert hit.gm.code == fresh.gm.code
    own = {id(t) for t in list(second.parameters()) + list(second.buffers())}
    assert all(id(p) in own for p in hit.gm.parameters())
    assert all(id(b) in own for b in hit.gm.buffers())
    assert torch.equal(hit.gm(ids, target), fresh.gm(ids, target))


def test_what_the_export_sees_changes_the_key():
    model, loss_fn, kwargs = build("example", {})
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    base = trace_cache._call_key(model, (ids,), kwargs, loss_fn, None, False, True)
    assert base == trace_cache._call_key(build("example", {}, seed=3)[0], (ids,), kwargs, loss_fn, None, False, True)
    model.eval()
    assert trace_cache._call_key(model, (ids,), kwargs, loss_fn, None, False, True) != base
    model.train()
    assert trace_cache._call_key(model, (ids,), kwargs, loss_fn, None, False, True) == base
    other = trace_cache._call_key(build("example", {"num_layers": 3})[0], (ids,), kwargs, loss_fn, None, False, True)
    assert other != base
    longer = torch.zeros(BATCH, SEQ + 1, dtype=torch.long)
    assert trace_cache._call_key(model, (longer,), kwargs, loss_fn, None, False, True) != base
    mask = {"mask": torch.ones(2)}
    assert (trace_cache._call_key(model, (ids,), mask, loss_fn, None, False, True)
            != trace_cache._call_key(model, (ids,), {"mask": torch.zeros(2)}, loss_fn, None, False, True))
    assert trace_cache._call_key(model, (ids,), kwargs, loss_fn, None, True, True) != base
    model.register_buffer("extra", torch.zeros(3))
    assert trace_cache._call_key(model, (ids,), kwargs, loss_fn, None, False, True) != base


def test_a_module_held_as_a_plain_attribute_is_keyed_by_its_contents():
    """transformers >= 5.25 gives each attention its own wrapper module in a plain dict
    attribute: two builds of one model share a key, a wrapper's attribute changes it."""
    from tests.support.models import hf_llama

    first, second = hf_llama(num_hidden_layers=2), hf_llama(num_hidden_layers=2, seed=3)
    wrapper = torch.nn.Module()
    first.model.layers[0].self_attn.__dict__["_kernel_funcs"] = {"rotary_pos_emb": wrapper}
    second.model.layers[0].self_attn.__dict__["_kernel_funcs"] = {"rotary_pos_emb": torch.nn.Module()}
    assert trace_cache.model_key(first) == trace_cache.model_key(second)
    wrapper.scale = 2.0
    assert trace_cache.model_key(first) != trace_cache.model_key(second)


def test_the_attention_implementation_changes_the_key():
    """transformers' ``config.to_dict()`` leaves ``_attn_implementation`` out; eager and SDPA
    attention trace to different graphs, so the key holds it."""
    from tests.support.models import hf_llama

    sdpa, eager = hf_llama(), hf_llama(attn_implementation="eager")
    assert eager.config._attn_implementation == "eager" and sdpa.config._attn_implementation == "sdpa"
    assert trace_cache.model_key(sdpa) != trace_cache.model_key(eager)


def test_the_memo_is_explicit_and_scoped():
    """trace_model asks a memo only inside trace_memo's block, whatever module it was imported
    into (nothing is patched), and never after the block."""
    from autopar.passes import compile as compile_module  # imports trace_model by name

    calls = []

    def counting(export, *args):
        calls.append(args[0])
        return export(*args)

    (ids,), _ = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)[0]
    model, loss_fn, kwargs = build("example", {})
    with trace.trace_memo(counting):
        compile_module.trace_model(model, (ids,), kwargs, loss_fn)
        trace.trace_model(model, (ids,), kwargs, loss_fn)
        with trace.trace_memo(lambda export, *args: "inner"):
            assert trace.trace_model(model, (ids,), kwargs, loss_fn) == "inner"
    assert calls == [model, model]
    assert compile_module.trace_model is trace.trace_model



def test_the_cache_keeps_no_model_tensor_alive():
    """The stored graph holds meta stand-ins, never the first model's tensors: the peak-memory
    jobs (tests/support/peak_jobs.py) meter the allocator with the cache on."""
    import weakref

    (ids,), _ = make_batches(VOCAB, BATCH, SEQ, 1, seed=1)[0]
    model, loss_fn, kwargs = build("example", {"num_layers": 5})
    _trace(model, kwargs, loss_fn, ids)
    refs = [weakref.ref(t) for t in list(model.parameters()) + list(model.buffers())]
    del model
    import gc
    gc.collect()
    assert all(r() is None for r in refs), "the cache holds a model's tensor"
    stored = [entry for entry in trace_cache._CACHE.values()]
    assert all(t.device.type == "meta" for pristine, _, _ in stored
               for t in list(pristine.parameters()) + list(pristine.buffers()))
