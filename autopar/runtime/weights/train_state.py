"""What a run needs to resume besides the weights and the optimizer: the step, dropout's RNG, the data position.

A checkpoint holds, next to :mod:`autopar.runtime.weights.state`'s ``model.*``, ``optim.*`` and
``sched.state`` entries:

* ``train.step``: how many optimizer steps the program has taken (``pm.num_steps_taken``);
* ``train.seed`` and ``rng.<stream>.<index>.<device type>``: the base seed of dropout's streams
  and the state of each stream a rank has drawn from, by the stream's index
  (:func:`autopar.ops.rng.stream_states`).  Ranks sharing a stream (the tp ranks of the
  replicated stream) hold the same state, and DCP writes it once.  Under the same plan a
  resumed run draws exactly the masks of the uninterrupted one; under another plan each rank
  continues the saved stream of its own index (a run under another plan draws other masks in
  any case: masks are drawn on each rank's shard);
* ``data.state``: the position of the data, from ``data.state_dict()`` of the object passed
  as ``pm.save(..., data=...)`` (a :class:`autopar.runtime.stepping.data.DistributedBatchSampler`:
  epoch and batches handed out, the same on every rank and independent of the plan, so a
  run resumed on any dp size sees the samples the uninterrupted run would have seen).

Every entry is a tensor, the same on the ranks sharing it.  :mod:`autopar.runtime.weights.checkpoint`
writes and reads them with the rest; :mod:`autopar.runtime.weights.state` calls
:func:`train_entries`, :func:`train_wants` and :func:`load_train_entries`.
"""
from __future__ import annotations

import pickle
from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.ops import rng

__all__ = ["STEP_KEY", "SEED_KEY", "RNG_PREFIX", "DATA_KEY", "train_entries", "train_wants",
           "load_train_entries", "pickled", "unpickled"]

STEP_KEY, SEED_KEY, RNG_PREFIX, DATA_KEY = "train.step", "train.seed", "rng.", "data.state"


def pickled(obj: Any) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor (a checkpoint entry for a plain Python value)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).clone()


def unpickled(t: torch.Tensor) -> Any:
    """The inverse of :func:`pickled`."""
    return pickle.loads(t.numpy().tobytes())


def train_entries(pm, data: Any = None) -> dict[str, torch.Tensor]:
    """This rank's ``train.*``, ``rng.*`` and (with ``data``) ``data.state`` entries."""
    step = pm.step_context
    out = {STEP_KEY: torch.tensor(pm.num_steps_taken, dtype=torch.int64),
           SEED_KEY: torch.tensor(step.seed - 2 ** 63, dtype=torch.int64)}  # a uint64 in an int64
    for (stream, index, device_type), state in rng.stream_states(step).items():
        out[f"{RNG_PREFIX}{stream}.{index}.{device_type}"] = state.clone()
    if data is not None:
        out[DATA_KEY] = pickled(_state_of(data))
    return out


def train_wants(pm, key: str, data: Any = None) -> bool | None:
    """Whether this rank loads entry ``key`` (None: not one of this module's entries)."""
    if key in (STEP_KEY, SEED_KEY):
        return True
    if key == DATA_KEY:
        return data is not None
    if key.startswith(RNG_PREFIX):
        stream, index, device_type = key[len(RNG_PREFIX):].split(".")
        return rng.stream_index(pm.step_context, stream) == int(index) and device_type == pm.device.type
    return None


def load_train_entries(pm, state: dict[str, torch.Tensor], data: Any = None) -> None:
    """Set the step count, dropout's streams and ``data``'s position from a checkpoint's entries
    (``state``: what :func:`train_wants` asked for).  A checkpoint without them (written before
    they existed) leaves the step at 0 and the streams fresh."""
    if STEP_KEY in state:
        pm.num_steps_taken = int(state[STEP_KEY])
    if SEED_KEY in state:
        saved = {}
        for key, value in state.items():
            if key.startswith(RNG_PREFIX):
                stream, index, device_type = key[len(RNG_PREFIX):].split(".")
                saved[(stream, int(index), device_type)] = value
        rng.restore_streams(pm.step_context, int(state[SEED_KEY]) + 2 ** 63, saved, pm.device)
    if data is not None:
        data.load_state_dict(unpickled(state[DATA_KEY]))


def _state_of(data: Any) -> Any:
    if not callable(getattr(data, "state_dict", None)) or not callable(getattr(data, "load_state_dict", None)):
        raise AutoparError(f"autopar: pm.save(..., data=...) got a {type(data).__name__}; expected an object with "
                           "state_dict() and load_state_dict() holding the data position (an "
                           "autopar.DistributedBatchSampler, or torchdata's StatefulDataLoader).")
    return data.state_dict()
