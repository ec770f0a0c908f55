"""The op families of a rewritten program that hold autopar's own operators, each written once.

The aten families of a traced graph (SDPA and its arguments, softmax, reshapes, splits,
projections, shaped fills) are :mod:`autopar.frontend.op_sets`, which the structure analysis
reads too; the sets here add the operators the passes insert (:mod:`autopar.ops`), which
the frontend may not import.  Readers: the rule registry (``rules`` and its families), the
context-parallel, recompute and dropout passes.
"""
from __future__ import annotations

from autopar.frontend.op_sets import SDPA
from autopar.ops import cp_attention
from autopar.ops import rng

__all__ = ["CP_ATTENTION_VARIANTS", "CP_ATTENTION_OPS", "SDPA_OPS", "PROGRAM_ATTENTION_OPS"]

# The plan's ``cp_variant`` -> the context-parallel attention op the CP pass puts in SDPA's place.
CP_ATTENTION_VARIANTS = {"ring": cp_attention.ring_attention, "allgather": cp_attention.allgather_attention,
                         "ulysses": cp_attention.ulysses_attention}
CP_ATTENTION_OPS = frozenset(CP_ATTENTION_VARIANTS.values())
# SDPA and its form with a dropout stream (the dropout pass's rewrite): SDPA's arguments, the
# attention of this rank's heads.
SDPA_OPS = frozenset({SDPA, rng.attention})
# Every attention op a program may hold after the passes.
PROGRAM_ATTENTION_OPS = SDPA_OPS | CP_ATTENTION_OPS
