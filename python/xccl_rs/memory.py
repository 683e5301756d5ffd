"""Tensors in shared memory that the ranks of a host read in place.

Each rank of a group whose ranks are all on one host has a *heap*: shared memory that every
peer has mapped (sparse: it costs memory only for what is allocated, ``XCCL_RS_SHM_HEAP_BYTES``
of address space). A collective whose tensors lie in the heaps on every rank reads the peers'
tensors where they are, with no copy through the shared-memory slots: an all-reduce (past its
one-shot limit, 9 KiB at 8 ranks) then moves 2 bytes of memory per byte of tensor instead of 5
(docs/perf.md).

Two ways in, the same memory:

- :func:`empty`, like ``torch.empty``;
- torch's backend allocator interface: ``group._get_backend(torch.device("cpu"))`` has
  ``supports_tensor_alloc(device)``, ``allocate_tensor(numel, dtype=..., device=...)`` and
  ``mem_allocator``.

Everything else keeps working on ordinary tensors, and mixing them is allowed: when some rank's
tensor is not in its heap, that op runs through the slots on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["empty", "zeros", "zero_copy_ops"]


def _backend(group: dist.ProcessGroup | None):
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("xccl_rs.empty: no group given and the default group is not initialized")
    return group._get_backend(torch.device("cpu"))


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], Sequence):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def empty(*size, dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A CPU tensor of ``size`` in this rank's shared-memory heap of ``group`` (default: the
    default group), like ``torch.empty(*size, dtype=dtype)``. Collectives of ``group`` on it are
    zero-copy when the peers' tensors are in their heaps too. Where the group has no heap (its
    ranks span hosts, ``XCCL_RS_TRANSPORT=tcp``, ``XCCL_RS_SHM_HEAP_BYTES=0``, or its CPU backend
    is not xccl_rs) this is ``torch.empty``. Its memory goes back to the system when the tensor is
    freed; it stays valid after the group is destroyed. It cannot be resized."""
    shape = _shape(size)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    backend = _backend(group)
    cpu = torch.device("cpu")
    if backend.name() != "xccl_rs" or not backend.supports_tensor_alloc(cpu):
        return torch.empty(shape, dtype=dtype)
    return backend.allocate_tensor(math.prod(shape), dtype=dtype, device=cpu).view(shape)


def zeros(*size, dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`empty`, filled with zeros."""
    return empty(*size, dtype=dtype, group=group).zero_()


def zero_copy_ops(group: dist.ProcessGroup | None = None) -> int:
    """How many collectives of ``group``'s CPU backend so far read the peers' tensors in place."""
    from . import _C

    return _C.zero_copy_ops(_backend(group))
