"""What the weight-sync modules share: the error, the statistics, and small group/device helpers."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the bucket and the tensors in flight."""


@dataclass
class SyncStats:
    """What one ``send``/``receive`` moved. ``bytes`` counts the bytes of the buckets' entries (no
    padding): the tensors' bytes, except in a delta sync (their encoding) and an fp8 sync (the
    fp8 values and the scales)."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    #: The buckets went through the shared window (read in place), not broadcast.
    shared_window: bool = False
    #: The sender's payload ("full", "delta" or "fp8"); a receiver learns it from the hello.
    payload: str = "full"
    #: The bytes of the tensors (or ranges) brought up to date: ``bytes`` before encoding.
    tensor_bytes: int = 0
    #: A delta sync: the elements it covered, how many of them changed, and how many ranges
    #: travelled in full (no base, or a delta that would not have been smaller).
    elements: int = 0
    changed: int = 0
    full_ranges: int = 0

    @property
    def gbps(self) -> float:
        """Payload throughput in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"{self.tensors} tensors, {self.bytes / 1e6:.1f} MB in {self.buckets} buckets, "
            f"{self.seconds:.3f} s, {self.gbps:.2f} GB/s"
        )


def broadcast(group, tensor: torch.Tensor, src: int):
    """``group``'s broadcast of one tensor from group rank ``src`` (async: returns the Work)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def vote(group, yes: bool) -> bool:
    """Whether every rank of ``group`` says yes (a MIN all-reduce of a 0/1 flag)."""
    flag = torch.tensor([1 if yes else 0], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def all_gather(group, tensor: torch.Tensor) -> list[list[int]]:
    """Every rank's ``tensor`` (a small int64 record), as lists, in rank order (blocking)."""
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    group.allgather([out], [tensor]).wait()
    return [t.cpu().tolist() for t in out]


#: The tag of the weight sync's point-to-point messages (buckets from one of several senders).
TAG = 0


def _coalesces(group) -> bool:
    """Whether ``group`` runs coalesced sends and receives as one operation whose transfers
    proceed at once (xccl_rs: one phase); other backends take them one by one."""
    return group.name() == "xccl_rs"


def send_each(group, tensor: torch.Tensor, dsts: list[int]) -> list:
    """Sends ``tensor`` to each group rank of ``dsts`` (async: the Works). On xccl_rs the sends
    are one operation, so that every destination's link carries its copy at the same time (a
    group's operations otherwise run one after another)."""
    return _p2p_each(group, [(tensor, d) for d in dsts], [])


def recv_each(group, recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Receives each ``(tensor, group rank)`` pair (async: the Works), as one operation on xccl_rs,
    so that every source's link carries its part at the same time."""
    return _p2p_each(group, [], recvs)


def _p2p_each(group, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> list:
    """Posts every ``(tensor, group rank)`` send and receive, as one operation where the group
    coalesces them (async: the Works to wait for)."""
    if not _coalesces(group) or len(sends) + len(recvs) < 2:
        return [group.send([t], d, TAG) for t, d in sends] + [group.recv([t], r, TAG) for t, r in recvs]
    device = (sends or recvs)[0][0].device
    group._start_coalescing(device)
    try:
        for t, d in sends:
            group.send([t], d, TAG)
        for t, r in recvs:
            group.recv([t], r, TAG)
    finally:
        work = group._end_coalescing(device)
    return [work]


def group_senders(group, senders, src: int, who: str) -> tuple[int, int, list[int]]:
    """This rank of ``group``, the group's size, and the senders' group ranks: ``senders``
    (distinct ranks of the group, in the order that numbers them), or ``[src]``."""
    if group is None:
        raise ValueError("weight sync: a process group is required (e.g. xccl_rs.new_group(...))")
    rank, size = group.rank(), group.size()
    return rank, size, _resolve_senders(senders, src, size, who)


def _resolve_senders(senders, src: int, size: int, who: str) -> list[int]:
    if senders is None:
        if not 0 <= src < size:
            raise ValueError(f"{who}: src {src} is not a rank of a group of size {size}")
        return [src]
    out = [int(r) for r in senders]
    if not out:
        raise ValueError(f"{who}: senders is empty")
    bad = [r for r in out if not 0 <= r < size]
    if bad:
        raise ValueError(f"{who}: senders {bad} are not ranks of a group of size {size}")
    if len(set(out)) != len(out):
        raise ValueError(f"{who}: senders {out} name a rank twice")
    return out


def flat_views(t: torch.Tensor, e0: int, e1: int):
    """Views of ``t`` that together hold its elements ``[e0, e1)`` in row-major order, in that
    order, without a copy: a partial first row, a block of whole rows, a partial last row
    (recursively), or one flat view when ``t`` is contiguous."""
    if e1 <= e0:
        return
    if t.is_contiguous():
        yield t.reshape(-1)[e0:e1]  # reshape of a contiguous tensor is a view
        return
    if t.dim() == 1:
        yield t[e0:e1]
        return
    inner = t[0].numel()
    r0, o0 = divmod(e0, inner)
    r1, o1 = divmod(e1, inner)
    if r0 == r1:
        yield from flat_views(t[r0], o0, o1)
        return
    if o0:
        yield from flat_views(t[r0], o0, inner)
        r0 += 1
    if r1 > r0:
        yield t[r0:r1]
    if o1:
        yield from flat_views(t[r1], 0, o1)


def read_flat_range(dst: torch.Tensor, src: torch.Tensor, e0: int, e1: int, non_blocking: bool = False) -> None:
    """dst (1-D, e1 - e0 elements) <- elements [e0, e1) of src in row-major order; every element
    copied once, straight from src's strides (no .contiguous() temporary)."""
    pos = 0
    for v in flat_views(src, e0, e1):
        n = v.numel()
        dst[pos : pos + n].view(v.shape).copy_(v, non_blocking=non_blocking)
        pos += n


def write_flat_range(dst: torch.Tensor, src: torch.Tensor, e0: int, e1: int, non_blocking: bool = False) -> None:
    """Elements [e0, e1) of dst, in row-major order, <- src (1-D, e1 - e0 elements)."""
    pos = 0
    for v in flat_views(dst, e0, e1):
        n = v.numel()
        v.copy_(src[pos : pos + n].view(v.shape), non_blocking=non_blocking)
        pos += n


def resolve_device(device) -> torch.device:
    """``device`` with its index: ``"cuda"`` means the current CUDA device, so that buffers
    allocated there compare equal to it (``torch.device("cuda") != torch.device("cuda", 0)``)."""
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "current_device"):
            device = torch.device(device.type, mod.current_device())
    return device


def synchronize(device: torch.device) -> None:
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(device)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor (any device), copied to host. Not ``bytes(t.numpy())``:
    ``.numpy()`` needs numpy, which torch does not bring (``pip install torch`` has none)."""
    t = t.detach().cpu().contiguous()
    if t.dtype != torch.uint8:
        raise TypeError(f"tensor_bytes: expected a uint8 tensor, got {t.dtype}")
    # string_at copies numel bytes from the tensor's first element (its storage offset included);
    # `t` is a contiguous host tensor that stays alive for the call.
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


GB = 1e9  # the progress bars count in decimal GB and GB/s, as SyncStats.gbps and the demo's summary do


def progress_bar(enabled: bool, total: Optional[int], desc: str):
    """A tqdm bar that is updated in bytes and shows decimal GB and GB/s (``0.16/0.29 GB [00:01<00:01,
    0.15 GB/s]``); None when disabled or tqdm is missing. ``total``: bytes, or None if unknown."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    if total:
        fmt = "{desc}: {percentage:3.0f}%|{bar}| {n:.2f}/{total:.2f} GB [{elapsed}<{remaining}, {rate_noinv_fmt}]"
    else:
        fmt = "{desc}: {n:.2f} GB [{elapsed}, {rate_noinv_fmt}]"
    # unit_scale=1/GB: tqdm scales the count, the total and the rate (rate_noinv_fmt: "%5.2f GB/s").
    return tqdm(total=total or None, desc=desc, unit=" GB", unit_scale=1 / GB, bar_format=fmt, leave=False)


def describe(index: int, names: list[str]) -> str:
    """``bucket 3 (12 tensors: 'a', 'b', 'c', ... (+9))``, for error messages."""
    if not names:
        return f"bucket {index} (empty)"
    shown = ", ".join(repr(n) for n in names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
    return f"bucket {index} ({len(names)} tensors: {shown})"
