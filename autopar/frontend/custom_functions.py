"""Custom ``torch.autograd.Function`` s met while tracing: kept whole, as one op that runs them.

``torch.export`` (non-strict) runs a Function's ``forward`` as ordinary code and records the ops
it runs; its ``backward`` is lost.  A Function exists precisely when its backward is not
autograd's derivative of its forward (RecurrentGemma bounds a square root's derivative; PhiMoE's
sparse mixer passes a straight-through estimate; Bloom's train-mode GeLU spells its derivative
out), so the recorded forward would train differently.  Instead, while the model exports,
:func:`capture` routes every Function applied to a tensor that needs a gradient through one
operator, ``autopar::autograd_function(key, tensors)``: the graph gets a single node whose
``key`` names the call (the Function and its non-tensor arguments, :func:`call_of`), and at run
time the node calls the Function's own ``apply`` on the rank's tensors, so autograd runs its
``backward``.  Sharding never reads the Function's Python: ``passes/autograd_functions.py``
traces its forward and its backward into graphs of aten ops (:func:`trace_forward`,
:func:`trace_joint`) and places them node by node.

A Function that is handed something other than tensors and plain values (Reformer's reversible
layers get the layer modules, whose parameters its forward reads unseen) is refused by name
(:func:`refuse`); so is one reading a tensor it is not handed (found by the passes' trace).
``torch``'s own Functions (activation checkpointing) keep autograd's gradient and are exported
as usual.

Neighbours: :mod:`autopar.frontend.trace` exports under :func:`capture`;
``passes/autograd_functions.py`` places the op; ``passes/gradient_placement.py`` asks it for
the gradient placements of the op's inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import traceback
from typing import Any

import torch
from torch.utils import _pytree as pytree

from autopar.errors import AutoparError

__all__ = ["AUTOGRAD_FUNCTION", "AppliedFunction", "FunctionCall", "call_of", "capture", "check_kept", "refuse",
           "register", "trace_forward", "trace_joint"]

# ``Function.apply`` as torch defines it, before :func:`capture` replaces it for an export.
_APPLY = torch.autograd.Function.__dict__["apply"]

_LIB = torch.library.Library("autopar", "DEF")
_LIB.define("autograd_function(int key, Tensor[] tensors) -> Tensor[]")


@dataclasses.dataclass(frozen=True)
class AppliedFunction:
    """A Function that cannot be kept (see :func:`refuse`)."""
    name: str
    backward_at: str  # file:line of its backward
    called_at: str    # file:line of the call to ``apply``
    why: str


@dataclasses.dataclass(frozen=True)
class FunctionCall:
    """One call site's Function and its arguments, tensors left out (``None`` in ``leaves``)."""
    function: type
    spec: Any            # the pytree spec of ``(args, kwargs)``
    leaves: tuple        # the flattened arguments, a tensor's place holding None
    called_at: str

    @property
    def name(self) -> str:
        return self.function.__qualname__

    def arguments(self, tensors) -> tuple[tuple, dict]:
        it = iter(tensors)
        flat = [next(it) if leaf is None else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(flat, self.spec)

    def apply(self, tensors) -> tuple[list[torch.Tensor], bool]:
        """The Function's outputs as a list, and whether it returned a tuple."""
        args, kwargs = self.arguments(tensors)
        out = _APPLY.__func__(self.function, *args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise AutoparError(
                f"autopar: the custom torch.autograd.Function '{self.name}' (called at {self.called_at}) "
                f"returns {[type(o).__name__ for o in outs]}; autopar runs a Function whole only when it "
                "returns tensors. Expected: return tensors only (a value it computes may be an attribute).")
        return outs, isinstance(out, (tuple, list))


# Every call site captured in this process, by key.  A key is a digest of the call (the
# Function's module and name, its arguments' structure and plain values), so equal calls share
# one (two layers applying one Function alike trace to equal graphs, which layer stamping
# compares) and a graph written by one process and read by another (the test suite's shared
# traces) finds its calls again once :func:`register` has read them from the nodes.
_CALLS: dict[int, FunctionCall] = {}
CALL_KEY = "autopar_function"  # node.meta: the node's FunctionCall, which travels with the graph


def _key(call: FunctionCall) -> int:
    text = f"{call.function.__module__}.{call.name}|{call.spec}|{call.leaves!r}"
    key = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    _CALLS.setdefault(key, call)
    return key


def register(gm: torch.fx.GraphModule) -> None:
    """Make the calls of a graph read back from elsewhere runnable in this process."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is AUTOGRAD_FUNCTION and CALL_KEY in node.meta:
            _CALLS.setdefault(node.args[0], node.meta[CALL_KEY])


def call_of(node: torch.fx.Node) -> FunctionCall:
    """The call an ``autograd_function`` node runs."""
    return _call(node.args[0])


def _call(key: int) -> FunctionCall:
    if key not in _CALLS:
        raise AutoparError(
            f"autopar: a program calls a custom torch.autograd.Function with key {key}, which this "
            "process never traced: the graph was read from elsewhere without its calls. Expected: "
            "autopar.frontend.custom_functions.register(graph) after reading a traced graph back.")
    return _CALLS[key]


# Whether a key's Function returns a tuple (else one tensor), learnt when export first runs it.
_RETURNS_TUPLE: dict[int, bool] = {}


def _run(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    outs, _RETURNS_TUPLE[key] = _call(key).apply(tensors)
    return outs


def _fake(key: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        # the op's outputs are new tensors (its schema aliases nothing): a forward returning
        # its input, or a view of it, is copied here as autograd copies it at run time
        return [t.clone() for t in _run(key, tensors)]


# Above autograd, so ``apply`` builds the Function's own backward; CompositeExplicitAutograd for
# calls that skip autograd (inference mode).  Export records the op itself (it traces above
# both) and shapes it by ``_fake``.
_LIB.impl("autograd_function", _run, "Autograd")
_LIB.impl("autograd_function", _run, "CompositeExplicitAutograd")
torch.library.register_fake("autopar::autograd_function", _fake, lib=_LIB)

AUTOGRAD_FUNCTION = torch.ops.autopar.autograd_function.default


def _where(fn) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return "an unknown place"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("custom_functions.py"):
            return f"{frame.filename}:{frame.lineno}"
    return "an unknown place"


def _unkept(leaves: list) -> str | None:
    """Why a call with these flattened arguments cannot run as the op, or None."""
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            return (f"it is handed the module {type(leaf).__name__}, whose parameters its forward "
                    "would read outside the graph")
        if isinstance(leaf, torch.Tensor):
            continue
        if not isinstance(leaf, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return f"it is handed a {type(leaf).__name__}, which the program cannot hold as a constant"
    return None


@contextlib.contextmanager
def capture():
    """Inside the block every non-torch Function applied to a tensor that needs a gradient runs
    as one ``autograd_function`` op; one that cannot is recorded in the yielded list."""
    unkept: list[AppliedFunction] = []

    def apply(cls, *args, **kwargs):
        flat, spec = pytree.tree_flatten((args, kwargs))
        needs_grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)
        if cls.__module__.startswith("torch.") or not torch.is_grad_enabled() or not needs_grad:
            return _APPLY.__func__(cls, *args, **kwargs)
        why = _unkept(flat)
        if why is not None:
            unkept.append(AppliedFunction(cls.__qualname__, _where(cls.backward), _caller(), why))
            return _APPLY.__func__(cls, *args, **kwargs)
        call = FunctionCall(cls, spec, tuple(None if isinstance(a, torch.Tensor) else a for a in flat), _caller())
        key = _key(call)
        outs = AUTOGRAD_FUNCTION(key, [a for a in flat if isinstance(a, torch.Tensor)])
        return tuple(outs) if _RETURNS_TUPLE[key] else outs[0]

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield unkept
    finally:
        torch.autograd.Function.apply = _APPLY


def refuse(model: torch.nn.Module, unkept: list[AppliedFunction]) -> None:
    """An ``autopar:`` error for the first Function that could not be kept, if any."""
    if not unkept:
        return
    first = unkept[0]
    others = sorted({a.name for a in unkept} - {first.name})
    raise AutoparError(
        f"autopar: {type(model).__name__} applies the custom torch.autograd.Function '{first.name}' "
        f"(called at {first.called_at}; its backward at {first.backward_at})"
        + (f", and {', '.join(others)}" if others else "")
        + f", and {first.why}. autopar runs a Function whole, its own backward included, only when "
        "every input it reads is a tensor or a plain value passed to apply. Expected: pass the "
        "tensors it reads to apply, write that part with ordinary torch ops, or train this model "
        "without autopar.")


def _values(node: torch.fx.Node) -> list:
    return [a.meta["val"] for a in node.args[1]]


def _checked(node: torch.fx.Node, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    # a tensor the code makes (``torch.tensor(0.5)``) is traced as a constant that is copied
    # fresh; any other one is a tensor it holds from outside
    fresh = torch.ops.aten.lift_fresh_copy.default
    read = [n.target for n in gm.graph.nodes
            if n.op == "get_attr" and not all(u.target is fresh for u in n.users)]
    if read:
        call = call_of(node)
        raise AutoparError(
            f"autopar: the custom torch.autograd.Function '{call.name}' (called at {call.called_at}, node "
            f"'{node.name}') reads {len(read)} tensor(s) it is not handed (a parameter or a tensor its "
            "code holds), which a rank holding shards could not give it. Expected: pass every tensor "
            "the Function reads to apply.")
    return gm


def check_kept(gm: torch.fx.GraphModule) -> None:
    """Refuse, after the export, a kept Function whose forward reads a tensor it is not handed:
    a rank would run it on the user's tensor instead of its own copy of the parameter."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is AUTOGRAD_FUNCTION:
            node.meta[CALL_KEY] = call_of(node)
            trace_forward(node)


def trace_forward(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The aten ops of the Function's forward on the node's (fake, symbolic) inputs; its
    placeholders are the node's tensors, its output the node's list of outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    call = call_of(node)
    return _checked(node, make_fx(lambda tensors: call.apply(tensors)[0], tracing_mode="symbolic")(_values(node)))


def trace_joint(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list]:
    """The forward and the Function's own backward as one graph of aten ops, and where each
    input's gradient is among its outputs.  Placeholders: the node's tensors, then one gradient
    per output; outputs: the Function's outputs, then the input gradients that exist (an integer
    input, or one the backward returns None for, has none: its slot is None)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    call, slots = call_of(node), []

    def joint(tensors, grads):
        ins = [t.detach().requires_grad_() if t.is_floating_point() else t for t in tensors]
        outs = call.apply(ins)[0]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        wrt = [t for t in ins if t.requires_grad]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                   if pairs and wrt else [None] * len(wrt))
        found = [next(got) if t.requires_grad else None for t in ins]
        slots[:] = []
        for g in found:
            slots.append(None if g is None else len(outs) + sum(s is not None for s in slots))
        return list(outs) + [g for g in found if g is not None]

    grads = [torch.empty_like(v) for v in node.meta["val"]]  # fake, like the outputs (their own mode)
    return _checked(node, make_fx(joint, tracing_mode="symbolic")(_values(node), grads)), slots
