"""Expert parallelism for dense experts (every expert runs on every token: Llama 4) at run time.

A dense block computes ``y = sum_e experts_e(x * scores[:, e])`` over all ``E`` stacked experts
(``analyze_moe.DenseExperts``).  Under ep, rank ``r`` of the ``ep`` axis holds experts
``[r * E/ep, (r + 1) * E/ep)`` (the stacked ``[E, ...]`` parameters sharded on dim 0, as routed
experts are) and the EP pass (``passes/dense_expert_parallel.py``) replaces the block by three calls:

- ``dense_gather(x, scores, 'ep')``: all-gather the tokens ``[T, h]`` and the scores ``[T, E]`` over
  the ep group, and keep the gathered scores' columns of this rank's experts;
- ``dense_experts(x_all, scores_mine, body, params)``: the user's traced expert code, its expert
  count made ``E/ep`` by placement propagation, on every gathered token: the sum over this rank's
  experts only, a partial sum over ``ep`` of the block's output;
- ``dense_scatter(partial, 'ep')``: reduce-scatter that sum back to this rank's tokens.

Nothing is dropped or reordered, so the result is the block's, up to the order of the sum over
experts.  Backward follows from the collectives' duals (docs/architecture.md): the all-gathers'
backward reduce-scatters the tokens' and scores' gradients (each rank's is a partial sum over its
experts), the reduce-scatter's all-gathers the output gradient.  Every rank of an ep group holds
the same number of tokens (batch rows and sequence chunks are cut evenly), as the gathers need.
"""
from __future__ import annotations

import torch

from autopar.errors import AutoparError
from autopar.ops import collectives

__all__ = ["dense_gather", "dense_experts", "dense_scatter"]

_GATHER = "dense MoE: tokens and router scores to every ep rank"
_SCATTER = "dense MoE: partial expert sums back to the tokens' ranks"


def _group(axis: str) -> collectives.AxisGroup:
    # The body's expert count is E/ep: run without the ep group it would drop the other experts.
    g = collectives.find_group(axis)
    if g is None:
        raise AutoparError(f"autopar: a dense-experts block was split over mesh axis '{axis}' but this step "
                           f"has no '{axis}' group; expected the program to run under the plan it was compiled for.")
    return g


def dense_gather(x: torch.Tensor, scores: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_all, scores_mine)``: the ep group's tokens ``[ep*T, h]`` and their scores for this rank's
    experts ``[ep*T, E/ep]``."""
    g = _group(axis)
    x_all = collectives.all_gather(x, 0, axis, _GATHER)
    scores_all = collectives.all_gather(scores, 0, axis, _GATHER)
    num_local = scores.shape[1] // g.size
    # a view: backward puts the gradient in this rank's columns, zeros elsewhere (summed over ranks)
    return x_all, scores_all.narrow(1, g.rank * num_local, num_local)


def dense_experts(x_all: torch.Tensor, scores_mine: torch.Tensor, body, params: list) -> torch.Tensor:
    """The rank's experts on every gathered token: their sum, ``[ep*T, h]`` (``body`` cut from the
    traced graph, its sizes made local by the EP pass)."""
    return body(x_all, scores_mine, *params)


def dense_scatter(partial: torch.Tensor, axis: str) -> torch.Tensor:
    """The sum of every rank's partial output, this rank's tokens of it."""
    _group(axis)
    return collectives.reduce_scatter(partial, 0, axis, _SCATTER)
