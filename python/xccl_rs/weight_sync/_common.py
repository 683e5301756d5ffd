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
    """What one ``send``/``receive`` moved. ``bytes`` counts tensor payload (no padding)."""

    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    #: The buckets went through the shared window (read in place), not broadcast.
    shared_window: bool = False

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


def group_rank_size(group) -> tuple[int, int]:
    if group is None:
        raise ValueError("weight sync: a process group is required (e.g. xccl_rs.new_group(...))")
    return group.rank(), group.size()


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
