"""Causal masks: an attention mask that provably is the causal mask becomes ``is_causal=True``;
one that provably allows every position (an encoder without padding) is dropped.

A Hugging Face model traced by ``torch.export`` builds its causal mask in the graph (eager
code would pass ``is_causal=True`` to SDPA, but tracing takes the materialised path): a
``[b, 1, s, s]`` tensor per layer that SDPA adds to the scores and saves for backward --
``b*s^2`` elements a layer, unsharded by tp or sp.  For every ``scaled_dot_product_attention``
whose ``attn_mask`` depends only on the batch and sequence sizes and evaluates to the lower
triangle (0 / below -1e30, or True / False) at every size -- checked at sizes past every
threshold its subgraph holds (:func:`check_sizes`), so a sliding window or a chunked mask is
never taken for the causal mask -- this pass drops the mask and sets
``is_causal=True`` (the same probabilities: a masked score's ``exp`` underflows to 0 either
way); a mask that is 0 (or True) everywhere at both sizes is dropped with ``is_causal`` off
(adding 0 changes nothing); the mask subgraphs left dead are removed.  A mask that reads input data (a padding
``attention_mask``) or is anything else stays as it is.

Runs first after cleanup (passes/compile.py), for every plan.  The context-parallel pass
(passes/context_parallel.py) uses :func:`is_causal_mask` and :func:`mask_window` (a causal sliding
window, which CP attention applies from global positions) for the masks that remain.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from autopar.compat import sym_expr
from autopar.frontend.op_sets import SDPA, sdpa_args
from .context import PassContext, PassResult

__all__ = ["causal_mask_pass", "is_causal_mask", "mask_kind", "mask_window", "evaluate_sizes_only", "check_sizes",
           "mask_thresholds", "LARGEST_THRESHOLD"]


def evaluate_sizes_only(node: Node, sizes: dict[str, int], memo: dict):
    """Evaluate ``node`` from the batch/sequence sizes alone; None if it depends on data."""
    if node in memo:
        return memo[node]
    if node.op != "call_function":
        memo[node] = None
        return None
    if node.target is torch.ops.aten.sym_size.int:
        expr = sym_expr(node.meta.get("val"))
        memo[node] = sizes.get(str(expr)) if expr is not None else None
        return memo[node]
    bad = []

    def arg(a):
        if isinstance(a, Node):
            v = evaluate_sizes_only(a, sizes, memo)
            if v is None:
                bad.append(a)
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    args = arg(node.args)
    kwargs = {k: arg(v) for k, v in node.kwargs.items()}
    if str(kwargs.get("device")) == "meta":  # a model traced on meta (scale simulation): evaluate on the CPU
        kwargs["device"] = torch.device("cpu")
    memo[node] = None if bad else node.target(*args, **kwargs)
    return memo[node]


# The largest threshold a mask is checked past: Mistral's and Qwen2's 4096-token windows
# (Gemma 3's 1024, GPT-OSS's 128).  Checking one means evaluating it at 8195 positions, an
# s x s mask at batch 1 (about 0.6 s and 0.6 GiB on a CPU core, once per mask subgraph).  A mask
# with a larger integer constant (Llama 4's 8192-token chunks) is kept as a mask instead (exact
# under every plan that can run it, not proven causal or a window: refused under cp).
LARGEST_THRESHOLD = 4096
_SENTINEL = 2 ** 31  # larger integers are "to the end" markers (a slice's 2**63 - 1), not thresholds


def mask_thresholds(mask: Node) -> int:
    """The largest integer constant among the arguments of ``mask``'s subgraph: every position
    threshold a mask built from the sizes alone can have (a window, a chunk size, a sink count)."""
    largest, seen, todo = 0, set(), [mask]
    while todo:
        node = todo.pop()
        if node in seen or not isinstance(node, Node):
            continue
        seen.add(node)
        for value in list(node.args) + list(node.kwargs.values()):
            for v in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(v, int) and not isinstance(v, bool) and abs(v) < _SENTINEL:
                    largest = max(largest, abs(v))
        todo.extend(node.all_input_nodes)
    return largest


def check_sizes(mask: Node) -> tuple[tuple[int, int], ...] | None:
    """The ``(batch, seq)`` sizes that decide ``mask``'s kind for every size: two small ones and
    two past every threshold of its subgraph; None when a threshold is above :data:`LARGEST_THRESHOLD`.

    Why these suffice: a mask computed from the sizes alone compares positions (``arange`` of the
    sequence, their differences, cumulative sums) with each other and with the graph's integer
    constants, so whether a pair of positions is allowed can change with the sequence length only
    where a difference of positions crosses one of those constants; at a length past all of them
    every kind of pair (inside and outside each window or chunk) exists.  Two samples shorter than
    a window (what this pass checked before) would take a sliding window for the causal mask."""
    largest = mask_thresholds(mask)
    if largest > LARGEST_THRESHOLD:
        return None
    # The batch varies at the small lengths; past the thresholds one row keeps the s x s cost down.
    return (2, 6), (3, 9), (1, largest + 2), (1, 2 * largest + 3)


def _allowed_at_sizes(mask: Node, ctx: PassContext) -> list[torch.Tensor] | None:
    """``mask`` evaluated at each of :func:`check_sizes`'s sizes as a boolean "may attend" tensor
    ``[..., 1 or s, s]``; None when it depends on data, has a threshold past
    :data:`LARGEST_THRESHOLD`, or is not a mask (an additive one must be 0 or below -1e30)."""
    if ctx.seq_symbol is None:
        return None
    sizes = check_sizes(mask)
    if sizes is None:
        return None
    batch, seq = str(ctx.batch_symbol), str(ctx.seq_symbol)
    out = []
    for b, s in sizes:
        try:
            value = evaluate_sizes_only(mask, {batch: b, seq: s}, {})
        except Exception:
            return None
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != s \
                or value.shape[-2] not in (1, s):
            return None
        allowed = value if value.dtype == torch.bool else value == 0
        if value.dtype != torch.bool and not bool((value[~allowed] < -1e30).all()):
            return None
        out.append(allowed)
    return out


def _band(s: int, window: int | None, device) -> torch.Tensor:
    """The causal mask of length ``s``, limited to the last ``window`` keys when one is given."""
    ones = torch.ones(s, s, dtype=torch.bool, device=device)
    return ones.tril() if window is None else ones.tril() & ~ones.tril(-window)


def mask_kind(mask: Node, ctx: PassContext) -> str | None:
    """``"causal"`` when ``mask`` depends only on sizes and equals the lower-triangular causal
    mask at every size (:func:`check_sizes`), ``"full"`` when it allows every position (an
    encoder's mask without padding), else None: the mask stays (exact, not rewritten)."""
    allowed_at = _allowed_at_sizes(mask, ctx)
    if allowed_at is None:
        return None
    kinds = set()
    for allowed in allowed_at:
        s = allowed.shape[-1]
        if bool(allowed.all()):
            kinds.add("full")
        elif allowed.shape[-2] == s and bool((allowed == _band(s, None, allowed.device)).all()):
            kinds.add("causal")
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def mask_window(mask: Node, ctx: PassContext) -> int | None:
    """``W`` when ``mask`` depends only on sizes and is the causal sliding window of ``W`` keys at
    every size (:func:`check_sizes`): query ``i`` sees keys ``i - W + 1 .. i``, and at a length within
    the window all earlier keys (the causal mask); else None.  ``W`` is read at the largest checked
    length (past every threshold of the mask's subgraph, so past the window) and then checked at
    every size; a mask that is causal at every size is not a window (:func:`mask_kind`)."""
    allowed_at = _allowed_at_sizes(mask, ctx)
    if allowed_at is None or any(a.shape[-2] != a.shape[-1] for a in allowed_at):
        return None
    last = allowed_at[-1].reshape(-1, *allowed_at[-1].shape[-2:])
    window = int(last[0, -1].sum())
    if window < 1 or window >= last.shape[-1]:
        return None  # causal (or no key) at the largest length: not a window
    for allowed in allowed_at:
        if not bool((allowed == _band(allowed.shape[-1], window, allowed.device)).all()):
            return None
    return window


def is_causal_mask(mask: Node, ctx: PassContext) -> bool:
    """True when ``mask`` depends only on sizes and equals the lower-triangular causal mask."""
    return mask_kind(mask, ctx) == "causal"


def causal_mask_pass(gm: GraphModule, ctx: PassContext) -> PassResult:
    result = PassResult("causal_mask_pass")
    verdicts: dict[Node, bool] = {}  # one mask usually feeds every layer's attention
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        bound = sdpa_args(node)
        mask = bound.pop("attn_mask", None)
        if not isinstance(mask, Node) or bound.get("is_causal"):
            continue
        if mask not in verdicts:
            verdicts[mask] = mask_kind(mask, ctx)
        if verdicts[mask] is None:
            continue
        q, k, v = bound.pop("query"), bound.pop("key"), bound.pop("value")
        node.args = (q, k, v)
        node.kwargs = {**bound, "attn_mask": None, "is_causal": verdicts[mask] == "causal"}
        result.num_rewritten += 1
    if result.num_rewritten:
        gm.graph.eliminate_dead_code()
        result.notes.append(f"{result.num_rewritten} attention masks proven causal or full: is_causal=True, or "
                            "no mask for a mask that allows every position; masks dropped")
    return result
