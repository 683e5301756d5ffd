"""The packing plan: which bytes of which tensor go where in which bucket, sent by which sender.

Pure arithmetic on names, dtypes and shapes (and a sharded tensor's largest shard), so it can
be tested with huge sizes on the ``meta`` device, and so that every sender computes the same
plan from the same tensors without asking the others.

Terms (the package docstring defines bucket and chunk):

* **sender** -- a rank that sends; with ``N`` senders, sender ``i`` is the ``i``-th of the
  group ranks given as ``senders``.
* **round** -- ``N`` buckets, one per sender, sent in sender order: bucket ``k`` of a sync
  belongs to round ``k // N`` and is sent by sender ``k % N``. With one sender a round is a
  bucket.
* **whole tensor** -- a tensor that every sender holds entirely (a plain tensor): one sender
  sends it.
* **sharded tensor** -- a DTensor: every sender holds one *shard* (its piece) and sends it. Its
  *footprint* is the size of its largest shard; the planner gives it the same place (offset,
  and the same range of the shard's bytes when a chunk is cut) in every bucket of a round, so
  a sender's shard goes where its footprint says, and all the shards of a tensor arrive in the
  same round(s).

Each tensor (or footprint) starts at an offset aligned to ``max(element size, MIN_ALIGN)``
bytes. The buckets of a round stay open until the round is sent. A whole tensor that fits in a
bucket is never split: it goes to the bucket of the round, among those with room for it, whose
sender has the fewest bytes so far in the sync (so that every sender gets an equal share of the
bytes, within a bucket), and to the next round when none has room; a larger one fills the room
left, in the same order, and continues in the following rounds, every chunk a whole number of
elements. A sharded tensor is placed after everything already in the round, in every bucket of
it. With one sender this is the first format's packer: a tensor moves to a fresh bucket when
the current one lacks room, and only a tensor larger than a bucket is split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from ._common import WeightSyncError
from .format import Entry, dtype_name

MIN_ALIGN = 256

#: A :class:`Place`'s sender for a sharded tensor's piece: every sender (each sends its shard).
EVERY = -1


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class Place:
    """Where a piece goes: bucket ``sender`` (or :data:`EVERY`) of the current round, at
    ``offset``; it holds bytes ``[start, start + nbytes)`` of the tensor (of each shard, for a
    sharded tensor: a shard shorter than that sends what it has of the range)."""

    sender: int
    offset: int
    start: int
    nbytes: int


#: What the planner returns for a tensor: its places in order, and ``NEXT_ROUND`` where the
#: current round is complete (every sender sends its bucket of it) before the next place.
NEXT_ROUND = None
Step = Optional[Place]


class RoundPlanner:
    """Lays tensors out in rounds of ``senders`` buckets of ``bucket_bytes`` each (module
    docstring). Every sender runs one over the same tensors, in the same order."""

    def __init__(self, bucket_bytes: int, senders: int = 1, window_halves: bool = False):
        if senders < 1:
            raise ValueError(f"weight sync: {senders} senders")
        self.cap = int(bucket_bytes)
        self.n = int(senders)
        # One sender whose buckets take turns in the two halves of a shared window: a tensor of
        # one to two buckets starts in the first half, so that its pieces lie back to back there
        # and receivers read it whole (receiver._straddling).
        self.window_halves = window_halves and self.n == 1
        self.round = 0
        self.load = [0] * self.n  # bytes placed in each sender's buckets so far
        self._reset()

    def _reset(self) -> None:
        self.used = [0] * self.n
        self.nonempty = [False] * self.n  # a bucket has entries (zero-size ones count)

    def _next_round(self, out: list) -> None:
        out.append(NEXT_ROUND)
        self.round += 1
        self._reset()

    def _pick(self, fits) -> Optional[int]:
        """The bucket of the round, among those that ``fits``, whose sender has the fewest bytes
        so far in the sync (the lowest sender on a tie); None when none fits."""
        best = None
        for i in range(self.n):
            if fits(i) and (best is None or self.load[i] + self.used[i] < self.load[best] + self.used[best]):
                best = i
        return best

    def _place(self, out: list, i: int, off: int, start: int, nbytes: int) -> None:
        out.append(Place(i, off, start, nbytes))
        self.used[i] = off + nbytes
        self.load[i] += nbytes
        self.nonempty[i] = True

    def _too_small(self, name: str, dtype: torch.dtype, elsize: int) -> WeightSyncError:
        return WeightSyncError(
            f"weight sync: bucket of {self.cap} bytes cannot hold one element "
            f"of {name!r} ({dtype_name(dtype)}, {elsize} bytes)"
        )

    def add_whole(self, name: str, dtype: torch.dtype, nbytes: int, elsize: int) -> list[Step]:
        """A tensor of ``nbytes`` that one sender sends (a plain tensor)."""
        out: list[Step] = []
        if nbytes == 0:
            i = self._pick(lambda i: True)
            self.nonempty[i] = True
            out.append(Place(i, 0, 0, 0))
            return out
        align = max(elsize, MIN_ALIGN)
        done = 0
        while done < nbytes:
            if done == 0 and nbytes <= self.cap:  # never split: in one bucket with room for it
                i = self._pick(lambda i: _align_up(self.used[i], align) + nbytes <= self.cap)
                if i is None:
                    self._next_round(out)
                    continue
                self._place(out, i, _align_up(self.used[i], align), 0, nbytes)
                done = nbytes
                continue
            # larger than a bucket: chunks fill the room left, round after round
            if done == 0 and self._in_second_half() and nbytes <= 2 * self.cap:
                self._next_round(out)
                continue
            i = self._pick(lambda i: _align_up(self.used[i], align) + elsize <= self.cap)
            if i is None:
                if not any(self.nonempty):
                    raise self._too_small(name, dtype, elsize)
                self._next_round(out)
                continue
            off = _align_up(self.used[i], align)
            take = min(nbytes - done, (self.cap - off) // elsize * elsize)
            self._place(out, i, off, done, take)
            done += take
        return out

    def _in_second_half(self) -> bool:
        """The current bucket is a window's second half and holds something already."""
        return self.window_halves and self.round % 2 == 1 and self.nonempty[0]

    def add_sharded(self, name: str, dtype: torch.dtype, footprint: int, elsize: int) -> list[Step]:
        """A sharded tensor whose largest shard has ``footprint`` bytes (more than 0): every
        sender sends its shard, at the same places."""
        if self.n == 1:
            return self.add_whole(name, dtype, footprint, elsize)
        out: list[Step] = []
        align = max(elsize, MIN_ALIGN)
        done = 0
        while done < footprint:
            off = _align_up(max(self.used), align)
            room = max(0, self.cap - off)
            remaining = footprint - done
            started = any(self.nonempty)
            if remaining <= room:
                take = remaining
            elif done == 0 and footprint <= self.cap and started:
                self._next_round(out)
                continue
            else:
                take = room // elsize * elsize
                if take == 0:
                    if not started:
                        raise self._too_small(name, dtype, elsize)
                    self._next_round(out)
                    continue
            out.append(Place(EVERY, off, done, take))
            self.used = [off + take] * self.n
            self.load = [x + take for x in self.load]
            self.nonempty = [True] * self.n
            done += take
            if done < footprint:
                self._next_round(out)
        return out


class Packer:
    """One sender's planner in the form of the first wire format's tests: ``add`` returns one
    tensor's pieces in order, each an :class:`Entry` of the *current* bucket, or ``None``,
    which means the current bucket is full and must be sent before the next piece."""

    def __init__(self, bucket_bytes: int):
        self.planner = RoundPlanner(bucket_bytes, 1)

    def add(self, name: str, dtype: torch.dtype, shape, elsize: int) -> list[Optional[Entry]]:
        shape = tuple(int(s) for s in shape)
        total = elsize
        for s in shape:
            total *= s
        return [
            None if p is NEXT_ROUND else Entry(name, dtype, shape, p.offset, p.nbytes, p.start, total)
            for p in self.planner.add_whole(name, dtype, total, elsize)
        ]


def plan_buckets(named_tensors, bucket_bytes: int, senders: int = 1, window_halves: bool = False) -> list[list[list]]:
    """The bucket layouts a sync of whole tensors would produce: a list of buckets in the
    order they are sent (bucket ``k`` by sender ``k % senders``), each a list of entries as
    they travel, ``[name, dtype, shape, offset, nbytes, chunk_offset, total_nbytes]``. Reads
    only dtypes and shapes, so tensors on the ``meta`` device work (used by the tests).
    ``window_halves``: the layout of one sender through a shared window (RoundPlanner)."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    planner = RoundPlanner(bucket_bytes, senders, window_halves)
    rounds: list[list[list]] = [[[] for _ in range(senders)]]
    for name, t in named_tensors:
        shape = tuple(t.shape)
        total = t.numel() * t.element_size()
        for p in planner.add_whole(name, t.dtype, total, t.element_size()):
            if p is NEXT_ROUND:
                rounds.append([[] for _ in range(senders)])
            else:
                rounds[-1][p.sender].append(Entry(name, t.dtype, shape, p.offset, p.nbytes, p.start, total).encode())
    return [bucket for r in rounds for bucket in r]


def shard_boxes(shape, mesh_shape, coordinate, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shard of a tensor of ``shape`` that mesh ``coordinate`` holds under ``placements``
    (Shard and Replicate only): its sizes and its offsets per dimension. torch's arithmetic
    (``Shard.local_shard_size_and_offset``): along a dimension of ``L`` split ``m`` ways, chunk
    ``c`` starts at ``c * ceil(L / m)``; the last chunks may be shorter or empty; shards on
    the same tensor dimension nest in mesh-dimension order."""
    sizes = [int(s) for s in shape]
    offsets = [0] * len(sizes)
    for md, p in enumerate(placements):
        dim = getattr(p, "dim", None)
        if dim is None:
            continue
        length, m, c = sizes[dim], int(mesh_shape[md]), int(coordinate[md])
        chunk = -(-length // m) if length else 0
        start = min(c * chunk, length)
        sizes[dim] = max(0, min(length, start + chunk) - start)
        offsets[dim] += start
    return tuple(sizes), tuple(offsets)

