"""The receivers' role: receive the buckets the senders send and hand out the tensors (the package
docstring gives the protocol)."""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import Iterator, Optional

import torch

from .. import host_memory
from . import delta as delta_mod
from . import window
from ._common import (
    SyncStats,
    read_flat_range,
    WeightSyncError,
    broadcast,
    describe,
    group_senders,
    progress_bar,
    recv_each,
    resolve_device,
    tensor_bytes,
    write_flat_range,
)
from .agreement import RECEIVING, agree_round, hello, window_hosts
from .format import HEADER_LEN, PAYLOAD_NAMES, PAYLOADS, Announcement, BucketMeta, Entry, Header, RoundRecord


def _bytes_of(buf: Optional[torch.Tensor], e: Entry) -> torch.Tensor:
    """Entry ``e``'s bytes in a received bucket (a bucket of no bytes is never received)."""
    return buf[e.offset : e.end] if e.nbytes else torch.empty(0, dtype=torch.uint8)


def _overlaps(a: tuple, b: tuple) -> bool:
    """Whether two boxes (``((start, length), ...)``) share an element."""
    return all(s1 < s2 + l2 and s2 < s1 + l1 for (s1, l1), (s2, l2) in zip(a, b))


class _Pending:
    """A tensor whose pieces arrive in several entries -- the chunks of a tensor larger than a
    bucket, or the shards of a DTensor from several senders -- being assembled in its own memory.

    ``runs``: the byte ranges received, merged and sorted (of the tensor's flat bytes, or per box
    of its shard's), so that a piece received twice, or overlapping another, is refused."""

    __slots__ = ("name", "dtype", "shape", "tensor", "bytes", "done", "total", "runs", "boxes", "base", "failed")

    def __init__(self, entry: Entry, device: torch.device, base: Optional[tuple[int, torch.Tensor]] = None,
                 into: Optional[torch.Tensor] = None):
        """``into``: the bytes to assemble it in (else new memory on ``device``)."""
        self.name = entry.name
        self.dtype = entry.dtype
        self.shape = entry.shape
        # A delta sync assembles into a copy of the tensor held (its base), so that a sync that
        # fails halfway leaves the held tensor whole, at its version.
        self.base = None  # the version copied
        if base is not None and base[1].shape == entry.shape and base[1].dtype == entry.dtype:
            self.base = base[0]
            self.tensor = base[1].clone()
        elif into is not None:
            self.tensor = into.view(entry.dtype).view(entry.shape)
        else:
            self.tensor = torch.empty(entry.shape, dtype=entry.dtype, device=device)  # contiguous
        self.failed: Optional[str] = None  # why a piece could not be applied
        self.bytes = self.tensor.view(-1).view(torch.uint8)
        self.done = 0
        self.total = entry.total
        self.runs: list[list[int]] = []  # flat pieces
        self.boxes: dict[tuple, list[list[int]]] = {}  # shard pieces, by box

    def matches(self, e: Entry) -> bool:
        return e.total == self.total and e.dtype == self.dtype and e.shape == self.shape

    @staticmethod
    def _take(runs: list[list[int]], start: int, end: int) -> bool:
        """Adds [start, end) to the sorted, merged ``runs``; False if it overlaps one of them."""
        i = bisect.bisect_right(runs, [start, float("inf")])
        if i > 0 and runs[i - 1][1] > start:
            return False
        if i < len(runs) and runs[i][0] < end:
            return False
        if i > 0 and runs[i - 1][1] == start:
            runs[i - 1][1] = end
            if i < len(runs) and runs[i][0] == end:
                runs[i - 1][1] = runs.pop(i)[1]
        elif i < len(runs) and runs[i][0] == end:
            runs[i][0] = start
        else:
            runs.insert(i, [start, end])
        return True

    def add(self, e: Entry, src: torch.Tensor, where: str, non_blocking: bool = False) -> None:
        """Writes piece ``e`` (``src``: its bytes) where it belongs; refuses overlaps. A piece of a
        delta sync that cannot be applied (delta.apply) leaves the tensor failed, not raised.
        ``non_blocking``: ``src`` is pinned memory and the caller fences the copy."""
        dense = e.dense
        if e.box is None:
            if self.boxes or not self._take(self.runs, e.chunk_offset, e.chunk_offset + dense):
                raise WeightSyncError(
                    f"weight sync: {where}: bytes [{e.chunk_offset}, {e.chunk_offset + dense}) of {e.name!r} "
                    "overlap bytes already received"
                )
            if e.enc is not None:
                size = self.dtype.itemsize
                self._apply(e, self.tensor.view(-1)[e.chunk_offset // size : (e.chunk_offset + dense) // size], src,
                            where)
            else:
                self.bytes[e.chunk_offset : e.chunk_offset + e.nbytes].copy_(src, non_blocking=non_blocking)
        else:
            runs = self.boxes.get(e.box)
            if runs is None:
                other = next((b for b in self.boxes if _overlaps(b, e.box)), None)
                if other is not None or self.runs:
                    raise WeightSyncError(
                        f"weight sync: {where}: the shard {list(map(list, e.box))} of {e.name!r} overlaps "
                        f"{'the shard ' + str(list(map(list, other))) if other else 'bytes'} already received"
                    )
                runs = self.boxes[e.box] = []
            if not self._take(runs, e.chunk_offset, e.chunk_offset + dense):
                raise WeightSyncError(
                    f"weight sync: {where}: bytes [{e.chunk_offset}, {e.chunk_offset + dense}) of the shard "
                    f"{list(map(list, e.box))} of {e.name!r} overlap bytes already received"
                )
            view = self.tensor[tuple(slice(s, s + n) for s, n in e.box)]
            size = self.dtype.itemsize
            e0, e1 = e.chunk_offset // size, (e.chunk_offset + dense) // size
            if e.enc is not None:
                flat = torch.empty(e1 - e0, dtype=self.dtype, device=self.tensor.device)
                read_flat_range(flat, view, e0, e1)
                if self._apply(e, flat, src, where):
                    write_flat_range(view, flat, e0, e1)
            else:
                write_flat_range(view, src.view(self.dtype), e0, e1, non_blocking)
        self.done += dense

    def _apply(self, e: Entry, target: torch.Tensor, src: torch.Tensor, where: str) -> bool:
        if self.failed is None and e.enc.kind != "full" and self.base != e.enc.base:
            held = "nothing" if self.base is None else f"version {self.base:#x}"
            self.failed = (f"weight sync: {where}: a delta of {e.name!r} against version {e.enc.base:#x}, but this "
                           f"receiver holds {held} of it ({self.dtype} {list(self.shape)})")
        if self.failed is not None:
            return False
        try:
            delta_mod.apply(target, e.enc, src, f"{where} ({e.name!r})")
        except WeightSyncError as err:
            self.failed = str(err)
            return False
        return True


def _straddling(entries: list[Entry], bucket_bytes: int) -> Optional[Entry]:
    """The last entry of a bucket in the window's first half, when it is a tensor's first piece
    that fills the bucket to its end and whose rest fits in the next bucket: its rest then starts
    the next bucket, right after it in the window, and the tensor can be read there whole, with
    no assembly (its bucket's C barrier waits until it is)."""
    e = entries[-1] if entries else None
    if e is None or e.enc is not None or e.box is not None or e.whole or e.chunk_offset != 0:
        return None
    return e if e.end == bucket_bytes and e.total - e.nbytes <= bucket_bytes else None


def _joined(first: Entry, nxt: Optional[Entry]) -> Optional[Entry]:
    """The whole tensor, in window offsets, when ``nxt`` (the next bucket's first entry) is the
    rest of ``first`` (``_straddling``) at the start of that bucket; else None."""
    if nxt is None or nxt.enc is not None or nxt.box is not None or nxt.offset != 0:
        return None
    same = (nxt.name, nxt.dtype, nxt.shape, nxt.total) == (first.name, first.dtype, first.shape, first.total)
    if not same or nxt.chunk_offset != first.nbytes or first.nbytes + nxt.nbytes != first.total:
        return None
    return dataclasses.replace(first, nbytes=first.total)


def _check_last(h: Header, index: int, owner: int, agreed_last: bool) -> None:
    """With several senders: bucket ``index``'s header must say it is the sync's last exactly
    when its round's agreement does."""
    if h.last != agreed_last:
        raise WeightSyncError(
            f"weight sync: bucket {index} from rank {owner} is {'' if h.last else 'not '}the last "
            f"of the sync, but its round's agreement says {'it is' if agreed_last else 'not'}"
        )


class WeightReceiver:
    """Receives what the :class:`WeightSender` (or senders) of ``group`` send.

    ``src`` is the sender's group rank; with several senders, ``senders`` lists their group
    ranks, as every rank of the group passes them (``src`` is then ignored). ``device`` is where
    received tensors are placed (default: ``bucket_device``); ``bucket_device`` is where the
    receive buckets live (default: CPU; ``"cuda"`` for an NCCL group): two, or with several
    senders whose buckets are sent rather than shared, two per sender, so that every sender's
    bucket of a round arrives at once while the last round is unpacked. ``bucket_bytes`` is
    only a hint: buffer sizes come from the senders' headers, so a receiver given a different
    value still works. Nothing is allocated before the first ``receive``; buffers are kept for
    the next one until :meth:`release`.
    """

    def __init__(
        self, group, src: int = 0, bucket_bytes: Optional[int] = None, device=None, bucket_device=None, senders=None
    ):
        rank, _, senders = group_senders(group, senders, src, "WeightReceiver")
        if rank in senders:
            if len(senders) == 1:
                raise ValueError(f"WeightReceiver: this is the source rank {rank}; use WeightSender")
            raise ValueError(f"WeightReceiver: this is rank {rank}, one of the senders {senders}; use WeightSender")
        self.group = group
        self.src = senders[0]
        self.senders = senders
        self.bucket_bytes = bucket_bytes
        self.bucket_device = resolve_device(bucket_device)
        self.device = resolve_device(device) if device is not None else self.bucket_device
        # Receive buckets: two (one in flight, one being unpacked), or two per sender when
        # several senders' buckets travel at once (_receive_rounds).
        self._bufs: list[Optional[torch.Tensor]] = []
        self.last_stats: Optional[SyncStats] = None
        # The tensors of delta syncs, by name: (the version held, the tensor), each a base
        # that the next delta sync updates (delta.py).
        self._held: dict[str, tuple[int, torch.Tensor]] = {}
        # Copies out of a registered window into the device are queued without waiting; the
        # window's bucket is handed back to its sender (C_k) only once they are done.
        self._fence = host_memory.CopyFence()
        # Where CPU tensors are assembled for a consumer that copies each at once (copy=False):
        # kept from sync to sync, as the buckets are, so that a sync neither faults in nor frees
        # that memory.
        self._assembly_memory: Optional[torch.Tensor] = None

    @property
    def versions(self) -> dict[str, int]:
        """The version of each tensor this receiver holds from a delta sync (the tensors it handed
        out, which later delta syncs update in place). A tensor received in a sync that failed
        before it was complete keeps its previous version (or has none)."""
        return {n: v for n, (v, _) in self._held.items()}

    def forget(self) -> None:
        """Drops the tensors held for delta syncs: the next delta sync sends them in full."""
        self._held.clear()

    def release(self) -> None:
        """Frees the receive buckets, the assembly memory and the shared windows kept mapped."""
        self._fence.wait()
        self._bufs = []
        self._assembly_memory = None
        window.drop_mapped()

    def _buffer(self, i: int, h: Header) -> torch.Tensor:
        if len(self._bufs) <= i:
            self._bufs += [None] * (i + 1 - len(self._bufs))
        buf = self._bufs[i]
        if buf is None or buf.numel() < h.used_bytes:
            # A last bucket gets just what it needs; any other gets the sender's bucket size,
            # so that later buckets reuse it, unless it is less than half full: at most twice the
            # bytes the sender actually sends (bucket_bytes is a peer's number, up to 1 TiB).
            n = h.used_bytes if h.last or 2 * h.used_bytes < h.bucket_bytes else h.bucket_bytes
            buf = self._bufs[i] = None  # free the old one first
            buf = self._bufs[i] = torch.empty(n, dtype=torch.uint8, device=self.bucket_device)
        return buf

    def _assembly(self, nbytes: int) -> Optional[torch.Tensor]:
        """``nbytes`` of the kept assembly memory (grown to fit), for a CPU tensor assembled from
        one sender's pieces, which end before the next tensor starts; None for other devices,
        whose allocators reuse memory anyway."""
        if self.device.type != "cpu":
            return None
        if self._assembly_memory is None or self._assembly_memory.numel() < nbytes:
            self._assembly_memory = None  # free the old one first
            self._assembly_memory = torch.empty(nbytes, dtype=torch.uint8)
        return self._assembly_memory[:nbytes]

    def _recv(self, t: torch.Tensor, what: str, owner: int) -> None:
        try:
            broadcast(self.group, t, owner).wait()
        except Exception as e:
            raise WeightSyncError(f"weight sync: receiving {what} from rank {owner} failed: {e}") from e

    def _recv_announcement(self, index: int, bucket_bytes: Optional[int], owner: int) -> tuple[Header, BucketMeta]:
        """Bucket ``index``'s header and metadata, decoded; raises its sender's abort notice."""
        where = f"bucket {index} from rank {owner}"
        header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.bucket_device)
        self._recv(header_t, f"the header of bucket {index}", owner)
        h = Header.decode(header_t.cpu().tolist(), where, index, bucket_bytes)
        meta_t = torch.empty(h.meta_nbytes, dtype=torch.uint8, device=self.bucket_device)
        self._recv(meta_t, f"the metadata of bucket {index} ({h.meta_nbytes} bytes)", owner)
        meta = BucketMeta.decode(tensor_bytes(meta_t), h, where, len(self.senders))
        if meta.abort is not None:
            raise WeightSyncError(f"weight sync: the sender (rank {owner}) aborted at bucket {index}: {meta.abort}")
        return h, meta

    def _recv_payload(self, buf: torch.Tensor, owner: int, what: str):
        """Posts the receive of a bucket's bytes from its sender (async: the Work)."""
        try:
            if len(self.senders) == 1:
                return broadcast(self.group, buf, owner)
            return recv_each(self.group, [(buf, owner)])[0]
        except Exception as e:
            raise WeightSyncError(f"weight sync: receiving {what} from rank {owner} failed: {e}") from e

    def _receive_rounds(self, copy: bool, progress: bool, stats: SyncStats, bars: list):
        """The buckets of several senders without shared windows, a round at a time: every
        header of the round, then every sender's bucket at once (each sender sends to every
        receiver at once, sender.py `_post_payload`), unpacking the previous round meanwhile.
        Holds two buckets per sender. Returns the tensors still being assembled (none when
        the sync was whole); the progress bar, once made, is ``bars[0]``."""
        n = len(self.senders)
        pending: dict[str, _Pending] = {}
        prev: list = []  # (buffer, entries, index) of the last round's buckets, to unpack
        bucket_bytes = None
        round = 0
        while True:
            final = self._agree(round, bucket_bytes)
            arriving = []
            for i, owner in enumerate(self.senders):
                index = round * n + i
                h, meta = self._recv_announcement(index, bucket_bytes, owner)
                bucket_bytes = h.bucket_bytes
                _check_last(h, index, owner, final and i == n - 1)
                if meta.window is not None:
                    raise WeightSyncError(f"weight sync: rank {owner} offered a shared window the receivers cannot all map")
                if index == 0 and progress:
                    bars[0] = progress_bar(True, meta.total if meta.total >= 0 else None, "weight sync (receive)")
                buf = self._buffer((round % 2) * n + i, h)[: h.used_bytes] if h.used_bytes else None
                arriving.append((buf, meta, index, owner))
            what = f"the buckets of round {round} from ranks {self.senders}"
            try:
                works = recv_each(self.group, [(buf, owner) for buf, _, _, owner in arriving if buf is not None])
            except Exception as e:
                raise WeightSyncError(f"weight sync: receiving {what} failed: {e}") from e
            for p in prev:
                pending = yield from self._unpack(copy, p, pending, stats, bars[0])
            try:
                for w in works:
                    w.wait()
            except Exception as e:
                raise WeightSyncError(f"weight sync: receiving {what} failed: {e}") from e
            prev = [(buf, meta.entries, index) for buf, meta, index, _ in arriving]
            stats.buckets += n
            if final:
                break
            round += 1
        for p in prev:
            pending = yield from self._unpack(copy, p, pending, stats, bars[0])
        return pending

    def _receive_buckets(self, copy: bool, progress: bool, stats: SyncStats, bars: list):
        """The buckets one at a time: one sender's, or several senders' where some are read in
        place from shared windows (C_k barriers between them). While bucket ``k`` is in flight,
        bucket ``k - 1`` is unpacked. Returns the tensors still being assembled; the progress
        bar, once made, is ``bars[0]``."""
        n = len(self.senders)
        pending: dict[str, _Pending] = {}
        prev = None  # (buffer, entries, index) of a received bucket to unpack
        index = 0
        cur = 0
        bucket_bytes = None  # the senders', from bucket 0's header
        final = False  # the round being received is the last (several senders)
        # The first piece of a tensor that fills the end of the window's first bucket and goes on
        # at the start of its second: read whole from there, with the next bucket (_straddling).
        straddle = None
        while True:
            i = index % n
            owner = self.senders[i]
            if n > 1 and i == 0:
                final = self._agree(index // n, bucket_bytes)
            h, meta = self._recv_announcement(index, bucket_bytes, owner)
            bucket_bytes = h.bucket_bytes
            if n > 1:
                _check_last(h, index, owner, final and i == n - 1)
            if index == 0 and progress:
                bars[0] = progress_bar(True, meta.total if meta.total >= 0 else None, "weight sync (receive)")
            if meta.window is not None:
                try:
                    self._windows[i] = self._join_window(meta.window, owner)
                except WeightSyncError:
                    raise
                except Exception as e:
                    raise WeightSyncError(
                        f"weight sync: agreeing on the shared window with rank {owner} failed: {e}"
                    ) from e
            what = f"{describe(index, [e.name for e in meta.entries])} of {h.used_bytes} bytes"
            memory = self._windows[i]
            work = buf = None
            if memory is None and h.used_bytes:
                buf = self._buffer(cur, h)
                work = self._recv_payload(buf[: h.used_bytes], owner, what)
            # C_(k-1) after this bucket's receive is posted, as its sender posts its sends
            # before it (progress threads run each rank's ops in order)
            if index > 0 and straddle is None:
                self._done_reading(index - 1)
            if memory is not None:  # read in place, where its sender packed it
                if prev is not None:
                    pending = yield from self._unpack(copy, prev, pending, stats, bars[0])
                    prev = None
                start = ((index // n) % 2) * h.bucket_bytes
                stats.shared_window = True
                # Registered for this receiver's device (once per kept window): its copies into
                # the device are DMA, queued without waiting, fenced before C_index.
                pinned = memory.pin(self.device)
                entries = meta.entries
                if straddle is not None:
                    joined = _joined(straddle, entries[0] if entries else None)
                    held = (memory.memory, [joined], index) if joined else (memory.memory, [straddle], index - 1)
                    pending = yield from self._unpack(copy, held, pending, stats, bars[0], pinned)
                    entries = entries[1:] if joined else entries
                    straddle = None
                    self._done_reading(index - 1)  # C_(index-1), once the consumer is done with it
                if n == 1 and not h.last and start == 0:
                    straddle = _straddling(entries, h.bucket_bytes)
                    entries = entries[:-1] if straddle is not None else entries
                pending = yield from self._unpack(copy, (memory.memory[start : start + h.used_bytes], entries,
                                                         index), pending, stats, bars[0], pinned)
            else:
                # Unpack the previous bucket while this one is in flight.
                if prev is not None:
                    pending = yield from self._unpack(copy, prev, pending, stats, bars[0])
                    prev = None
                if work is not None:
                    try:
                        work.wait()
                    except Exception as e:
                        raise WeightSyncError(f"weight sync: receiving {what} from rank {owner} failed: {e}") from e
                prev = (buf, meta.entries, index)
                cur ^= 1
            stats.buckets += 1
            if h.last:
                break
            index += 1
        self._done_reading(index)
        if prev is not None:
            pending = yield from self._unpack(copy, prev, pending, stats, bars[0])
        return pending

    @torch.no_grad()
    def receive(self, progress: bool = False, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields ``(name, tensor)`` as each tensor completes (in the order sent, with one
        sender), each a new contiguous tensor on ``self.device``. Must be drained (the senders
        wait for every receiver); ``self.last_stats`` is set when it is.

        ``copy=False`` saves a copy for consumers that load each tensor somewhere at once (a
        rollout engine's ``param.copy_(tensor)``): a tensor that arrived whole in one bucket
        (or back to back in a shared window) is then a view into it, and a CPU tensor that one
        sender split across buckets is assembled in memory this receiver keeps for the next
        one (until :meth:`release`); either is valid only until the next item is requested
        (clone it to keep it). Shards from several senders, and tensors for another ``device``,
        are new tensors either way.

        In a sync from a ``payload="delta"`` sender, every tensor yielded is the one this receiver
        holds (its base for the next delta, :attr:`versions`): treat it as read-only; the next
        delta sync updates it in place. ``copy`` does not apply to them.
        In an ``"fp8"`` sync, a quantized weight arrives as ``(name, float8_e4m3fn tensor)``
        followed by its scales (``name + "_scale_inv"`` or ``name + "_scale"``, fp8.py)."""
        t0 = time.perf_counter()
        stats = SyncStats()
        bars = [None]  # the progress bar, once the first header says the sync's size
        n = len(self.senders)
        self._names: set[str] = set()  # the tensors of this sync so far
        self._windows: list[Optional[window.Mapping]] = [None] * n  # the senders' windows read in place
        try:
            try:
                cpu = self.bucket_device.type == "cpu"
                records = hello(self.group, self.senders, window.host_hash() if cpu else -1, self.bucket_device)
                first = records[self.senders[0]]
                stats.payload = PAYLOAD_NAMES[first.payload]
                self._delta = first.payload == PAYLOADS["delta"]
                self._version = first.sync
                self._failed: list[str] = []  # why tensors of a delta sync could not be applied
                if self._delta:
                    delta_mod.check_bases(
                        self.group, self.senders, None,
                        lambda n, v: n in self._held and self._held[n][0] == v, self.bucket_device,
                    )
                batched = n > 1 and not any(window_hosts(records, self.senders))
            except WeightSyncError:
                raise
            except Exception as e:
                raise WeightSyncError(f"weight sync: the first step with the senders {self.senders} failed: {e}") from e
            receive_all = self._receive_rounds if batched else self._receive_buckets
            pending = yield from receive_all(copy, progress, stats, bars)
            if pending:
                p = next(iter(pending.values()))
                raise WeightSyncError(
                    f"weight sync: the sync ended with {len(pending)} tensor(s) incomplete: {p.name!r} "
                    f"({p.done} of {p.total} bytes)"
                )
            if self._delta:
                try:
                    delta_mod.confirm(self.group, len(self._failed), self.bucket_device,
                                      self._failed[0] if self._failed else "")
                except WeightSyncError:
                    raise
                except Exception as e:
                    raise WeightSyncError(f"weight sync: the confirmation of the delta sync failed: {e}") from e
        finally:
            self._fence.wait()  # no copy out of a window outlives the sync, however it ended
            if bars[0] is not None:
                bars[0].close()
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats

    def _agree(self, round: int, bucket_bytes: Optional[int]) -> bool:
        """This receiver's part in the agreement before a round (several senders): whether it is
        the last round; raises the abort notice of a sender whose producer failed."""
        try:
            out = agree_round(self.group, self.senders, round, RoundRecord(round, RECEIVING), self.bucket_device)
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(f"weight sync: the agreement before round {round} failed: {e}") from e
        if out.aborted_by is not None:
            self._recv_announcement(round * len(self.senders), bucket_bytes, out.aborted_by)  # raises it
            raise WeightSyncError(f"weight sync: the sender (rank {out.aborted_by}) aborted at round {round}")
        return out.final

    def _join_window(self, announced: Announcement, owner: int) -> Optional[window.Mapping]:
        """This rank's part of the group's agreement on sender ``owner``'s shared window
        (window.agree): the window every rank maps, or None."""
        cpu = self.bucket_device.type == "cpu"
        mapped: dict[str, window.Mapping] = {}
        keep = max(2, 2 * len(self.senders))

        def join(a: Announcement) -> bool:
            memory = window.open_window(a, keep) if cpu else None
            if memory is not None:
                mapped[a.name] = memory
            return memory is not None

        agreed = window.agree(self.group, owner, announced, join)
        return mapped[agreed.name] if agreed is not None else None

    def _done_reading(self, index: int) -> None:
        """C_index, when bucket ``index`` was read in place: this receiver is done with it."""
        i = index % len(self.senders)
        if self._windows[i] is None:
            return
        try:
            self._fence.wait()  # the copies out of the bucket are done before its sender reuses it
            window.bucket_done(self.group).wait()
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: telling rank {self.senders[i]} that bucket {index} was read failed: {e}"
            ) from e

    def _unpack(self, copy: bool, prev, pending, stats: SyncStats, bar, pinned: bool = False):
        """Yields the tensors one received bucket completes (``prev``: its bytes, entries and
        index; the decoder checked every entry lies in them); returns the tensors still being
        assembled. With one sender, pieces must come in order; with several, the shards of a
        tensor come from each, in any order, and only overlaps are refused. ``pinned``: the bytes
        are registered for ``self.device``, so the copies into it are queued without waiting (a
        tensor yielded is ready for work on the current stream) and noted on the fence."""
        buf, entries, index = prev
        if pending is None:
            pending = {}
        ordered = len(self.senders) == 1
        for e in entries:
            p = pending.get(e.name)
            if p is None:
                if e.name in self._names:  # the decoder checks one bucket; this, the whole sync
                    raise WeightSyncError(f"weight sync: bucket {index}: {e.name!r} was already received in this sync")
                self._names.add(e.name)
                if e.enc is not None and e.enc.version != self._version:
                    raise WeightSyncError(
                        f"weight sync: bucket {index}: {e.name!r} brings version {e.enc.version:#x}, but this sync's is "
                        f"{self._version:#x}"
                    )
                if e.enc is None:
                    self._held.pop(e.name, None)  # replaced by a tensor of no version
                if e.whole and e.enc is not None:
                    out = self._apply_whole(e, _bytes_of(buf, e), f"bucket {index}")
                    if out is None:
                        continue
                    if bar is not None:
                        bar.update(e.nbytes)
                    stats.tensors += 1
                    stats.bytes += e.nbytes
                    stats.tensor_bytes += e.total
                    yield e.name, out
                    out = None
                    continue
                if e.whole:
                    if e.total == 0:
                        out = torch.empty(e.shape, dtype=e.dtype, device=self.device)
                    else:
                        src = buf[e.offset : e.end].view(e.dtype).view(e.shape)
                        if self.device != self.bucket_device:
                            out = src.to(self.device, non_blocking=pinned)
                            if pinned:
                                self._fence.note(self.device)
                        else:
                            out = src.clone() if copy else src
                    if bar is not None:
                        bar.update(e.nbytes)
                    stats.tensors += 1
                    stats.bytes += e.total
                    stats.tensor_bytes += e.total
                    yield e.name, out
                    out = src = None  # the consumer's now: hold no reference to it
                    continue
                if ordered:
                    if pending:
                        other = next(iter(pending))
                        raise WeightSyncError(
                            f"weight sync: bucket {index}: {e.name!r} starts before {other!r} is complete"
                        )
                    if e.chunk_offset != 0 or e.box is not None:
                        raise WeightSyncError(
                            f"weight sync: bucket {index}: unexpected chunk of {e.name!r} at byte {e.chunk_offset} "
                            "(its first piece; one sender sends a tensor's pieces in order)"
                        )
                into = self._assembly(e.total) if not copy and ordered and e.enc is None and e.box is None else None
                p = pending[e.name] = _Pending(e, self.device, self._held.get(e.name) if e.enc is not None else None, into)
            elif not p.matches(e) or (ordered and (p.done != e.chunk_offset or e.box is not None)):
                raise WeightSyncError(
                    f"weight sync: bucket {index}: unexpected chunk of {e.name!r} at byte "
                    f"{e.chunk_offset} (assembling {p.name!r}: {p.dtype} {list(p.shape)}, {p.done} of {p.total} bytes)"
                )
            p.add(e, _bytes_of(buf, e), f"bucket {index}", pinned and e.enc is None)
            if pinned and e.enc is None:
                self._fence.note(self.device)
            if bar is not None:
                bar.update(e.nbytes)
            stats.bytes += e.nbytes
            if p.done < p.total:
                continue
            del pending[e.name]
            if p.failed is not None:
                self._failed.append(p.failed)
                continue
            stats.tensors += 1
            stats.tensor_bytes += e.total
            if e.enc is not None:
                self._held[e.name] = (e.enc.version, p.tensor)
            out, p = p.tensor, None
            yield e.name, out
            out = None
        return pending

    def _apply_whole(self, e: Entry, src: torch.Tensor, where: str) -> Optional[torch.Tensor]:
        """A whole tensor of a delta sync, applied to the tensor held (in place), or received
        into a new one; None when it cannot be applied (the failure is recorded: the held tensor
        is untouched and keeps its version)."""
        held = self._held.get(e.name)
        fits = held is not None and held[1].shape == e.shape and held[1].dtype == e.dtype
        if e.enc.kind != "full" and (not fits or held[0] != e.enc.base):
            what = "nothing" if held is None else (
                f"version {held[0]:#x}" + ("" if fits else f" as {held[1].dtype} {list(held[1].shape)}"))
            self._failed.append(
                f"weight sync: {where}: a delta of {e.name!r} ({e.dtype} {list(e.shape)}) against version "
                f"{e.enc.base:#x}, but this receiver holds {what} of it"
            )
            return None
        out = held[1] if fits else torch.empty(e.shape, dtype=e.dtype, device=self.device)
        try:
            delta_mod.apply(out.view(-1), e.enc, src, f"{where} ({e.name!r})")
        except WeightSyncError as err:
            self._failed.append(str(err))
            return None
        self._held[e.name] = (e.enc.version, out)
        return out
