"""The packing plan: which bytes of which tensor go where in which bucket.

Pure arithmetic on names, dtypes and shapes, so it can be tested with huge sizes on the
``meta`` device. Each tensor starts at an offset aligned to ``max(element size, MIN_ALIGN)``
bytes. A tensor that fits in a bucket is never split (it starts a fresh bucket when the
current one lacks room); a larger one fills the room left and continues in the following
buckets, every chunk a whole number of elements.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from ._common import WeightSyncError
from .format import Entry, dtype_name

MIN_ALIGN = 256


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class Packer:
    """Streams tensors (name, dtype, shape, element size) into bucket layouts.

    ``add`` returns one tensor's pieces in order: each an :class:`Entry` of the *current*
    bucket, or ``None``, which means the current bucket is full and must be sent before the
    next piece.
    """

    def __init__(self, bucket_bytes: int):
        self.cap = int(bucket_bytes)
        self.used = 0
        self.nonempty = False  # the current bucket has entries (zero-size ones count)

    def _new_bucket(self) -> None:
        self.used = 0
        self.nonempty = False

    def add(self, name: str, dtype: torch.dtype, shape, elsize: int) -> list[Optional[Entry]]:
        shape = tuple(int(s) for s in shape)
        total = elsize
        for s in shape:
            total *= s
        out: list[Optional[Entry]] = []
        if total == 0:
            self.nonempty = True
            out.append(Entry(name, dtype, shape, 0, 0, 0, 0))
            return out
        align = max(elsize, MIN_ALIGN)
        done = 0
        while done < total:
            off = _align_up(self.used, align)
            room = max(0, self.cap - off)
            remaining = total - done
            if remaining <= room:
                out.append(Entry(name, dtype, shape, off, remaining, done, total))
                self.used = off + remaining
                self.nonempty = True
                done = total
            elif done == 0 and total <= self.cap and self.nonempty:
                out.append(None)  # flush, then place the whole tensor in a new bucket
                self._new_bucket()
            else:
                take = room // elsize * elsize
                if take == 0:
                    if not self.nonempty:
                        raise WeightSyncError(
                            f"weight sync: bucket of {self.cap} bytes cannot hold one element "
                            f"of {name!r} ({dtype_name(dtype)}, {elsize} bytes)"
                        )
                    out.append(None)
                    self._new_bucket()
                    continue
                out.append(Entry(name, dtype, shape, off, take, done, total))
                self.used = off + take
                self.nonempty = True
                done += take
                if done < total:
                    out.append(None)
                    self._new_bucket()
        return out


def plan_buckets(named_tensors, bucket_bytes: int) -> list[list[list]]:
    """The bucket layouts ``send`` would produce: a list of buckets, each a list of entries as
    they travel, ``[name, dtype, shape, offset, nbytes, chunk_offset, total_nbytes]``. Reads
    only dtypes and shapes, so tensors on the ``meta`` device work (used by the tests)."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    packer = Packer(bucket_bytes)
    buckets: list[list] = [[]]
    for name, t in named_tensors:
        for entry in packer.add(name, t.dtype, tuple(t.shape), t.element_size()):
            if entry is None:
                buckets.append([])
            else:
                buckets[-1].append(entry.encode())
    return buckets
