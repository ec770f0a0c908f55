"""Per-rank jobs for the dropout tests (run on every rank by tests/support/harness.py).

Not a test module.  :func:`mask_job` trains the example decoder with dropout for a few
steps under a plan and returns, per rank, which elements every dropout of the program
zeroed on every call (the program's ``random.dropout`` nodes are wrapped to record their
outputs), its mesh coordinates, the streams its generators serve and its full state dict
(replicated parameters must stay identical on every rank), and what eval_step did.
:func:`seed_job` returns the base seed ranks seeded differently agree on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar.ops import rng
from tests.support.harness import OPTIMIZERS, make_batches
from tests.support.jobs import BATCH, SEQ, VOCAB, build

__all__ = ["mask_job", "seed_job", "DROPOUT"]

# Dropout everywhere the example decoder has it: embedding output and residual branches
# (replicated over tp without SP, sequence shards with SP), attention probabilities and the
# MLP's hidden activations (sharded over tp).
DROPOUT = {"hidden_dropout": 0.3, "attention_dropout": 0.3, "mlp_dropout": 0.3}


def _recording(name: str, log: dict):
    def dropout(x, *args, **kwargs):
        y = rng.dropout(x, *args, **kwargs)
        log.setdefault(name, []).append((y == 0).detach().cpu())
        return y

    return dropout


def mask_job(plan: str, overrides: dict, steps: int = 2):
    model, loss_fn, kwargs = build("example", overrides)
    batches = make_batches(VOCAB, BATCH, SEQ, steps, seed=1)
    pm = autopar.parallelize(model, example_inputs=batches[0][0], example_kwargs=kwargs, plan=plan,
                             loss_fn=loss_fn, optimizer=OPTIMIZERS["sgd"])
    masks: dict[str, list[torch.Tensor]] = {}
    streams: dict[str, str] = {}
    for node in pm.gm.graph.nodes:
        if node.op == "call_function" and node.target is rng.dropout:
            streams[node.name] = node.args[3]
            node.target = _recording(node.name, masks)
    pm.gm.recompile()
    losses = [pm.train_step(inputs, target) for inputs, target in batches]
    train_masks = {k: list(v) for k, v in masks.items()}
    masks.clear()
    # eval_step runs the same program with dropout off: nothing zeroed, the same loss twice.
    eval_losses = [pm.eval_step(*batches[0]) for _ in range(2)]
    return {
        "coords": {a: r for a, (r, _) in pm.coords().items()},
        "masks": train_masks,
        "eval_masks": masks,
        "streams": streams,
        "generator_streams": sorted({key[0] for key in pm.step_context.generators}),
        "losses": losses,
        "eval_losses": eval_losses,
        "state": {k: v.detach().cpu().clone() for k, v in pm.state_dict().items()},
    }


def seed_job() -> int:
    """The base seed the ranks agree on when each process was seeded differently."""
    torch.manual_seed(100 + dist.get_rank())
    return rng.common_seed()
