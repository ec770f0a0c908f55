"""The plan space: its one home.  Which plans exist, which are valid, which the runtime runs.

Everything that more than one part of autopar knows about plans is written here once:

* the option names (:data:`SCHEDULES`, :data:`CP_VARIANTS`, :data:`RECOMPUTE_MODES`,
  :data:`ZERO_STAGES`) and the integer plan encoding (:func:`encode` / :func:`decode`: a name
  is coded as its index in the tuple that lists it) that the cost model and the search store
  plans in;
* the mesh layout: :data:`MESH_AXES` ``pp x dp x cp x tp`` (outer to inner, tp fastest), the
  derived axes (``dp_cp``, ``ep``, ``edp``), their strides (:func:`axis_digits`,
  :func:`axis_geometry`) and rank groups (:func:`axis_groups`);
* every rule about which plans are valid and which the runtime runs, each one predicate:
  the rules of a plan alone (``Plan``'s construction), of a plan against a model and a run
  (:meth:`autopar.plan.Plan.validate`, the cost model, the search), of what the runtime runs
  (:data:`RUNTIME_RULES`, asked by :mod:`autopar.support`), and of what the search prices;
* :func:`divisors` and the enumeration of candidates (:func:`structures`, :func:`candidates`);
* how gradients are packed into the buckets of their collectives (:func:`pack_buckets`,
  :data:`DEFAULT_BUCKET_BYTES`): the data-parallel pass packs them, the cost model counts them.

Asking it: ``Plan`` (construction and ``validate``), :mod:`autopar.support` (hence
``parallelize``), the search (:mod:`autopar.planning.search`) and ``plan="auto"``
(:mod:`autopar.planning.autoplan`), the cost model (``autopar.cost``), the mesh
(:mod:`autopar.runtime.mesh`) and the CLI.  Nothing else states a rule.

A predicate takes numbers and returns whether the plan passes (True) or, for a runtime rule,
whether the runtime refuses it.  It uses only arithmetic, comparisons, ``&`` and ``|`` on its
arguments, so the same function takes Python ints (one plan: ``encode(plan)``) and numpy
integer arrays (the search's columns of candidates; the result is then a boolean array).
Names are compared through their codes (:func:`among`).

Torch-free and numpy-free: the offline tools import it.
"""
from __future__ import annotations

from autopar.plan_space.names import (CP_VARIANTS, SCHEDULES, RECOMPUTE_MODES, ZERO_STAGES, V_SCHEDULES,
                                      MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, INTERLEAVED_VPP,
                                      PLAN_COLUMNS, code, among, encode, decode, chunks_per_rank)
from autopar.plan_space.layout import (MESH_AXES, GROUP_AXES, data_axis, axis_digits, axis_geometry,
                                       axis_groups)
from autopar.plan_space.rules import (chunk_rank, microbatches_ok, valid_microbatches, sp_ok,
                                      ep_ok, heads_ok, kv_replicated, kv_cp_ok, padded_vocab, ulysses_heads_ok,
                                      ulysses_fits, ulysses_ok, head_split, layers_ok, experts_ok, local_experts, batch_ok, cp_seq_ok,
                                      sp_seq_ok, model_facts)
from autopar.plan_space.runtime_rules import (moe_rewritten, split_backward, Rule, RUNTIME_RULES,
                                              runtime_refusals, runnable, supported_summary)
from autopar.plan_space.enumeration import (zero_meaningful, interleaved_priced, divisors, STRUCTURE_FIELDS,
                                            structures, candidates)
from autopar.plan_space.buckets import DEFAULT_BUCKET_BYTES, pack_buckets, grads_kept, ZERO_SCATTERS_IN_FLIGHT

__all__ = [
    # names and codes
    "CP_VARIANTS", "SCHEDULES", "RECOMPUTE_MODES", "ZERO_STAGES", "V_SCHEDULES", "MULTI_CHUNK_SCHEDULES",
    "SPLIT_BACKWARD_SCHEDULES", "INTERLEAVED_VPP", "code", "among", "encode", "decode", "PLAN_COLUMNS",
    # layout
    "MESH_AXES", "GROUP_AXES", "data_axis", "axis_digits", "axis_geometry", "axis_groups",
    # chunks and micro-batches
    "chunks_per_rank", "chunk_rank", "microbatches_ok", "valid_microbatches",
    # rules of a plan alone, and of a plan against a model and a run
    "sp_ok", "ep_ok", "heads_ok", "kv_replicated", "kv_cp_ok", "padded_vocab", "ulysses_heads_ok", "ulysses_fits",
    "ulysses_ok", "head_split", "layers_ok",
    "experts_ok", "local_experts", "batch_ok", "cp_seq_ok", "sp_seq_ok", "model_facts",
    # what the runtime runs
    "Rule", "RUNTIME_RULES", "moe_rewritten", "split_backward", "runtime_refusals", "runnable",
    "supported_summary",
    # what the search prices, and enumeration
    "zero_meaningful", "interleaved_priced", "divisors", "STRUCTURE_FIELDS", "structures", "candidates",
    # gradient buckets, and how the runtime holds gradients
    "DEFAULT_BUCKET_BYTES", "pack_buckets", "grads_kept", "ZERO_SCATTERS_IN_FLIGHT",
]
