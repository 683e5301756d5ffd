"""The copy floor of a weight sync on one host, measured in the same run as the sync.

A sync through the shared window copies every byte twice: the sender copies its tensors into
the window, then each rollout copies them out into its engine's parameters. The floor is those
copies alone, timed with the same tensors: the senders copy their tensors into a bucket-sized
buffer (the window's part), then the rollouts, all at once, copy a bucket-sized buffer into
every engine parameter. The floor is the slowest sender's time plus the slowest rollout's (the
two halves run one after the other here, while a sync overlaps them by buckets, so a sync can
come in under its floor on a machine with cores to spare).

Every process of the sync group calls :func:`measure` at the same point; it returns this
process's copy time, to be combined by the caller (:func:`floor_of`).
"""

from __future__ import annotations

import time

import torch


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as a flat uint8 view (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def sender_copy(tensors, bucket: torch.Tensor, limit: int | None = None) -> float:
    """Seconds to copy the tensors' bytes (the first `limit` of them, if given: a sender's share)
    into `bucket` (uint8), bucket after bucket."""
    free, at = bucket.numel(), 0
    left = float("inf") if limit is None else limit
    t0 = time.perf_counter()
    for t in tensors:
        if left <= 0:
            break
        src = _bytes_of(t)[: int(min(left, t.numel() * t.element_size()))]
        left -= src.numel()
        done = 0
        while done < src.numel():
            n = min(src.numel() - done, free - at)
            bucket[at:at + n].copy_(src[done:done + n])
            done, at = done + n, at + n
            if at == free:
                at = 0
    return time.perf_counter() - t0


def rollout_copy(engine, bucket: torch.Tensor) -> float:
    """Seconds to fill every engine tensor from `bucket` (uint8), bucket after bucket."""
    free, at = bucket.numel(), 0
    t0 = time.perf_counter()
    for t in engine:
        dst = _bytes_of(t)
        done = 0
        while done < dst.numel():
            n = min(dst.numel() - done, free - at)
            dst[done:done + n].copy_(bucket[at:at + n])
            done, at = done + n, at + n
            if at == free:
                at = 0
    return time.perf_counter() - t0


def measure(pg, sending, receiving, bucket_bytes: int, send_bytes: int | None = None) -> tuple[str, float]:
    """This process's part of the floor on group `pg`: ("send", seconds) where `sending` are the
    tensors it sends (`send_bytes` of them: its share, when several senders split them), ("load",
    seconds) where `receiving` are its engine's tensors. Every rank of `pg` calls it; the senders
    copy first, then the rollouts, each half between barriers."""
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8)
    bucket.fill_(1)  # its pages exist before the timing, as the window's do
    pg.barrier().wait()
    seconds = sender_copy(sending, bucket, send_bytes) if sending is not None else 0.0
    pg.barrier().wait()
    if receiving is not None:
        seconds = rollout_copy(receiving, bucket)
    pg.barrier().wait()
    return ("send" if sending is not None else "load"), seconds


def floor_of(parts) -> float:
    """The floor from every process's :func:`measure` result."""
    send = max((s for kind, s in parts if kind == "send"), default=0.0)
    load = max((s for kind, s in parts if kind == "load"), default=0.0)
    return send + load
