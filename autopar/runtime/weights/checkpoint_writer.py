"""Writing one program's checkpoints, blocking or in the background: at most one save in flight.

:func:`autopar.runtime.weights.checkpoint.save` stages the state (``pm.checkpoint_state()``: host copies,
made in the training thread because ZeRO's reads are collectives) and hands it to the
:class:`CheckpointWriter` the program owns, which writes it with ``torch.distributed.checkpoint``
into the temporary directory and, once every rank's part is written, has rank 0 switch it in
(:func:`autopar.runtime.weights.checkpoint_files.commit`) and apply retention.

* ``blocking=True``: ``dcp.save``, then the commit, in the caller.
* ``blocking=False``: ``dcp.async_save`` (its thread executor) returns at once; the commit runs
  when its future completes, in that thread.  :meth:`CheckpointWriter.wait` joins it and raises
  what went wrong.  A new save (or a load) waits for the one in flight first.

What DCP cannot do, and why it is done here:

* **Staging.** ``async_save``'s default stager copies the state dict again; ours is already a
  copy in host memory that shares nothing with the program (into :attr:`CheckpointWriter.staging`,
  buffers kept from one background save to the next), so :class:`_AlreadyStaged` hands it over as
  it is (one copy per save, not two).
* **The switch.** DCP writes a directory; making it *the* checkpoint only once complete, and
  never leaving a half-written one under the user's name, is the link switch of
  :mod:`autopar.runtime.weights.checkpoint_files`.  DCP's future completes on rank 0 after its finish
  step (``.metadata`` written after every rank reported its writes), so rank 0 may switch then;
  a broadcast on the checkpoint group afterwards tells every rank the switch is done (or why
  not), so :meth:`CheckpointWriter.wait` returns on no rank before it.
* **Its own process group.** The background thread's collectives (DCP's plan exchange, the
  broadcast) must not interleave with the training thread's on a shared group: every save
  runs on a gloo group made for checkpoints (also what DCP needs of CPU tensors under NCCL).
"""
from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from autopar.errors import AutoparError
from autopar.runtime.weights.checkpoint_files import commit, retain

__all__ = ["CheckpointWriter"]


class _AlreadyStaged(AsyncStager):
    """A stager that copies nothing: ``checkpoint_state()`` made the host copies already."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass
class _Save:
    """One save: where it goes, and, once ``done`` is set, what went wrong (None: committed)."""

    path: str
    tmp_dir: str
    data_dir: str
    info: dict
    keep: int | None
    # Optimizer steps whose forward and backward the write may overlap: the last one's update
    # waits for it (None: no bound; the next save or wait_checkpoint waits).
    overlap_steps: int | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class CheckpointWriter:
    """The checkpoint writes of one :class:`autopar.runtime.module.ParallelModule`."""

    def __init__(self) -> None:
        self._pending: _Save | None = None
        self._group = None
        # Host buffers a background save stages into, by entry name, reused by the next one once
        # this one is written (as DCP's cache_staged_state_dict): copying into pages already
        # mapped costs a quarter of copying into fresh ones (benchmarks/checkpoint_stall.py).
        self.staging: dict = {}

    def _checkpoint_group(self):
        """The gloo group every save runs on, made at the first save (collective: every rank saves)."""
        if self._group is None and _distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def write(self, state: dict, path: str, tmp_dir: str, data_dir: str, info: dict, *,
              blocking: bool, keep: int | None, overlap_steps: int | None = None) -> None:
        """Write the staged ``state`` as the checkpoint ``path`` (collective: every rank calls it)."""
        self.wait()
        save = _Save(path, tmp_dir, data_dir, info, keep, overlap_steps)
        group = self._checkpoint_group()
        no_dist = not _distributed()
        if blocking:
            try:
                dcp.save(state, checkpoint_id=tmp_dir, process_group=group, no_dist=no_dist)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                save.error = exc
            self._finish(save, group)
            self._raise(save)
            return
        self._pending = save
        future = dcp.async_save(state, checkpoint_id=tmp_dir, process_group=group, no_dist=no_dist,
                                async_stager=_AlreadyStaged())
        future.add_done_callback(lambda f: self._written(save, group, f))

    def wait(self) -> None:
        """Join the save in flight, if any; raise what made it fail (the previous checkpoint stays)."""
        save, self._pending = self._pending, None
        if save is not None:
            save.done.wait()
            self._raise(save)

    def before_update(self) -> None:
        """Before an optimizer step (``train_step`` calls it): count the step against the save in
        flight's ``overlap_steps`` and, at the last one, wait until it is written and switched in, so
        the step it was saved at is durable before this one's update lands.  What went wrong is
        kept for :meth:`wait` to raise: the step itself goes on."""
        save = self._pending
        if save is None or save.overlap_steps is None:
            return
        save.overlap_steps -= 1
        if save.overlap_steps <= 0:
            save.done.wait()

    def _written(self, save: _Save, group, future: Future) -> None:
        """DCP's future completed (in its thread, or at once in the caller): switch the checkpoint in."""
        try:
            future.result()
        except BaseException as exc:
            save.error = exc
        self._finish(save, group)

    def _finish(self, save: _Save, group) -> None:
        """Rank 0 switches the written checkpoint in; every rank learns the outcome.  Sets ``done``."""
        try:
            if save.error is not None:  # DCP raised on every rank alike: nothing to switch in
                return
            outcome = [None]
            if not _distributed() or dist.get_rank() == 0:
                try:
                    commit(save.path, save.tmp_dir, save.data_dir, save.info)
                    if save.keep is not None:
                        retain(save.path, save.keep)
                except Exception as exc:
                    outcome[0] = f"{type(exc).__name__}: {exc}"
            if group is not None:
                dist.broadcast_object_list(outcome, src=0, group=group)
            if outcome[0] is not None:
                save.error = AutoparError(f"autopar: checkpoint {save.path} was written to {save.tmp_dir} but rank 0 "
                                          f"could not switch it in ({outcome[0]}); expected a writable directory; "
                                          "the previous checkpoint is unchanged.")
        except BaseException as exc:
            save.error = exc
        finally:
            save.done.set()

    @staticmethod
    def _raise(save: _Save) -> None:
        error = save.error
        if error is None:
            return
        if isinstance(error, AutoparError):
            raise error
        raise AutoparError(f"autopar: checkpoint {save.path} was not written ({type(error).__name__}: "
                           f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); the previous "
                           "checkpoint is unchanged; expected every rank to write its part: see the first "
                           "rank's error above.") from error
