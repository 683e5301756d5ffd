"""The other ranks' role: receives the buckets a WeightSender sends and hands out the tensors (the
package docstring gives the protocol)."""

from __future__ import annotations

import time
from typing import Iterator, Optional

import torch

from . import window
from ._common import (
    SyncStats,
    WeightSyncError,
    broadcast,
    describe,
    group_rank_size,
    progress_bar,
    resolve_device,
    tensor_bytes,
)
from .format import HEADER_LEN, Announcement, BucketMeta, Entry, Header


class _Pending:
    """A tensor split across buckets, being reassembled."""

    __slots__ = ("name", "dtype", "shape", "tensor", "bytes", "done", "total")

    def __init__(self, entry: Entry, device: torch.device):
        self.name = entry.name
        self.dtype = entry.dtype
        self.shape = entry.shape
        self.tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)  # contiguous
        self.bytes = self.tensor.view(-1).view(torch.uint8)
        self.done = 0
        self.total = entry.total


class WeightReceiver:
    """Receives what a :class:`WeightSender` on rank ``src`` of ``group`` sends.

    ``device`` is where received tensors are placed (default: ``bucket_device``);
    ``bucket_device`` is where the two receive buckets live (default: CPU; ``"cuda"`` for an
    NCCL group). ``bucket_bytes`` is only a hint: buffer sizes come from the sender's
    headers, so a receiver given a different value still works. Nothing is allocated before
    the first ``receive``; buffers are kept for the next one until :meth:`release`.
    """

    def __init__(
        self, group, src: int = 0, bucket_bytes: Optional[int] = None, device=None, bucket_device=None
    ):
        rank, size = group_rank_size(group)
        if not 0 <= src < size:
            raise ValueError(f"WeightReceiver: src {src} is not a rank of a group of size {size}")
        if rank == src:
            raise ValueError(f"WeightReceiver: this is the source rank {src}; use WeightSender")
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.bucket_device = resolve_device(bucket_device)
        self.device = resolve_device(device) if device is not None else self.bucket_device
        self._bufs: list[Optional[torch.Tensor]] = [None, None]
        self.last_stats: Optional[SyncStats] = None

    def release(self) -> None:
        """Frees the receive buckets and the shared windows kept mapped."""
        self._bufs = [None, None]
        window.drop_mapped()

    def _buffer(self, i: int, h: Header) -> torch.Tensor:
        buf = self._bufs[i]
        if buf is None or buf.numel() < h.used_bytes:
            # A last bucket gets just what it needs; any other gets the sender's bucket size,
            # so that later buckets reuse it, unless it is less than half full: at most twice the
            # bytes the sender actually sends (bucket_bytes is a peer's number, up to 1 TiB).
            n = h.used_bytes if h.last or 2 * h.used_bytes < h.bucket_bytes else h.bucket_bytes
            buf = self._bufs[i] = None  # free the old one first
            buf = self._bufs[i] = torch.empty(n, dtype=torch.uint8, device=self.bucket_device)
        return buf

    def _recv(self, t: torch.Tensor, what: str) -> None:
        try:
            broadcast(self.group, t, self.src).wait()
        except Exception as e:
            raise WeightSyncError(f"weight sync: receiving {what} from rank {self.src} failed: {e}") from e

    def _recv_announcement(self, index: int, bucket_bytes: Optional[int]) -> tuple[Header, BucketMeta]:
        """Bucket ``index``'s header and metadata, decoded; raises the sender's abort notice."""
        where = f"bucket {index} from rank {self.src}"
        header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.bucket_device)
        self._recv(header_t, f"the header of bucket {index}")
        h = Header.decode(header_t.cpu().tolist(), where, index, bucket_bytes)
        meta_t = torch.empty(h.meta_nbytes, dtype=torch.uint8, device=self.bucket_device)
        self._recv(meta_t, f"the metadata of bucket {index} ({h.meta_nbytes} bytes)")
        meta = BucketMeta.decode(tensor_bytes(meta_t), h, where)
        if meta.abort is not None:
            raise WeightSyncError(f"weight sync: the sender (rank {self.src}) aborted at bucket {index}: {meta.abort}")
        return h, meta

    @torch.no_grad()
    def receive(self, progress: bool = False, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields ``(name, tensor)`` in the order sent, each a new contiguous tensor on
        ``self.device``. Must be drained (the sender waits for every receiver);
        ``self.last_stats`` is set when it is.

        ``copy=False`` saves a copy for consumers that load each tensor somewhere at once (a
        rollout engine's ``param.copy_(tensor)``): a tensor that arrived whole in one bucket
        is then a view into the receive bucket, valid only until the next item is requested
        (clone it to keep it). Tensors split across buckets, and tensors for another
        ``device``, are new tensors either way."""
        t0 = time.perf_counter()
        stats = SyncStats()
        bar = None
        pending: Optional[_Pending] = None
        prev = None  # (buffer, entries, index) of the bucket to unpack
        index = 0
        cur = 0
        bucket_bytes = None  # the sender's, from bucket 0's header
        self._names: set[str] = set()  # the tensors of this sync so far
        try:
            try:
                window.co_located(self.group, self.src, False, self.bucket_device.type == "cpu")
            except Exception as e:
                raise WeightSyncError(f"weight sync: the first step with rank {self.src} failed: {e}") from e
            while True:
                h, meta = self._recv_announcement(index, bucket_bytes)
                bucket_bytes = h.bucket_bytes
                if index == 0 and progress:
                    bar = progress_bar(True, meta.total if meta.total >= 0 else None, "weight sync (receive)")
                if meta.window is not None:
                    try:
                        shared = self._join_window(meta.window)
                    except WeightSyncError:
                        raise
                    except Exception as e:
                        raise WeightSyncError(
                            f"weight sync: agreeing on the shared window with rank {self.src} failed: {e}"
                        ) from e
                    if shared is not None:
                        pending = yield from self._receive_in_place(shared, h, meta, stats, bar, copy)
                        break
                what = f"{describe(index, [e.name for e in meta.entries])} of {h.used_bytes} bytes"
                work = buf = None
                if h.used_bytes:
                    buf = self._buffer(cur, h)
                    try:
                        work = broadcast(self.group, buf[: h.used_bytes], self.src)
                    except Exception as e:
                        raise WeightSyncError(f"weight sync: receiving {what} from rank {self.src} failed: {e}") from e
                # Unpack the previous bucket while this one is in flight.
                if prev is not None:
                    pending = yield from self._unpack(copy, prev, pending, stats, bar)
                    prev = None
                if work is not None:
                    try:
                        work.wait()
                    except Exception as e:
                        raise WeightSyncError(f"weight sync: receiving {what} from rank {self.src} failed: {e}") from e
                stats.buckets += 1
                prev = (buf, meta.entries, index)
                index += 1
                cur ^= 1
                if h.last:
                    break
            if prev is not None:
                pending = yield from self._unpack(copy, prev, pending, stats, bar)
            if pending is not None:
                raise WeightSyncError(
                    f"weight sync: the sender finished with {pending.name!r} incomplete "
                    f"({pending.done} of {pending.total} bytes)"
                )
        finally:
            if bar is not None:
                bar.close()
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats

    def _receive_in_place(self, shared: torch.Tensor, h: Header, meta: BucketMeta, stats: SyncStats, bar, copy: bool):
        """The rest of a sync over the shared window, from bucket 0 (whose header and metadata
        ``h``/``meta`` are read): bucket k is unpacked where the sender packed it, slot k % 2,
        and C_k tells the sender it is free (the package docstring gives the order)."""
        bucket = h.bucket_bytes  # the decoder checked the window holds two of them
        index, pending = 0, None
        stats.shared_window = True
        while True:
            if index > 0:
                self._consumed(index - 1)
            start = (index % 2) * bucket
            pending = yield from self._unpack(copy, (shared[start : start + h.used_bytes], meta.entries, index),
                                              pending, stats, bar)
            stats.buckets += 1
            if h.last:
                self._consumed(index)
                return pending
            index += 1
            h, meta = self._recv_announcement(index, bucket)

    def _join_window(self, announced: Announcement) -> Optional[torch.Tensor]:
        """This rank's part of the group's agreement on the shared window (window.agree): the
        window every rank maps, or None."""
        cpu = self.bucket_device.type == "cpu"
        mapped: dict[str, torch.Tensor] = {}

        def join(a: Announcement) -> bool:
            memory = window.open_window(a) if cpu else None
            if memory is not None:
                mapped[a.name] = memory
            return memory is not None

        agreed = window.agree(self.group, self.src, announced, join)
        return mapped[agreed.name] if agreed is not None else None

    def _consumed(self, index: int) -> None:
        """C_index: this receiver is done with bucket ``index`` of the shared window."""
        try:
            window.bucket_done(self.group).wait()
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: telling rank {self.src} that bucket {index} was read failed: {e}"
            ) from e

    def _unpack(self, copy: bool, prev, pending: Optional[_Pending], stats: SyncStats, bar):
        """Yields the tensors of one received bucket (``prev``: its bytes, entries and index; the
        decoder checked every entry lies in them); returns the split tensor still incomplete."""
        buf, entries, index = prev
        for e in entries:
            if e.chunk_offset == 0:  # a tensor's first (or only) piece
                if e.name in self._names:  # the decoder checks one bucket; this, the whole sync
                    raise WeightSyncError(f"weight sync: bucket {index}: {e.name!r} was already received in this sync")
                self._names.add(e.name)
            if e.total == 0:
                out = torch.empty(e.shape, dtype=e.dtype, device=self.device)
            elif e.whole:
                src = buf[e.offset : e.end].view(e.dtype).view(e.shape)
                if self.device != self.bucket_device:
                    out = src.to(self.device)
                else:
                    out = src.clone() if copy else src
            else:
                if e.chunk_offset == 0:
                    if pending is not None:
                        raise WeightSyncError(
                            f"weight sync: bucket {index}: {e.name!r} starts before {pending.name!r} is complete"
                        )
                    pending = _Pending(e, self.device)
                if (pending is None or pending.name != e.name or pending.done != e.chunk_offset
                        or pending.total != e.total or pending.dtype != e.dtype or pending.shape != e.shape):
                    raise WeightSyncError(
                        f"weight sync: bucket {index}: unexpected chunk of {e.name!r} at byte "
                        f"{e.chunk_offset} (reassembling {pending and pending.name!r})"
                    )
                pending.bytes[e.chunk_offset : e.chunk_offset + e.nbytes].copy_(buf[e.offset : e.end])
                pending.done += e.nbytes
                if bar is not None:
                    bar.update(e.nbytes)
                if pending.done < e.total:
                    continue
                out, pending = pending.tensor, None
                stats.tensors += 1
                stats.bytes += e.total
                yield e.name, out
                continue
            if bar is not None:
                bar.update(e.nbytes)
            stats.tensors += 1
            stats.bytes += e.total
            yield e.name, out
        return pending
