"""Placements of random draws from the default generator (``RANDOM_DRAWS``: ``rand_like``, ``exponential_``, ...).

Dropout has streams of its own (``passes/dropout.py``); any other random fill of the graph draws
from the default generator, which one device calls once per draw for the whole tensor (PhiMoE's
router samples its experts in train mode with ``empty_like(x).exponential_()``, ``rand_like`` and
``uniform_`` over its tokens).  The ranks' default generators are seeded alike, so a draw every
rank makes in full is the one device's:

- on a model axis (tp, ep; :func:`draw_rule`), a draw over replicated values is made as it is,
  the same numbers on every rank; one over values sharded there is refused (each rank would draw
  the first shard's numbers);
- on ``dp`` (batch propagation, :func:`rows_draw_rule`), a draw over the rank's rows (its shape holds
  the batch size, in its token dim) is placed on those rows and marked (:data:`DRAW_KEY`: that dim),
  and ``passes/random_draws.py`` makes it draw the whole batch's numbers and keep the rank's rows
  (:func:`autopar.ops.draws.rows_draw`).  Refused there: rows in a rank-local order (a sort of the
  rank's tokens: one device's order is the batch's), draws whose numbers depend on the values they
  are drawn for (``bernoulli(p)``, ``multinomial``, ``poisson``, ``normal(mean)``: the other ranks'
  values are not here), ``randperm`` over the rows;
- on ``cp`` a draw over the rank's tokens is refused: its tokens are two load-balanced chunks of
  each sequence, whose rows of the batch's draw the rule does not rebuild.

Neighbours: ``passes/rules.py`` (the registry), ``passes/batch_propagation.py`` (which asks these on ``dp``).
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.fx import Node

from autopar.frontend.op_sets import RANDOM_DRAWS
from .rules import R, RuleContext, is_sharded, register, register_token_order

__all__ = ["DRAW_KEY", "VALUE_DRAWS", "draw_rule", "rows_draw_rule"]

aten = torch.ops.aten

# The row dim of a draw over a dp rank's rows, set by :func:`rows_draw_rule` for passes/random_draws.py.
DRAW_KEY = "autopar_rows_draw"
# Draws whose numbers depend on the values they are drawn for (a probability, a mean, a rate per element).
VALUE_DRAWS = frozenset({aten.bernoulli.default, aten.bernoulli_.Tensor, aten.multinomial.default,
                         aten.normal.Tensor_float, aten.poisson.default})
_HINT = ("Only dropout has streams of its own (passes/dropout.py); use a plan without {axis} for this model, "
         "or train it without the sampling (a router in eval mode routes deterministically).")


def _name(node: Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


@register_token_order(*RANDOM_DRAWS)
def rows_draw_rule(node: Node, pls: list, rc: RuleContext):
    """A draw over the rank's tokens on a data axis: on ``dp``, placed on its rows and marked for the
    whole batch's draw; refused where the rows cannot be rebuilt (see the module docstring)."""
    dim = rc.token_dim(node)
    if dim is None:
        return None
    if rc.axis != "dp":
        raise rc.fail(node, f"it draws random numbers for this rank's tokens from the default generator; one device "
                            f"draws them for every token of the batch, and this rank's tokens on '{rc.axis}' are "
                            "load-balanced chunks of each sequence, whose numbers of that draw are not rebuilt",
                      _HINT.format(axis=rc.axis))
    if node.target in VALUE_DRAWS or node.target is aten.randperm.default:
        what = "permutes this rank's rows" if node.target is aten.randperm.default else \
            "draws numbers for this rank's rows that depend on the values they are drawn for"
        raise rc.fail(node, f"{_name(node)} {what}; one device draws them for the whole batch at once, from every "
                            "row's values, which this rank does not hold", _HINT.format(axis="dp"))
    wrong = [p for p in pls if p not in (R, Shard(dim))]
    if wrong:
        raise rc.fail(node, f"it draws random numbers for rows placed {wrong[0]}, this rank's tokens in a rank-local "
                            "order (a sort or selection of its tokens): one device draws them in the batch's order",
                      _HINT.format(axis="dp"))
    node.meta[DRAW_KEY] = dim
    return Shard(dim)


@register(*RANDOM_DRAWS)
def draw_rule(node: Node, pls: list, rc: RuleContext):
    """A draw over replicated values is every rank's same draw; over sharded values it is refused."""
    if not is_sharded(pls):
        return R
    raise rc.fail(node, f"it draws random numbers from the default generator for values placed {pls}; one "
                        f"device draws them for the whole tensor, and each rank would draw the numbers of the "
                        f"first shard", _HINT.format(axis=rc.axis))
