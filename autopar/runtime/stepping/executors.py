"""How one rank runs its program for a step: the executors of :class:`ParallelModule`.

An executor (:class:`Executor`) knows which parameters this rank holds (``owner``,
``holders``), builds what runs them once the parameters are local (``setup``), runs forward
and backward of this rank's micro-batches (``run``) or forward alone (``evaluate``), and
gives the program of a pipeline stage that ``pm.code()`` prints (``describe_stage``).  Two exist:

* :class:`FlatExecutor`: one program, every parameter on every rank of the stage, the
  micro-batches in turn (gradient accumulation), the memory meter around each;
* :class:`autopar.runtime.stepping.pipelined.PipelineExecutor`: the chunks of the pipeline pass
  driven by a ``torch.distributed.pipelining`` schedule.

Everything else -- parameters, state dicts, gradient sync, the loss, checkpoints -- is
the same code for both, assembled by :class:`autopar.runtime.module.ParallelModule`; an executor
sees only its :class:`autopar.runtime.stepping.environment.StepEnvironment`.

Each micro-batch's call of a program goes through a :class:`MicrobatchScope`, so that torch's
``MemTracker`` (whose module tracker refuses a module called twice at the top level of one
tracked step, taking it for a second iteration) can meter a step of several micro-batches.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from autopar.errors import AutoparError
from autopar.ops.regather import keeping_shards, regathers
from autopar.runtime.stepping.inductor import torch_compiled_program

__all__ = ["Executor", "FlatExecutor", "StepOutput", "weighted_loss", "MicrobatchScope"]


class MicrobatchScope(torch.nn.Module):
    """A module made for one micro-batch's call of a program (the program not a submodule: it
    adds no parameters), held until that micro-batch's backward is done.

    torch's ModTracker, which MemTracker drives, takes a module called again at the top level
    within one tracked step for the next iteration and raises; called inside a fresh scope, the
    program is a nested module, which it allows.  The tracker's backward hooks look the scope up,
    so it lives through the micro-batch's backward; it is dropped then, which keeps the tracker's
    table of modules (walked at every op) to the micro-batches in flight."""

    def __init__(self, program: Callable):
        super().__init__()
        self.__dict__["program"] = program

    def forward(self, *args, **kwargs):
        return self.program(*args, **kwargs)


def weighted_loss(loss: torch.Tensor, weight: float) -> torch.Tensor:
    """A piece's mean loss times its weight (``LossSplit.weight``); untouched at 1.0."""
    return loss if weight == 1.0 else loss * weight


class StepOutput:
    """What ``run`` returns: this rank's mean loss over its micro-batches, if it computes the loss."""

    def __init__(self, loss: torch.Tensor | None):
        self.loss = loss


@runtime_checkable
class Executor(Protocol):
    """How one rank runs its program: what :class:`autopar.runtime.module.ParallelModule` calls.

    ``env`` is the rank's :class:`autopar.runtime.stepping.environment.StepEnvironment` (its device,
    groups, parameters, gradient sync, memory meter, micro-batches and loss weights: never the
    module itself); ``coords`` maps each mesh axis to this rank's index on it."""

    def owner(self, name: str) -> int | None:
        """The pp rank that owns graph parameter ``name`` (broadcasts it in ``state_dict``);
        None: every pp rank holds it."""
        ...

    def holders(self, name: str) -> tuple[int, ...] | None:
        """The pp ranks holding graph parameter ``name`` (a tied weight: two); None: every rank."""
        ...

    def setup(self, env) -> None:
        """Build what runs the program, once the rank's parameters and gradient sync exist."""
        ...

    def run(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Forward and backward of this rank's micro-batches of the batch given to the step,
        inside the gradient sync's contexts; the gradients are left for ``grad_sync.sync()``."""
        ...

    def evaluate(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Forward only of this rank's micro-batches (the caller holds ``torch.no_grad``)."""
        ...

    def describe_stage(self, stage: int) -> torch.fx.GraphModule:
        """The graph of pipeline stage ``stage`` (model chunk ``stage``; 0 without pp)."""
        ...


class FlatExecutor:
    """Run the whole rewritten graph on each of this rank's micro-batches (an :class:`Executor`).

    ``torch_compile_options``: ``torch.compile``'s keyword arguments (``compile=``), or None
    to run the graph eagerly (:mod:`autopar.runtime.stepping.inductor`)."""

    def __init__(self, gm: torch.fx.GraphModule, program, plan, torch_compile_options: dict | None = None):
        self.gm, self.program, self.plan = gm, program, plan
        self._regathers = regathers(gm)
        self._torch_compile_options = torch_compile_options
        self._forward = gm  # what runs: the graph, or its torch.compile (setup)

    def owner(self, name: str) -> int | None:
        """The pp rank owning parameter ``name``: None, every rank holds every parameter."""
        return None

    def holders(self, name: str) -> tuple[int, ...] | None:
        """The pp ranks holding ``name``: None, every rank."""
        return None

    def setup(self, env) -> None:
        """The graph runs as it is, or through ``torch.compile`` over this rank's parameters (``compile=``)."""
        if self._torch_compile_options is not None:
            self._forward = torch_compiled_program(self.gm, self._torch_compile_options)

    def run(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Each micro-batch's forward and backward in turn (gradient accumulation)."""
        total = torch.zeros((), device=env.device)
        pieces = env.microbatches(inputs, target, coords)
        for i, (mb_inputs, mb_target) in enumerate(pieces):
            weight = env.loss_weight(mb_target)  # its share of the global valid targets (1.0 unpadded)
            # ZeRO: per-micro-batch gathers / reduce-scatters; DP: the last backward starts the
            # bucket all-reduces; the meter counts saved activations.
            with (env.memory.microbatch(self.gm), env.grad_sync.microbatch(last=i == len(pieces) - 1),
                  keeping_shards(self._regathers)):  # innermost: SP's gathered inputs saved as shards (ops/regather.py)
                scope = MicrobatchScope(self._forward)  # see its docstring: torch's MemTracker
                loss = weighted_loss(scope(*mb_inputs, mb_target), weight)
                (loss / self.plan.mb).backward()
            total += loss.detach().float() / self.plan.mb
        return StepOutput(total)

    def evaluate(self, env, inputs: tuple, target: Any, coords: dict[str, int]) -> StepOutput:
        """Forward only (the caller holds ``torch.no_grad`` and eval mode): the mean loss."""
        total = torch.zeros((), device=env.device)
        for mb_inputs, mb_target in env.microbatches(inputs, target, coords):
            scope = MicrobatchScope(self._forward)
            loss = weighted_loss(scope(*mb_inputs, mb_target), env.loss_weight(mb_target))
            total += loss.detach().float() / self.plan.mb
        return StepOutput(total)

    def describe_stage(self, stage: int) -> torch.fx.GraphModule:
        """The whole graph (the only pipeline stage, 0)."""
        if stage != 0:
            raise AutoparError(f"autopar: stage {stage} does not exist; plan '{self.plan}' has 1 pipeline "
                               "stage (0).")
        return self.gm
