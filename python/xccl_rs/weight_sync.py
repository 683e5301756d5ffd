"""Bucketed weight broadcast from one rank of a process group to all the others.

The pattern of RL weight sync (verl's disaggregated GRPO): after every training step a trainer
rank pushes fresh weights to rollout workers over a *private* process group (for example one
made by :func:`xccl_rs.new_group`), beside the trainers' default world.

Terms used below:

* **bucket** -- a 1-D ``uint8`` buffer of ``bucket_bytes`` bytes. Tensors are packed into it one
  after another, each at an offset aligned to ``max(element size, 256)`` bytes.
* **chunk** -- a piece of a tensor too large for the room left in a bucket. A tensor is split
  along its flat (row-major) bytes, every chunk a whole number of elements; the receiver
  reassembles the chunks into one tensor.
* **header** -- a fixed ``int64[8]`` tensor broadcast before every bucket:
  ``[MAGIC, VERSION, meta_nbytes, used_bytes, is_last, sender_bucket_bytes, bucket_index, 0]``.
* **metadata** -- the bucket's entries as UTF-8 JSON in a ``uint8`` tensor of ``meta_nbytes``
  bytes, broadcast after the header and before the bucket. One entry per tensor or chunk:
  ``[name, dtype, shape, offset_in_bucket, nbytes, chunk_offset, total_nbytes]``.

Everything travels through the same group, in the same order on every rank: first, once per
sync, whether every rank can share the sender's memory (a broadcast of a hash of the sender's
host identity and a MIN all-reduce of the ranks' votes); then per bucket the header, the
metadata, then the first ``used_bytes`` bytes of the bucket (skipped when 0). All sizes are
Python ints or int64, so buckets and tensors of 2 GiB and more work.

The sender packs into two buffers in turn: while bucket ``k`` is being broadcast (async),
bucket ``k + 1`` is packed into the other buffer; before packing bucket ``k + 1`` the sender
waits for bucket ``k - 1``'s broadcast (the last user of that buffer). A receiver posts the
broadcast of bucket ``k`` and, while it is in flight, unpacks bucket ``k - 1``.

Memory: a rank allocates nothing until its first ``send``/``receive``; then at most two
buckets (a receiver sizes them from the headers: a single last bucket gets only its used
bytes), the small header/metadata tensors, and the tensors it hands out.

**Shared window** (shared_window.py). When the group is an xccl_rs group, the buckets are on
the CPU and the first step found every rank on the sender's host, the sender's two buckets
live in a shared-memory file that it announces in bucket 0's metadata. Every receiver maps it
if it can, and the group agrees with an all-reduce (MIN) of a flag right after bucket 0's
metadata. If all mapped it, no bucket is broadcast: receivers read each bucket in place, and
a barrier per bucket tells the sender a buffer is free again. In order on every rank (``H_k`` = header and metadata of bucket k,
``C_k`` = the barrier "every receiver is done with bucket k"):
``H_0, flag, H_1, C_0, H_2, C_1, ..., H_L, C_(L-1), C_L``. The sender packs bucket k + 1 while
the receivers unpack bucket k. If some rank could not map it, the buckets are broadcast from
the window as above. Either way the file is unlinked right after the flag. The window saves
the broadcast's copies: the sender's bytes are copied once (packing) and each receiver's once
(unpacking), not three and four times. A window every receiver mapped is kept, mapped, for the
next sync with the same bucket size, so that steady-state syncs fault in no new memory (the
announcement says it was ``reused``). A receiver that did not take part in the sync that made a
kept window cannot map it (its file is gone): when the first flag fails on a reused window,
the sender offers a fresh window that already holds bucket 0 (broadcast: its length, then
its JSON announcement; empty if it could not make one), and a second flag decides, before H_1.
"""

from __future__ import annotations

import json
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from . import shared_window

__all__ = ["SendStream", "SyncStats", "WeightReceiver", "WeightSender", "WeightSyncError", "plan_buckets"]

MAGIC = 0x58434C5753594E43  # "XCLWSYNC"
VERSION = 1
HEADER_LEN = 8
MIN_ALIGN = 256
MIN_BUCKET_BYTES = 256
DEFAULT_BUCKET_BYTES = 512 << 20

_H_MAGIC, _H_VERSION, _H_META, _H_USED, _H_LAST, _H_BUCKET_BYTES, _H_INDEX = range(7)
_ABORTED = -1  # header[_H_LAST] of an abort notice: the metadata is {"abort": reason}


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


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise WeightSyncError(f"weight sync: unknown dtype {name!r} in the metadata")
    return dt


def _device(device) -> torch.device:
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


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _broadcast(group, tensor: torch.Tensor, src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def _group_rank_size(group) -> tuple[int, int]:
    if group is None:
        raise ValueError("weight sync: a process group is required (e.g. xccl_rs.new_group(...))")
    return group.rank(), group.size()


def _progress_bar(enabled: bool, total: Optional[int], desc: str):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


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


# --------------------------------------------------------------------------------------
# the packing plan (pure arithmetic: testable with huge sizes on the meta device)
# --------------------------------------------------------------------------------------


class _Packer:
    """Streams (name, dtype, shape, nbytes) into bucket layouts.

    ``add`` returns the list of pieces ``(entry, flush_after)`` for one tensor, where ``entry``
    is ``[name, dtype, shape, offset, nbytes, chunk_offset, total]`` of the *current* bucket and
    ``flush_after`` says the current bucket is full and must be sent before the next piece.
    A tensor that fits in a bucket is never split (it starts a fresh bucket when the current
    one lacks room); a tensor larger than a bucket fills the room left and continues in the
    following buckets.
    """

    def __init__(self, bucket_bytes: int):
        self.cap = int(bucket_bytes)
        self.used = 0
        self.nonempty = False  # the current bucket has entries (zero-size ones count)

    def _new_bucket(self):
        self.used = 0
        self.nonempty = False

    def add(self, name: str, dtype: torch.dtype, shape, elsize: int):
        numel = 1
        for s in shape:
            numel *= int(s)
        total = numel * elsize
        dname = _dtype_name(dtype)
        shape = [int(s) for s in shape]
        align = max(elsize, MIN_ALIGN)
        out = []  # (flush_before, entry)
        if total == 0:
            self.nonempty = True
            out.append((False, [name, dname, shape, 0, 0, 0, 0]))
            return out
        done = 0
        while done < total:
            off = _align_up(self.used, align)
            room = max(0, self.cap - off)
            remaining = total - done
            if remaining <= room:
                out.append((False, [name, dname, shape, off, remaining, done, total]))
                self.used = off + remaining
                self.nonempty = True
                done = total
            elif done == 0 and total <= self.cap and self.nonempty:
                out.append((True, None))  # flush, then place the whole tensor in a new bucket
                self._new_bucket()
            else:
                take = room // elsize * elsize
                if take == 0:
                    if not self.nonempty:
                        raise WeightSyncError(
                            f"weight sync: bucket of {self.cap} bytes cannot hold one element "
                            f"of {name!r} ({dname}, {elsize} bytes)"
                        )
                    out.append((True, None))
                    self._new_bucket()
                    continue
                out.append((False, [name, dname, shape, off, take, done, total]))
                self.used = off + take
                self.nonempty = True
                done += take
                if done < total:
                    out.append((True, None))
                    self._new_bucket()
        return out


def plan_buckets(named_tensors, bucket_bytes: int) -> list[list[list]]:
    """The bucket layouts ``send`` would produce (a list of buckets, each a list of entries
    ``[name, dtype, shape, offset, nbytes, chunk_offset, total_nbytes]``). Reads only
    dtypes and shapes, so tensors on the ``meta`` device work (used by the tests)."""
    packer = _Packer(bucket_bytes)
    buckets: list[list] = [[]]
    for name, t in named_tensors:
        for flush, entry in packer.add(name, t.dtype, tuple(t.shape), t.element_size()):
            if flush:
                buckets.append([])
            else:
                buckets[-1].append(entry)
    return buckets


# --------------------------------------------------------------------------------------
# sender
# --------------------------------------------------------------------------------------


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


def _describe(index: int, entries: list) -> str:
    names = [e[0] for e in entries]
    if not names:
        return f"bucket {index} (empty)"
    shown = ", ".join(repr(n) for n in names[:3]) + (f", ... (+{len(names) - 3})" if len(names) > 3 else "")
    return f"bucket {index} ({len(names)} tensors: {shown})"


class WeightSender:
    """Broadcasts named tensors from rank ``src`` of ``group`` to every other rank of it.

    ``group`` is any ProcessGroup object (from ``xccl_rs.new_group``, ``dist.new_group``, or
    ``dist.group.WORLD``); ``src`` is a rank *within* the group. ``device`` is where the two
    buckets live (default: CPU; pass ``"cuda"`` for an NCCL group). Tensors on any device are
    copied into them. Nothing is allocated before the first ``send``; the buckets are kept
    for the next ``send`` until :meth:`release`. ``shared_memory`` (default: when ``group`` is
    an xccl_rs group) puts CPU buckets in a shared window that receivers on this host read in
    place (module docstring); ``False`` always broadcasts them.
    """

    def __init__(
        self, group, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device=None, shared_memory=None
    ):
        rank, size = _group_rank_size(group)
        if not 0 <= src < size:
            raise ValueError(f"WeightSender: src {src} is not a rank of a group of size {size}")
        if rank != src:
            raise ValueError(
                f"WeightSender: this is rank {rank} of the group, but src is {src}; "
                "only the source rank sends (the others use WeightReceiver)"
            )
        bucket_bytes = int(bucket_bytes)
        if bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(f"WeightSender: bucket_bytes must be >= {MIN_BUCKET_BYTES}, got {bucket_bytes}")
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.device = _device(device)
        self._slots = [_Slot(), _Slot()]
        self.last_stats: Optional[SyncStats] = None
        if shared_memory is None:
            shared_memory = shared_window.uses_shared_memory(group)
        # The shared window (module docstring): CPU buckets only, and only with receivers.
        self.shared_memory = bool(shared_memory) and self.device.type == "cpu" and size > 1

    def release(self) -> None:
        """Frees the buckets (after waiting for any broadcast still reading them), and the
        shared window kept for this bucket size."""
        for s in self._slots:
            s.wait()
            s.buf = None
        shared_window.drop_kept(self.bucket_bytes)

    def send(self, named_tensors: Iterable, progress: bool = False) -> SyncStats:
        """Sends every ``(name, tensor)`` of ``named_tensors`` (consumed lazily, one at a time,
        so a generator that gathers each weight on demand works). Returns when every
        broadcast has completed. Every other rank of the group must run
        :meth:`WeightReceiver.receive` to the end at the same time."""
        total = None
        if isinstance(named_tensors, dict):
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
        self.bar = _progress_bar(progress, total_bytes, "weight sync (send)")
        self.packer = _Packer(sender.bucket_bytes)
        self.cur = 0  # index of the slot being packed
        self.entries: list = []
        self.index = 0
        self.done = False
        self.broken = False  # a broadcast failed: the group cannot carry an abort notice
        # The shared window: created with the first bucket if every rank can share the
        # sender's memory; `shared` once every rank has mapped it.
        self.window: Optional[shared_window.Window] = None
        self.shared = False
        try:
            self.co_located = _co_located(sender.group, sender.src, sender.shared_memory)
        except Exception as e:
            raise WeightSyncError(f"weight sync: the first step with the receivers failed: {e}") from e

    def _post(self, slot: _Slot, header: torch.Tensor, meta_t: torch.Tensor, used: int, announced=False) -> None:
        s = self.s
        try:
            slot.works.append(_broadcast(s.group, header, s.src))
            slot.works.append(_broadcast(s.group, meta_t, s.src))
            if announced:
                self.shared = self._settle_window(used)
                self.window.unlink()  # every rank has mapped it or given up
            if self.shared:
                slot.consume = True  # receivers read it in place; C_k frees it
            elif used:
                slot.works.append(_broadcast(s.group, slot.buf[:used], s.src))
        except Exception as e:
            self.broken = True
            raise WeightSyncError(f"weight sync: broadcast of {slot.label} failed: {e}") from e
        slot.keep = [header, meta_t]

    def _settle_window(self, used: int) -> bool:
        """After bucket 0's metadata announced the window: whether every rank maps it. A window
        kept from an earlier sync cannot be mapped by a rank that did not take part in that
        sync (its file is gone); then a fresh window, already holding bucket 0, is offered once
        more (module docstring), so that a newcomer costs one bucket copy, not the window."""
        s = self.s
        if _agree_on_window(s.group, True):
            return True
        if not self.window.reused:
            return False
        try:
            fresh = shared_window.Window(s.bucket_bytes)
        except OSError:
            fresh = None  # offer nothing: every rank then agrees to broadcast
        if fresh is not None:
            fresh.slot(0)[:used].copy_(self.window.slot(0)[:used])
        _send_offer(s.group, s.src, fresh.announce() if fresh is not None else {})
        if not _agree_on_window(s.group, fresh is not None):
            if fresh is not None:
                fresh.unlink()
            return False
        self.window.unlink()
        self.window = fresh
        for i, slot in enumerate(s._slots):
            slot.buf = fresh.slot(i)
        return True

    def _consumed(self, slot: _Slot) -> None:
        """Joins C_k for the bucket in ``slot`` (shared window): it can be packed again once
        every receiver is done with it (the caller waits for the slot)."""
        if slot.consume:
            slot.consume = False
            try:
                slot.works.append(self.s.group.barrier())
            except Exception as e:
                self.broken = True
                raise WeightSyncError(f"weight sync: waiting for the receivers of {slot.label} failed: {e}") from e

    def _drop_window(self) -> None:
        """The sync is over: its window is kept for the next sync if every receiver mapped it,
        else unlinked and dropped (the buffers return to private ones either way)."""
        if self.window is not None:
            if self.shared and self.done and not self.broken:
                shared_window.keep_window(self.window)
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

    def _header(self, meta: dict, used: int, last: int):
        s = self.s
        raw = json.dumps(meta, separators=(",", ":")).encode()
        header = torch.tensor(
            [MAGIC, VERSION, len(raw), used, last, s.bucket_bytes, self.index, 0], dtype=torch.int64
        ).to(s.device)
        meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(s.device)
        return header, meta_t

    def _flush(self, is_last: bool) -> None:
        s = self.s
        slot = s._slots[self.cur]
        entries = self.entries
        used = max((e[3] + e[4] for e in entries), default=0)
        total = self.total if self.total is not None else -1
        meta = {"i": self.index, "total": total, "e": entries}
        announced = self.index == 0 and self.window is not None
        if announced:
            meta["w"] = self.window.announce()
        header, meta_t = self._header(meta, used, int(is_last))
        slot.label = _describe(self.index, entries) + f" of {used} bytes from rank {s.src}"
        self._post(slot, header, meta_t, used, announced)
        self.stats.buckets += 1
        if self.bar is not None:
            self.bar.update(sum(e[4] for e in entries))
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
                self.window = shared_window.take_window(s.bucket_bytes)
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
            t = t.detach()
            elsize = t.element_size()
            for flush_now, entry in self.packer.add(name, t.dtype, tuple(t.shape), elsize):
                if flush_now:
                    self._flush(False)
                    continue
                self.entries.append(entry)
                _, _, _, off, nbytes, chunk_off, tot = entry
                if nbytes == 0:
                    continue
                dst = self._buffer()[off : off + nbytes].view(t.dtype)
                if nbytes == tot:
                    dst.view(t.shape).copy_(t)  # one strided copy, contiguous or not
                else:
                    _copy_flat_range(dst, t, chunk_off // elsize, (chunk_off + nbytes) // elsize)
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
                _synchronize(self.s.device)
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
                header, meta_t = self._header({"i": self.index, "abort": str(reason)[:2000]}, 0, _ABORTED)
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


def _host_hash() -> int:
    identity = shared_window.host_identity()
    return zlib.crc32(identity.encode()) if identity else -1


def _co_located(group, src: int, offer: bool, receiver_cpu: bool = True) -> bool:
    """The first step of every sync, on every rank: whether every rank can share the sender's
    memory, so that the sender makes a shared window only when it can serve (a group that spans
    hosts never pays for one). The sender broadcasts a hash of its host identity (-1 when it
    will not share); each rank votes, and a MIN all-reduce decides."""
    rank = group.rank()
    ident = torch.tensor([_host_hash() if rank == src and offer else -1], dtype=torch.int64)
    _broadcast(group, ident, src).wait()
    theirs = int(ident.item())
    vote = theirs >= 0 and (rank == src or (receiver_cpu and theirs == _host_hash()))
    flag = torch.tensor([1 if vote else 0], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def _send_offer(group, src: int, offer: dict) -> None:
    """The second offer of a window (see _settle_window): its length, then its JSON."""
    raw = json.dumps(offer, separators=(",", ":")).encode()
    length = torch.tensor([len(raw)], dtype=torch.int64)
    _broadcast(group, length, src).wait()
    if raw:
        _broadcast(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8), src).wait()


def _recv_offer(group, src: int) -> dict:
    length = torch.empty(1, dtype=torch.int64)
    _broadcast(group, length, src).wait()
    n = int(length.item())
    if not 0 <= n <= 1 << 16:
        raise WeightSyncError(f"weight sync: a window offer of {n} bytes from rank {src}")
    if n == 0:
        return {}
    raw = torch.empty(n, dtype=torch.uint8)
    _broadcast(group, raw, src).wait()
    return json.loads(bytes(raw.numpy()).decode())


def _agree_on_window(group, mapped: bool) -> bool:
    """The flag right after bucket 0's metadata: whether every rank mapped the shared window."""
    flag = torch.tensor([1 if mapped else 0], dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([flag], opts).wait()
    return bool(flag.item())


def _synchronize(device: torch.device) -> None:
    mod = getattr(torch, device.type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize(device)


# --------------------------------------------------------------------------------------
# receiver
# --------------------------------------------------------------------------------------


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
        rank, size = _group_rank_size(group)
        if not 0 <= src < size:
            raise ValueError(f"WeightReceiver: src {src} is not a rank of a group of size {size}")
        if rank == src:
            raise ValueError(f"WeightReceiver: this is the source rank {src}; use WeightSender")
        self.group = group
        self.src = src
        self.bucket_bytes = bucket_bytes
        self.bucket_device = _device(bucket_device)
        self.device = _device(device) if device is not None else self.bucket_device
        self._bufs: list[Optional[torch.Tensor]] = [None, None]
        self.last_stats: Optional[SyncStats] = None

    def release(self) -> None:
        """Frees the receive buckets and the shared windows kept mapped."""
        self._bufs = [None, None]
        shared_window.drop_mapped()

    def _buffer(self, i: int, used: int, capacity: int, is_last: bool) -> torch.Tensor:
        buf = self._bufs[i]
        if buf is None or buf.numel() < used:
            # A last bucket gets just what it needs; any other gets the sender's bucket size,
            # so that later buckets reuse it.
            n = used if is_last else max(used, capacity)
            buf = self._bufs[i] = None  # free the old one first
            buf = self._bufs[i] = torch.empty(n, dtype=torch.uint8, device=self.bucket_device)
        return buf

    def _recv_header(self, index: int) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.bucket_device)
        try:
            _broadcast(self.group, header, self.src).wait()
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: receiving the header of bucket {index} from rank {self.src} failed: {e}"
            ) from e
        h = header.cpu().tolist()
        if h[_H_MAGIC] != MAGIC or h[_H_VERSION] != VERSION:
            raise WeightSyncError(
                f"weight sync: bucket {index}: header from rank {self.src} is not a weight-sync "
                f"header (magic {h[_H_MAGIC]:#x}, version {h[_H_VERSION]}; expected {MAGIC:#x}, "
                f"{VERSION}): every rank of the group must call send/receive in the same order"
            )
        if h[_H_INDEX] != index:
            raise WeightSyncError(
                f"weight sync: expected bucket {index} from rank {self.src}, got bucket {h[_H_INDEX]}"
            )
        return h

    def _recv_meta(self, index: int, nbytes: int) -> dict:
        meta_t = torch.empty(nbytes, dtype=torch.uint8, device=self.bucket_device)
        try:
            _broadcast(self.group, meta_t, self.src).wait()
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: receiving the metadata of bucket {index} ({nbytes} bytes) "
                f"from rank {self.src} failed: {e}"
            ) from e
        return json.loads(bytes(meta_t.cpu().numpy()).decode())

    def _recv_announcement(self, index: int) -> tuple[list[int], dict]:
        """Bucket ``index``'s header and metadata; raises the sender's abort notice."""
        h = self._recv_header(index)
        meta = self._recv_meta(index, h[_H_META])
        if h[_H_LAST] == _ABORTED:
            raise WeightSyncError(
                f"weight sync: the sender (rank {self.src}) aborted at bucket {index}: {meta.get('abort', '?')}"
            )
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
        pending: Optional[dict] = None  # the split tensor being reassembled
        prev = None  # (buffer, entries, index) of the bucket to unpack
        index = 0
        cur = 0
        try:
            try:
                _co_located(self.group, self.src, False, self.bucket_device.type == "cpu")
            except Exception as e:
                raise WeightSyncError(f"weight sync: the first step with rank {self.src} failed: {e}") from e
            while True:
                h, meta = self._recv_announcement(index)
                used, is_last = h[_H_USED], bool(h[_H_LAST])
                if index == 0 and progress:
                    total = meta.get("total", -1)
                    bar = _progress_bar(True, total if total >= 0 else None, "weight sync (receive)")
                if index == 0 and "w" in meta:
                    try:
                        window, in_place = self._join_window(meta["w"])
                    except WeightSyncError:
                        raise
                    except Exception as e:
                        raise WeightSyncError(
                            f"weight sync: agreeing on the shared window with rank {self.src} failed: {e}"
                        ) from e
                    if in_place:
                        pending = yield from self._receive_in_place(window, h, meta, stats, bar, copy)
                        break
                work = buf = None
                if used:
                    buf = self._buffer(cur, used, h[_H_BUCKET_BYTES], is_last)
                    try:
                        work = _broadcast(self.group, buf[:used], self.src)
                    except Exception as e:
                        raise WeightSyncError(
                            f"weight sync: receiving {_describe(index, meta['e'])} of {used} bytes "
                            f"from rank {self.src} failed: {e}"
                        ) from e
                # Unpack the previous bucket while this one is in flight.
                if prev is not None:
                    pending = yield from self._unpack(copy, prev, pending, stats, bar)
                    prev = None
                if work is not None:
                    try:
                        work.wait()
                    except Exception as e:
                        raise WeightSyncError(
                            f"weight sync: receiving {_describe(index, meta['e'])} of {used} bytes "
                            f"from rank {self.src} failed: {e}"
                        ) from e
                stats.buckets += 1
                prev = (buf, meta["e"], index)
                index += 1
                cur ^= 1
                if is_last:
                    break
            if prev is not None:
                pending = yield from self._unpack(copy, prev, pending, stats, bar)
            if pending is not None:
                raise WeightSyncError(
                    f"weight sync: the sender finished with {pending['name']!r} incomplete "
                    f"({pending['done']} of {pending['total']} bytes)"
                )
        finally:
            if bar is not None:
                bar.close()
        stats.seconds = time.perf_counter() - t0
        self.last_stats = stats

    def _receive_in_place(self, window: torch.Tensor, h: list, meta: dict, stats: SyncStats, bar, copy: bool):
        """The rest of a sync over the shared window, from bucket 0 (whose header and metadata
        ``h``/``meta`` are read): bucket k is unpacked where the sender packed it, slot k % 2,
        and C_k tells the sender it is free (module docstring for the order)."""
        bucket = h[_H_BUCKET_BYTES]
        if window.numel() != 2 * bucket:
            raise WeightSyncError(
                f"weight sync: the shared window has {window.numel()} bytes, expected 2 buckets of {bucket}"
            )
        index, pending = 0, None
        stats.shared_window = True
        while True:
            used, is_last = h[_H_USED], bool(h[_H_LAST])
            if not 0 <= used <= bucket:
                raise WeightSyncError(f"weight sync: bucket {index} claims {used} bytes in buckets of {bucket}")
            if index > 0:
                self._consumed(index - 1)
            start = (index % 2) * bucket
            pending = yield from self._unpack(copy, (window[start : start + used], meta["e"], index), pending, stats, bar)
            stats.buckets += 1
            if is_last:
                self._consumed(index)
                return pending
            index += 1
            h, meta = self._recv_announcement(index)

    def _join_window(self, announced: dict):
        """This rank's part of the group's agreement on the shared window (see the sender's
        ``_settle_window``): (the window, whether every rank maps it)."""
        cpu = self.bucket_device.type == "cpu"
        window = shared_window.open_window(announced) if cpu else None
        if _agree_on_window(self.group, window is not None):
            return window, True
        if not announced.get("reused"):
            return None, False
        offer = _recv_offer(self.group, self.src)  # a fresh window for a newcomer
        window = shared_window.open_window(offer) if offer and cpu else None
        if _agree_on_window(self.group, window is not None):
            return window, True
        return None, False

    def _consumed(self, index: int) -> None:
        """C_index: this receiver is done with bucket ``index`` of the shared window."""
        try:
            self.group.barrier().wait()
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: telling rank {self.src} that bucket {index} was read failed: {e}"
            ) from e

    def _unpack(self, copy: bool, prev, pending, stats: SyncStats, bar):
        buf, entries, index = prev
        for name, dname, shape, off, nbytes, chunk_off, total in entries:
            if off < 0 or nbytes < 0 or off + nbytes > buf.numel():
                raise WeightSyncError(
                    f"weight sync: bucket {index}: {name!r} at bytes [{off}, {off + nbytes}) "
                    f"lies outside the bucket's {buf.numel()} bytes"
                )
            dtype = _dtype_of(dname)
            if total == 0:
                out = torch.empty(shape, dtype=dtype, device=self.device)
            elif chunk_off == 0 and nbytes == total:
                src = buf[off : off + nbytes].view(dtype).view(shape)
                if self.device != self.bucket_device:
                    out = src.to(self.device)
                else:
                    out = src.clone() if copy else src
            else:
                if chunk_off == 0:
                    if pending is not None:
                        raise WeightSyncError(
                            f"weight sync: bucket {index}: {name!r} starts before "
                            f"{pending['name']!r} is complete"
                        )
                    t = torch.empty(shape, dtype=dtype, device=self.device)  # contiguous
                    pending = {"name": name, "t": t, "bytes": t.view(-1).view(torch.uint8),
                               "done": 0, "total": total}
                if pending is None or pending["name"] != name or pending["done"] != chunk_off:
                    raise WeightSyncError(
                        f"weight sync: bucket {index}: unexpected chunk of {name!r} at byte "
                        f"{chunk_off} (reassembling {pending and pending['name']!r})"
                    )
                pending["bytes"][chunk_off : chunk_off + nbytes].copy_(buf[off : off + nbytes])
                pending["done"] += nbytes
                if bar is not None:
                    bar.update(nbytes)
                if pending["done"] < total:
                    continue
                out, pending = pending["t"], None
                stats.tensors += 1
                stats.bytes += total
                yield name, out
                continue
            if bar is not None:
                bar.update(nbytes)
            stats.tensors += 1
            stats.bytes += total
            yield name, out
        return pending
