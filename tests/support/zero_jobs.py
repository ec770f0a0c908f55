"""Per-rank jobs for the ZeRO and checkpoint tests (run on every rank by tests/support/harness.py).

Not a test module.  Like ``tests/support/jobs.py`` but with the global batch size as a parameter
(``dp=2,mb=4`` needs a batch of 8) and with probes of the sharded state that ZeRO keeps.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import SEQ, VOCAB, build, fresh_program, load_problems
from tests.support.wire import train_guarded

__all__ = ["zero_train_job", "zero_state_job", "outside_step_job", "memory_job", "zero_overlap_job", "SEQ", "VOCAB"]

def _parallelize(model_name: str, plan: str, opt_name: str, overrides: dict, batch: int, num_batches: int = 3,
                 seq: int = SEQ):
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = make_batches(VOCAB, batch, seq, num_batches, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name])
    return pm, batches

def zero_train_job(model_name: str, plan: str, opt_name: str, overrides: dict, batch: int, steps: int = 3):
    """Train ``steps`` steps on batches of ``batch``; comm records are the last step's."""
    pm, batches = _parallelize(model_name, plan, opt_name, overrides, batch)
    losses = train_guarded(pm, batches[:steps])
    state = pm.state_dict()
    return {
        "losses": losses,
        "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None,
        "comm": pm.comm_stats(),
    }

def zero_state_job(model_name: str, plan: str):
    """What one rank holds after a step: optimizer-state and shard sizes, module parameter sizes,
    and what differs after its ``state_dict()`` is loaded into a program of other weights
    (:func:`~tests.support.jobs.load_problems`; empty when the load is exact)."""
    pm, batches = _parallelize(model_name, plan, "adamw", {}, 4)
    pm.train_step(*batches[0])
    opt_params = [p for group in pm.optimizer.param_groups for p in group["params"]]
    state_numel = sum(t.numel() for p in opt_params for k, t in pm.optimizer.state[p].items() if k != "step")
    module_numel = sum(p.numel() for p in pm.gm.parameters())
    saved = {k: v.detach().clone() for k, v in pm.state_dict().items()}
    load = load_problems(saved, fresh_program(model_name, plan, "adamw", {}, batch=4))
    loss = pm.train_step(*batches[1])
    return {"opt_numel": sum(p.numel() for p in opt_params), "state_numel": state_numel,
            "module_numel": module_numel, "load": load, "loss": loss}

def outside_step_job(model_name: str):
    """Calling a ZeRO-3 program directly (outside train_step) fails with an autopar error."""
    pm, batches = _parallelize(model_name, "dp=2,zero=3", "sgd", {}, 4)
    inputs, target = batches[0]
    try:
        pm.gm(*inputs, target)
    except RuntimeError as exc:
        return str(exc)
    return ""


def memory_job(model_name: str, plan: str, batch: int, overrides: dict | None = None, seq: int = SEQ):
    """``memory_report()`` after the second AdamW step (optimizer state exists from the first)."""
    pm, batches = _parallelize(model_name, plan, "adamw", overrides or {}, batch, seq=seq)
    pm.train_step(*batches[0])
    pm.train_step(*batches[1])
    return pm.memory_report()


def memory_plans_job(model_name: str, plans: list[str], batch: int, overrides: dict, seq: int):
    """``memory_job`` for each plan in turn, on the same ranks."""
    return [memory_job(model_name, plan, batch, overrides, seq) for plan in plans]


def zero2_overlap_job(model_name: str, bucket_bytes: int):
    """Stage 2 (``dp=2,zero=2``, small buckets): how many units' reduce-scatters had started at
    each gradient backward accumulated, the number of units, and what is left after the step."""
    model, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, 4, SEQ, 1, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan="dp=2,zero=2",
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["adamw"], bucket_bytes=bucket_bytes)
    zero, seen = pm.grad_sync, []
    events = zero.events = []  # the hook holds this list, not the program (a C++-held cycle would leak it)
    for p in pm.gm.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: seen.append(sum(e[0] == "reduce_scatter" for e in events)))
    pm.train_step(*batches[0])
    return {"seen": seen, "units": len(zero.units), "left": zero.scatters_in_flight()}


class _LayerReads(TorchFunctionMode):
    """Appends ``("reads_layer", k)`` to ``events`` the first time a call reads a parameter of decoder
    layer ``k`` (entered around ``train_step``, it sees each call after ZeRO's first-use wait)."""

    def __init__(self, events: list, layer_of: dict[int, int]):
        super().__init__()
        self.events, self.layer_of, self.seen = events, layer_of, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.OpOverload):  # the program's aten calls, not metadata reads
            return func(*args, **(kwargs or {}))
        for arg in (*args, *(kwargs or {}).values()):
            layer = self.layer_of.get(id(arg)) if isinstance(arg, torch.Tensor) else None
            if layer is not None and layer not in self.seen:
                self.seen.add(layer)
                self.events.append(("reads_layer", layer))
        return func(*args, **(kwargs or {}))


def zero_overlap_job(model_name: str, plan: str, batch: int, bucket_bytes: int, mixed: bool = False,
                     steps: int = 3):
    """``steps`` AdamW steps under a ZeRO-1/2 plan with small buckets (several units), recording the
    strategy's events (autopar/runtime/gradients/zero_grads.py) with ``("step", i)`` before each step,
    ``("reads_layer", k)`` when a call first reads decoder layer ``k``'s parameters in a step and
    ``("grad", k)`` when backward accumulates gradients of layer ``k`` (once per run of them);
    also the units (their layers), the units ZeRO-1 may start in backward, losses and rank 0's state."""
    model, loss_fn, kwargs = build(model_name, {})
    batches = make_batches(VOCAB, batch, SEQ, steps, seed=1)
    extra = {"mixed_precision": "bf16"} if mixed else {}
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan, loss_fn=loss_fn,
                             optimizer=OPTIMIZERS["adamw"], bucket_bytes=bucket_bytes, **extra)
    zero = pm.grad_sync
    prefixes = list(pm.program.structure.layers)
    layer_of_name = {x: k for x, _ in pm.gm.named_parameters() for k, pre in enumerate(prefixes)
                     if x.startswith(pre + ".")}
    layer_of = {id(pm.gm.get_parameter(x)): k for x, k in layer_of_name.items()}
    events = zero.events = []
    for x, k in layer_of_name.items():  # ("grad", k): backward reached layer k's parameters
        pm.gm.get_parameter(x).register_post_accumulate_grad_hook(
            lambda _p, k=k: events.append(("grad", k)) if events[-1] != ("grad", k) else None)
    losses = []
    for i, (inputs, target) in enumerate(batches):
        events.append(("step", i))
        with _LayerReads(events, layer_of):
            losses.append(pm.train_step(inputs, target))
    in_flight_after = zero.gathers_in_flight()
    state = pm.state_dict()  # a reader outside the forward: waits for every gather
    return {
        "losses": losses, "events": events, "in_flight_after_step": in_flight_after,
        "in_flight_after_state_dict": zero.gathers_in_flight(),
        "unit_layers": [sorted({layer_of_name.get(x, -1) for x in names}) for names in zero.units],
        "early": zero.early_units(),
        "state": {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None,
    }
