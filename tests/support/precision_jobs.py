"""Per-rank jobs for tests/dist/test_precision.py, and the single-device bf16 recipe they are compared with.

Not a test module.  :func:`bf16_job` trains under a plan with ``mixed_precision="bf16"``;
:func:`reference_bf16` is the recipe written out by hand on one device: a bf16 copy of the
model runs forward and backward, the loss is computed on fp32 logits, the bf16 gradients
are widened into fp32 ``.grad`` of fp32 master weights (the user's own tensors), the
optimizer steps the masters, and the masters are copied back into the bf16 copy.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import autopar
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build, fresh_program, load_problems
from tests.support.wire import train_guarded

__all__ = ["bf16_job", "reference_bf16", "bf16_recipe", "STEPS"]

STEPS = 3


def _batches(batch: int):
    return make_batches(VOCAB, batch, SEQ, STEPS, seed=1)


def bf16_job(model_name: str, plan: str, opt_name: str, overrides: dict, batch: int = BATCH,
             max_grad_norm: float | None = None):
    """Losses, dtypes, memory report and rank 0's state dict of a bf16 mixed-precision run."""
    model, loss_fn, kwargs = build(model_name, overrides)
    batches = _batches(batch)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS[opt_name], mixed_precision="bf16",
                             max_grad_norm=max_grad_norm)
    out = {"losses": train_guarded(pm, batches), "norm": pm.last_grad_norm}
    out["comm"] = pm.comm_stats()  # the last train step's
    before = pm.state_dict()
    out["eval"] = pm.eval_step(*batches[0])
    after = pm.state_dict()
    out["eval_kept_state"] = all(torch.equal(before[k], after[k]) for k in before) and all(
        p.grad is None for g in pm.optimizer.param_groups for p in g["params"])
    out["param_dtypes"] = sorted({str(p.dtype) for p in pm.gm.parameters()})
    out["optimizer_dtypes"] = sorted({str(p.dtype) for g in pm.optimizer.param_groups for p in g["params"]})
    out["memory"] = pm.memory_report()
    out["untouched"] = all(p.dtype == torch.float32 for p in model.parameters())
    state = pm.state_dict()
    # Into the fp32 masters of a program of other weights: nothing is rounded on the way.
    fresh = fresh_program(model_name, plan, opt_name, overrides, batch=batch, mixed_precision="bf16",
                          max_grad_norm=max_grad_norm)
    out["load"] = load_problems({k: v.detach().clone() for k, v in state.items()}, fresh)
    out["state_dtypes"] = sorted({str(v.dtype) for v in state.values()})
    out["state"] = {k: v.detach().cpu().clone() for k, v in state.items()} if dist.get_rank() == 0 else None
    return out


def reference_bf16(model_name: str, opt_name: str, overrides: dict, batch: int = BATCH,
                   max_grad_norm: float | None = None, model=None):
    """The bf16 recipe on one device (see the module docstring): losses and fp32 master state
    (``model``: start from this fp32 model instead of a fresh ``build``)."""
    built, loss_fn, kwargs = build(model_name, overrides)
    return bf16_recipe(built if model is None else model, _batches(batch), loss_fn, kwargs,
                       OPTIMIZERS[opt_name], max_grad_norm=max_grad_norm)


def _fp32(output):
    if hasattr(output, "logits"):  # a Hugging Face ModelOutput: attribute and key stay in sync
        output.logits = output.logits.float()
        return output
    return output.float()


def bf16_recipe(model, batches, loss_fn, kwargs: dict, make_optimizer, *, device="cpu",
                max_grad_norm: float | None = None) -> dict:
    """The recipe of the module docstring for ``model`` (its tensors are the masters; moved to
    ``device`` first, which copies it when it is elsewhere), inputs moved to ``device``: the losses,
    the gradient norm, the eval loss on the first batch after training, and the fp32 master state."""
    model = model.to(device=device, dtype=torch.float32)
    work = copy.deepcopy(model).to(torch.bfloat16)
    masters = dict(model.named_parameters())
    optimizer = make_optimizer(list(masters.values()))
    losses, norm = [], None
    on = lambda t: t.to(device)  # noqa: E731
    for inputs, target in batches:
        optimizer.zero_grad()
        loss = loss_fn(_fp32(work(*map(on, inputs), **kwargs)), on(target))
        loss.backward()
        for name, p in work.named_parameters():
            masters[name].grad = p.grad.float()
            p.grad = None
        if max_grad_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(list(masters.values()), max_grad_norm))
        optimizer.step()
        with torch.no_grad():
            for name, p in work.named_parameters():
                p.copy_(masters[name])
        losses.append(float(loss.detach()))
    work.eval()
    with torch.no_grad():
        inputs, target = batches[0]
        evaluated = float(loss_fn(_fp32(work(*map(on, inputs), **kwargs)), on(target)))
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "norm": norm, "eval": evaluated}
