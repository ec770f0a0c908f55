"""Load only this rank's data: which part of each global batch a rank computes, and a sampler.

``pm.train_step(inputs, target)`` takes the global batch, identical on every rank, and cuts
this rank's part (:mod:`autopar.runtime.stepping.batching`).  At scale a rank should load only that
part and call ``pm.train_step(inputs, target, local=True)``:

* :class:`BatchSlice` (from ``pm.batch_slice(global_batch_size, seq_len)`` or, without a
  process group, :meth:`BatchSlice.for_rank`) says which rows of the global batch this rank
  needs (``rows``: the contiguous data-parallel slice) and, under context parallelism,
  which global sequence positions (``positions``: two load-balanced chunks);
  :meth:`BatchSlice.take` cuts a global-batch tensor ``[B, S, ...]`` down to that part.
  Ranks of one ``dp``/``cp`` coordinate (every ``tp`` rank, every pipeline stage) need the
  same part.
* :class:`DistributedBatchSampler` is a ``torch.utils.data`` batch sampler that yields, for
  each global batch, the dataset indices of this rank's rows, in the same global order on
  every rank; under cp, :meth:`BatchSlice.take_positions` then cuts the sequence.

The rules (rows, positions, divisibility) are :mod:`autopar.runtime.stepping.batching`'s, shared
with the global path, so a local step computes exactly what the global step computes.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import Sampler

from autopar.errors import AutoparError
from autopar.runtime.stepping.batching import cut_positions, cut_rows, rank_positions, rank_rows

__all__ = ["BatchSlice", "DistributedBatchSampler"]


@dataclasses.dataclass(frozen=True, eq=False)
class BatchSlice:
    """The part of a global batch of ``global_batch_size`` rows (of ``seq_len`` tokens) one rank computes.

    ``rows``: the rows of the global batch (``dp_rank * B/dp ... (dp_rank+1) * B/dp``);
    ``positions``: under cp, the global token indices of this rank's sequence chunks, else None.
    """

    global_batch_size: int
    rows: range
    seq_len: int | None = None
    positions: torch.Tensor | None = None

    @classmethod
    def for_rank(cls, plan, coords: Mapping[str, int], global_batch_size: int,
                 seq_len: int | None = None) -> "BatchSlice":
        """The slice of the rank at ``coords`` (mesh axis -> rank; missing axes are 0) under ``plan``.

        Only the ``dp`` and ``cp`` coordinates matter.  Raises an ``autopar:`` error if the
        batch does not split into ``dp*mb`` parts, or, under cp, if ``seq_len`` is missing or
        not a multiple of ``2*cp``.
        """
        if plan.cp > 1 and seq_len is None:
            raise AutoparError(
                f"autopar: plan '{plan}' has context parallelism (cp={plan.cp}), so each rank keeps only "
                f"part of the sequence; pass seq_len (the global sequence length, a multiple of "
                f"2*cp = {2 * plan.cp}) to batch_slice.")
        if seq_len is not None:
            plan.validate(seq_len=seq_len)
        rows = rank_rows(global_batch_size, plan, coords.get("dp", 0))
        positions = rank_positions(seq_len, plan, coords.get("cp", 0)) if seq_len is not None else None
        return cls(global_batch_size, rows, seq_len, positions)

    @property
    def local_batch_size(self) -> int:
        """How many rows this rank computes (``B / dp``)."""
        return len(self.rows)

    @property
    def local_seq_len(self) -> int | None:
        """How many tokens of each row this rank computes (``S / cp``; ``seq_len`` without cp)."""
        return len(self.positions) if self.positions is not None else self.seq_len

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a global-batch tensor ``[B, S, ...]``: its rows (dim 0) and,
        under cp, its positions (dim 1, when it has ``seq_len`` entries there)."""
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != self.global_batch_size:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise AutoparError(
                f"autopar: BatchSlice.take expects a global-batch tensor with {self.global_batch_size} rows "
                f"on dim 0; got {shape}. Tensors that are not per-sample pass to train_step unchanged.")
        return self.take_positions(cut_rows(tensor, self.global_batch_size, self.rows))

    def take_positions(self, tensor: torch.Tensor) -> torch.Tensor:
        """Under cp, this rank's positions of a tensor that already holds this rank's rows (from
        :class:`DistributedBatchSampler`): dim 1, when it has ``seq_len`` entries; else as it is."""
        return cut_positions(tensor, self.seq_len, self.positions)

    def _key(self) -> tuple:
        pos = tuple(self.positions.tolist()) if self.positions is not None else None
        return self.global_batch_size, self.rows, self.seq_len, pos

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchSlice) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _rows_of(pm_or_slice: Any, global_batch_size: int) -> range:
    """This rank's rows, from a :class:`BatchSlice` or a ``ParallelModule`` (no seq_len needed)."""
    if isinstance(pm_or_slice, BatchSlice):
        if pm_or_slice.global_batch_size != global_batch_size:
            raise AutoparError(
                f"autopar: the BatchSlice is of a global batch of {pm_or_slice.global_batch_size} rows, "
                f"but the sampler was given global_batch_size={global_batch_size}; use the same size.")
        return pm_or_slice.rows
    dp_rank = pm_or_slice.coords().get("dp", (0, 1))[0]
    return rank_rows(global_batch_size, pm_or_slice.plan, dp_rank)


class DistributedBatchSampler(Sampler[list[int]]):
    """Batch sampler giving this rank's rows of each global batch: ``DataLoader(dataset, batch_sampler=...)``.

    The dataset indices ``0 .. dataset_len-1`` are ordered (``shuffle``: by a permutation from
    ``seed + epoch``, the same on every rank, as ``torch.utils.data.DistributedSampler`` does;
    call :meth:`set_epoch` each epoch) and cut into global batches of ``global_batch_size``;
    for each one this yields the indices at this rank's rows (``BatchSlice.rows``), so the
    loader's batch is ``batch_slice.take`` of the global batch but for the sequence cut.  Under
    cp, apply ``batch_slice.take_positions`` to the loaded tensors (a no-op without cp).

    ``pm_or_slice`` is the ``ParallelModule`` or this rank's :class:`BatchSlice`.
    ``drop_last=True`` drops a last incomplete global batch; ``False`` completes it with indices
    from the start of the order (as ``DistributedSampler`` pads), so every batch is full.

    Its position is resumable: :meth:`state_dict` is the epoch and how many global batches of it
    this sampler has handed out, the same on every rank and under every plan (the order is
    global; only the rows taken from each batch depend on the dp rank), and
    :meth:`load_state_dict` makes the next iteration continue from there, so a run resumed on
    any dp size sees the samples the uninterrupted run would have.  ``pm.save(path, data=sampler)``
    and ``pm.load(path, data=sampler)`` keep it in the checkpoint.  The count is of batches handed
    out: a ``DataLoader`` with worker processes asks for some ahead of the step
    (``num_workers * prefetch_factor``), so save from a loader without workers, or use torchdata's
    ``StatefulDataLoader``, which saves what it has delivered.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, pm_or_slice: Any, shuffle: bool = False,
                 seed: int = 0, drop_last: bool = True):
        if dataset_len < 1 or (drop_last and dataset_len < global_batch_size):
            raise AutoparError(
                f"autopar: a dataset of {dataset_len} samples holds no full global batch of "
                f"{global_batch_size}; use a smaller global batch or drop_last=False.")
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.rows = _rows_of(pm_or_slice, global_batch_size)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0  # global batches of this epoch handed out (the next iteration starts here)
        self._loaded = False  # the position came from load_state_dict: continue it even at the epoch's end

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration yields (with ``shuffle``); another epoch starts
        at its first batch, the current one where it stands."""
        if epoch != self.epoch:
            self.position = 0
        self.epoch = epoch

    def state_dict(self) -> dict:
        """The position (epoch, batches handed out) and what fixes the order, independent of the rank."""
        return {"epoch": self.epoch, "position": self.position, "dataset_len": self.dataset_len,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle, "seed": self.seed,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (of a sampler over the same data, under any plan): the next
        iteration yields the epoch's batches from the saved position on."""
        fixed = ("dataset_len", "global_batch_size", "shuffle", "seed", "drop_last")
        differ = [f"{k}={state.get(k)!r} (this sampler: {getattr(self, k)!r})" for k in fixed
                  if state.get(k) != getattr(self, k)]
        if differ:
            raise AutoparError(f"autopar: the saved data position is of another sampler: {', '.join(differ)}; "
                               "expected the same dataset length, global batch, shuffle, seed and drop_last, "
                               "since a position means nothing in another order; build the sampler as the "
                               "saved run did.")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._loaded = True

    def __len__(self) -> int:
        if self.drop_last:
            return self.dataset_len // self.global_batch_size
        return math.ceil(self.dataset_len / self.global_batch_size)

    def _order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        padding = len(self) * self.global_batch_size - len(order)
        if padding > 0:
            order += (order * math.ceil(padding / len(order)))[:padding]
        return order

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        size = self.global_batch_size
        # A finished epoch iterated again starts over (as it always did); a loaded position
        # continues, even at the epoch's end (then nothing is left of it: the caller's next
        # set_epoch starts the next one), as does an interrupted iteration.
        start = self.position if self.position < len(self) or self._loaded else 0
        self._loaded = False
        for b in range(start, len(self)):
            batch = order[b * size:(b + 1) * size]
            self.position = b + 1
            yield [batch[i] for i in self.rows]
