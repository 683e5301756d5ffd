"""The source rank's role: packs tensors into two buckets in turn and sends them (the package
docstring gives the protocol)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Optional

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
    synchronize,
)
from .format import (
    DEFAULT_BUCKET_BYTES, MAX_BUCKET_BYTES, MAX_NAME_CHARS, MAX_TENSOR_BYTES, MIN_BUCKET_BYTES, Announcement,
    BucketMeta, Entry, Header, check_dtype,
)
from .plan import Packer


def _copy_flat_range(dst: torch.Tensor, src: torch.Tensor, e0: int, e1: int) -> None:
    """dst (1-D, e1 - e0 elements) <- elements [e0, e1) of src in row-major order.

    Every element is copied once, straight from src's strides (no .contiguous() temporary):
    the range is cut into a partial first row, whole rows, and a partial last row.
    """
    if e1 <= e0:
        return
    if src.is_contiguous():
        dst.copy_(src.reshape(-1)[e0:e1])  # reshape of a contiguous tensor is a view
        return
    if src.dim() == 1:
        dst.copy_(src[e0:e1])
        return
    inner = src[0].numel()
    r0, o0 = divmod(e0, inner)
    r1, o1 = divmod(e1, inner)
    if r0 == r1:
        _copy_flat_range(dst, src[r0], o0, o1)
        return
    pos = 0
    if o0:
        _copy_flat_range(dst[: inner - o0], src[r0], o0, inner)
        pos = inner - o0
        r0 += 1
    if r1 > r0:
        n = (r1 - r0) * inner
        dst[pos : pos + n].view(r1 - r0, *src.shape[1:]).copy_(src[r0:r1])
        pos += n
    if o1:
        _copy_flat_range(dst[pos:], src[r1], 0, o1)


class _Slot:
    """One of the two send buffers and the broadcasts that still read it."""

    __slots__ = ("buf", "works", "keep", "label", "consume")

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None
        self.works: list = []
        self.keep: list = []
        self.label = ""
        self.consume = False  # shared window: receivers read this bucket in place (C_k pending)

    def wait(self) -> None:
        works, self.works = self.works, []
        try:
            for w in works:
                w.wait()
        except Exception as e:
            raise WeightSyncError(f"weight sync: broadcast of {self.label} failed: {e}") from e
        finally:
            self.keep = []


class WeightSender:
    """Broadcasts named tensors from rank ``src`` of ``group`` to every other rank of it.

    ``group`` is any ProcessGroup object (from ``xccl_rs.new_group``, ``dist.new_group``, or
    ``dist.group.WORLD``); ``src`` is a rank *within* the group. ``device`` is where the two
    buckets live (default: CPU; pass ``"cuda"`` for an NCCL group). Tensors on any device are
    copied into them. Nothing is allocated before the first ``send``; the buckets are kept
    for the next ``send`` until :meth:`release`. ``shared_memory`` (default: when ``group`` is
    an xccl_rs group) puts CPU buckets in a shared window that receivers on this host read in
    place (the package docstring); ``False`` always broadcasts them.
    """

    def __init__(
        self, group, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device=None, shared_memory=None
    ):
        rank, size = group_rank_size(group)
        if not 0 <= src < size:
            raise ValueError(f"WeightSender: src {src} is not a rank of a group of size {size}")
        if rank != src:
            raise ValueError(
                f"WeightSender: this is rank {rank} of the group, but src is {src}; "
                "only the source rank sends (the others use WeightReceiver)"
            )
        bucket_bytes = int(bucket_bytes)
        if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(
                f"WeightSender: bucket_bytes must be in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}], got {bucket_bytes}"
            )
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.device = resolve_device(device)
        self._slots = [_Slot(), _Slot()]
        self.last_stats: Optional[SyncStats] = None
        if shared_memory is None:
            shared_memory = window.uses_shared_memory(group)
        # The shared window: CPU buckets only, and only with receivers.
        self.shared_memory = bool(shared_memory) and self.device.type == "cpu" and size > 1

    def release(self) -> None:
        """Frees the buckets (after waiting for any broadcast still reading them), and the
        shared window kept for this bucket size."""
        for s in self._slots:
            s.wait()
            s.buf = None
        window.drop_kept(self.bucket_bytes)

    def send(self, named_tensors: Iterable, progress: bool = False) -> SyncStats:
        """Sends every ``(name, tensor)`` of ``named_tensors`` (consumed lazily, one at a time,
        so a generator that gathers each weight on demand works). Returns when every
        broadcast has completed. Every other rank of the group must run
        :meth:`WeightReceiver.receive` to the end at the same time."""
        total = None
        if isinstance(named_tensors, Mapping):
            named_tensors = list(named_tensors.items())
        if isinstance(named_tensors, (list, tuple)):
            total = sum(t.numel() * t.element_size() for _, t in named_tensors)
        stream = self.stream(progress=progress, total_bytes=total)
        name = "<first tensor>"
        try:
            for name, t in named_tensors:
                stream.add(name, t)
        except BaseException as e:
            stream.abort(f"{type(e).__name__} after {name!r}: {e}")
            raise
        return stream.finish()

    def stream(self, progress: bool = False, total_bytes: Optional[int] = None) -> "SendStream":
        """A push-style send: ``s = sender.stream(); s.add(name, t) ...; stats = s.finish()``
        (what :meth:`send` does; for producers that are async generators)."""
        return SendStream(self, progress, total_bytes)


class SendStream:
    """One sync in progress on the source rank (see :meth:`WeightSender.stream`)."""

    def __init__(self, sender: WeightSender, progress: bool, total_bytes: Optional[int]):
        self.s = sender
        self.t0 = time.perf_counter()
        self.stats = SyncStats()
        self.total = total_bytes
        self.bar = progress_bar(progress, total_bytes, "weight sync (send)")
        self.packer = Packer(sender.bucket_bytes)
        self.cur = 0  # index of the slot being packed
        self.entries: list[Entry] = []
        self.names: set[str] = set()  # receivers refuse a name sent twice
        self.index = 0
        self.done = False
        self.broken = False  # a broadcast failed: the group cannot carry an abort notice
        # The shared window: created with the first bucket if every rank can share the
        # sender's memory; `shared` once every rank has mapped it.
        self.window: Optional[window.Window] = None
        self.shared = False
        try:
            self.co_located = window.co_located(sender.group, sender.src, sender.shared_memory, True)
        except Exception as e:
            raise WeightSyncError(f"weight sync: the first step with the receivers failed: {e}") from e

    def _post(self, slot: _Slot, header: torch.Tensor, meta_t: torch.Tensor, used: int,
              announced: Optional[Announcement] = None) -> None:
        s = self.s
        try:
            slot.works.append(broadcast(s.group, header, s.src))
            slot.works.append(broadcast(s.group, meta_t, s.src))
            if announced is not None:
                self.shared = self._settle_window(announced, used)
                self.window.unlink()  # every rank has mapped it or given up
            if self.shared:
                slot.consume = True  # receivers read it in place; C_k frees it
            elif used:
                slot.works.append(broadcast(s.group, slot.buf[:used], s.src))
        except Exception as e:
            self.broken = True
            raise WeightSyncError(f"weight sync: broadcast of {slot.label} failed: {e}") from e
        slot.keep = [header, meta_t]

    def _settle_window(self, announced: Announcement, used: int) -> bool:
        """The sender's part of the agreement on the window announced in bucket 0 (window.agree):
        whether every rank maps it. The fresh window it may offer already holds bucket 0, so
        that a newcomer costs one bucket copy, not the window."""
        s = self.s
        fresh: list[window.Window] = []

        def offer() -> Optional[Announcement]:
            try:
                w = window.Window(s.bucket_bytes)
            except OSError:
                return None  # offer nothing: every rank then knows the buckets are broadcast
            w.slot(0)[:used].copy_(self.window.slot(0)[:used])
            fresh.append(w)
            return w.announcement()

        agreed = window.agree(s.group, s.src, announced, lambda a: True, offer)
        if agreed is None or agreed.name == self.window.name:
            for w in fresh:
                w.unlink()
            return agreed is not None
        self.window.unlink()
        self.window = fresh[0]
        for i, slot in enumerate(s._slots):
            slot.buf = self.window.slot(i)
        return True

    def _consumed(self, slot: _Slot) -> None:
        """Joins C_k for the bucket in ``slot`` (shared window): it can be packed again once
        every receiver is done with it (the caller waits for the slot)."""
        if slot.consume:
            slot.consume = False
            try:
                slot.works.append(window.bucket_done(self.s.group))
            except Exception as e:
                self.broken = True
                raise WeightSyncError(f"weight sync: waiting for the receivers of {slot.label} failed: {e}") from e

    def _drop_window(self) -> None:
        """The sync is over: its window is kept for the next sync if every receiver mapped it,
        else unlinked and dropped (the buffers return to private ones either way)."""
        if self.window is not None:
            if self.shared and self.done and not self.broken:
                window.keep_window(self.window)
            else:
                self.window.unlink()
            self.window = None
            for slot in self.s._slots:
                slot.buf = None

    def _wait(self, slot: _Slot) -> None:
        try:
            slot.wait()
        except WeightSyncError:
            self.broken = True
            raise

    def _encode(self, meta: BucketMeta, used: int, last: bool = False, aborted: bool = False):
        """The header and metadata tensors of bucket ``self.index``."""
        s = self.s
        raw = meta.encode()
        header = Header(self.index, len(raw), used, s.bucket_bytes, last=last, aborted=aborted)
        header_t = torch.tensor(header.encode(), dtype=torch.int64).to(s.device)
        meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(s.device)
        return header_t, meta_t

    def _flush(self, is_last: bool) -> None:
        s = self.s
        slot = s._slots[self.cur]
        entries = self.entries
        used = max((e.end for e in entries), default=0)
        announced = self.window.announcement() if self.index == 0 and self.window is not None else None
        meta = BucketMeta(self.index, entries, self.total if self.total is not None else -1, announced)
        header, meta_t = self._encode(meta, used, last=is_last)
        slot.label = describe(self.index, [e.name for e in entries]) + f" of {used} bytes from rank {s.src}"
        self._post(slot, header, meta_t, used, announced)
        self.stats.buckets += 1
        if self.bar is not None:
            self.bar.update(sum(e.nbytes for e in entries))
        self.entries = []
        self.index += 1
        self.cur ^= 1
        # The next bucket reuses the other buffer: its previous broadcast (or, with the shared
        # window, every receiver's reading of it) must be done.
        other = s._slots[self.cur]
        self._consumed(other)
        self._wait(other)

    def _buffer(self) -> torch.Tensor:
        s = self.s
        if s.shared_memory and self.co_located and self.window is None and self.index == 0:
            # A window per sync: receivers map it by name, and it is unlinked right after.
            try:
                self.window = window.take_window(s.bucket_bytes)
            except OSError as e:
                warnings.warn(
                    f"weight sync: no shared window of {2 * s.bucket_bytes} bytes in /dev/shm ({e}); "
                    "broadcasting the buckets instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                s.shared_memory = False
            else:
                for i, slot in enumerate(s._slots):
                    slot.buf = self.window.slot(i)
        slot = s._slots[self.cur]
        if slot.buf is None:  # a sender's device never changes: allocate once, then reuse
            slot.buf = torch.empty(s.bucket_bytes, dtype=torch.uint8, device=s.device)
        return slot.buf

    @torch.no_grad()
    def add(self, name: str, t: torch.Tensor) -> None:
        """Packs one tensor (broadcasting the buckets it fills)."""
        if self.done:
            raise WeightSyncError("weight sync: add() after finish()")
        try:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
            if t.layout != torch.strided:
                raise TypeError(f"{name!r} has layout {t.layout}; only strided tensors are supported")
            # What the receivers' decoder refuses, refused here first, with the tensor's name.
            if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
                raise ValueError(f"tensor name {name!r:.100} is not a string of at most {MAX_NAME_CHARS} characters")
            name.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
            if name in self.names:
                raise ValueError(f"{name!r} was already sent in this sync")
            check_dtype(t.dtype, name)
            t = t.detach()
            elsize = t.element_size()
            if t.numel() * elsize > MAX_TENSOR_BYTES:
                raise ValueError(f"{name!r} has {t.numel() * elsize} bytes, above the limit of {MAX_TENSOR_BYTES}")
            self.names.add(name)
            for entry in self.packer.add(name, t.dtype, tuple(t.shape), elsize):
                if entry is None:
                    self._flush(False)
                    continue
                self.entries.append(entry)
                if entry.nbytes == 0:
                    continue
                dst = self._buffer()[entry.offset : entry.end].view(t.dtype)
                if entry.whole:
                    dst.view(t.shape).copy_(t)  # one strided copy, contiguous or not
                else:
                    e0 = entry.chunk_offset // elsize
                    _copy_flat_range(dst, t, e0, e0 + entry.nbytes // elsize)
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: send failed at bucket {self.index} while packing {name!r}: "
                f"{type(e).__name__}: {e}"
            ) from e
        self.stats.tensors += 1
        self.stats.bytes += t.numel() * elsize

    def finish(self) -> SyncStats:
        """Sends the last bucket and waits for every broadcast."""
        if self.done:
            raise WeightSyncError("weight sync: finish() called twice")
        self.done = True
        try:
            self._flush(True)
            for slot in self.s._slots:
                self._consumed(slot)  # C_L: the receivers are done with the last bucket
                self._wait(slot)
            if self.s.device.type != "cpu":
                # An accelerator backend's wait() only orders streams: finish the transfers.
                synchronize(self.s.device)
        finally:
            self._drop_window()
            if self.bar is not None:
                self.bar.close()
        self.stats.shared_window = self.shared
        self.stats.seconds = time.perf_counter() - self.t0
        self.s.last_stats = self.stats
        return self.stats

    def abort(self, reason: str = "the sender gave up") -> None:
        """Gives up (the producer of the weights failed): the receivers get an abort notice in
        place of the next bucket header and raise ``WeightSyncError`` with ``reason``, rather
        than wait for the group timeout or take a truncated model for a complete one. When a
        broadcast already failed, only waits for what is still in flight."""
        if self.done:
            return
        self.done = True
        try:
            if not self.broken:
                slot = self.s._slots[self.cur]
                slot.label = f"the abort notice at bucket {self.index}"
                header, meta_t = self._encode(BucketMeta(self.index, abort=str(reason)), 0, aborted=True)
                self._post(slot, header, meta_t, 0)
            for slot in self.s._slots:
                try:
                    slot.wait()
                except WeightSyncError:
                    pass
        except WeightSyncError:
            pass
        finally:
            self._drop_window()
            if self.bar is not None:
                self.bar.close()
