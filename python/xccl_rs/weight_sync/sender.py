"""The senders' role: each packs its buckets of every round into two buffers in turn and sends
them (the package docstring gives the protocol; plan.py who sends what)."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from .. import host_memory
from . import delta as delta_mod
from . import window
from ._common import (
    SyncStats,
    WeightSyncError,
    broadcast,
    describe,
    group_senders,
    progress_bar,
    read_flat_range,
    resolve_device,
    send_each,
    synchronize,
    tensor_bytes,
)
from .agreement import ABORTED_ROUND, FINAL, SENDING, PlanHash, agree_round, hello, window_hosts
from .format import (
    DEFAULT_BUCKET_BYTES, HEADER_LEN, MAX_BUCKET_BYTES, MAX_NAME_CHARS, MAX_TENSOR_BYTES, MIN_BUCKET_BYTES,
    PAYLOADS, Announcement, BucketMeta, Entry, Header, RoundRecord, check_dtype,
)
from .fp8 import Fp8Rule
from .plan import EVERY, NEXT_ROUND, RoundPlanner, shard_boxes


def _copy_flat_range(dst: torch.Tensor, src: torch.Tensor, e0: int, e1: int, non_blocking: bool = False) -> None:
    """dst (1-D, e1 - e0 elements) <- elements [e0, e1) of src in row-major order."""
    read_flat_range(dst, src, e0, e1, non_blocking)


# --------------------------------------------------------------------------------------
# what one sender sends of a tensor
# --------------------------------------------------------------------------------------


def _dtensor_class():
    """torch's DTensor class, if torch.distributed.tensor is imported (else no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None)


@dataclass
class _Piece:
    """What this sender sends of one tensor: ``src`` (the tensor itself, or its shard), whose
    bytes go to the places the plan gives; ``base``: where a shard's bytes start in the tensor's
    flat bytes (a row block), or ``box`` for any other shard."""

    src: torch.Tensor
    nbytes: int  # this sender's bytes (0: it sends nothing of the tensor)
    shape: tuple[int, ...]  # the whole tensor's
    total: int  # the whole tensor's bytes
    token: str  # what the plan hash records
    footprint: Optional[int] = None  # a sharded tensor's largest shard (bytes); None: a whole tensor
    base: int = 0
    box: Optional[tuple[tuple[int, int], ...]] = None


def _piece(name: str, t: torch.Tensor, senders: int) -> _Piece:
    """This sender's part of ``t``: a plain tensor is whole (one sender sends it); a DTensor's
    shard is sent as it is (each sender its own), from ``to_local()``, never gathered."""
    elsize = t.element_size()
    dtensor = _dtensor_class()
    if dtensor is None or not isinstance(t, dtensor):
        shape = tuple(t.shape)
        return _Piece(t, t.numel() * elsize, shape, t.numel() * elsize, f"W|{name}|{t.dtype}|{shape}")
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = t.device_mesh, tuple(t.placements)
    shape = tuple(t.shape)
    total = t.numel() * elsize
    for md, p in enumerate(placements):
        if not (type(p) is Shard or isinstance(p, Replicate)):
            raise TypeError(
                f"{name!r} is a DTensor with placement {p!r} on mesh dimension {md}; weight sync sends "
                "Shard and Replicate shards as they are: redistribute it to those, or send full_tensor()"
            )
    placements = tuple(Shard(p.dim % len(shape)) if type(p) is Shard else p for p in placements)
    if mesh.size() == 1 or total == 0:
        local = t.to_local() if mesh.size() == 1 else torch.empty(shape, dtype=t.dtype, device=t.to_local().device)
        return _Piece(local, total, shape, total, f"W|{name}|{t.dtype}|{shape}")
    if mesh.size() != senders:
        raise ValueError(
            f"{name!r} is a DTensor on a mesh of {mesh.size()} ranks {tuple(mesh.shape)}, but this sync has "
            f"{senders} sender(s): every rank of the mesh must send it (WeightSender(senders=...)), or send its "
            "full_tensor()"
        )
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"{name!r} is a DTensor on a mesh this rank is not part of")
    sizes, offsets = shard_boxes(shape, mesh.shape, coord, placements)
    local = t.to_local()
    if tuple(local.shape) != sizes:
        raise ValueError(
            f"{name!r}: this rank's shard has shape {tuple(local.shape)}, but {placements} of {shape} over the mesh "
            f"{tuple(mesh.shape)} gives coordinate {tuple(coord)} the shape {sizes}"
        )
    largest, _ = shard_boxes(shape, mesh.shape, [0] * mesh.ndim, placements)
    footprint = elsize
    for s in largest:
        footprint *= s
    # A replicated mesh dimension: its coordinate 0 sends, the copies elsewhere stay home.
    sends = all(c == 0 for c, p in zip(coord, placements) if isinstance(p, Replicate))
    token = f"S|{name}|{t.dtype}|{shape}|{tuple(mesh.shape)}|{placements}"
    piece = _Piece(local, local.numel() * elsize if sends else 0, shape, total, token, footprint)
    dims = {p.dim for p in placements if type(p) is Shard}
    if dims == {0}:
        row = total // shape[0]  # shape[0] > 0: total > 0
        piece.base = offsets[0] * row  # a block of rows: a run of the tensor's flat bytes
    elif dims:
        piece.box = tuple(zip(offsets, sizes))
    return piece


# --------------------------------------------------------------------------------------
# the sender
# --------------------------------------------------------------------------------------


class _Slot:
    """One of the two send buffers and the transfers that still read it."""

    __slots__ = ("buf", "works", "keep", "label", "used")

    def __init__(self):
        self.buf: Optional[torch.Tensor] = None
        self.works: list = []
        self.keep: list = []
        self.label = ""
        self.used = 0  # the bytes of buf the round's bucket sends (0: none, or read in place)

    def wait(self) -> None:
        works, self.works = self.works, []
        try:
            for w in works:
                w.wait()
        except Exception as e:
            raise WeightSyncError(f"weight sync: sending {self.label} failed: {e}") from e
        finally:
            self.keep = []


class WeightSender:
    """Sends named tensors from this rank of ``group`` to every rank of it that does not send.

    ``group`` is any ProcessGroup object (from ``xccl_rs.new_group``, ``dist.new_group``, or
    ``dist.group.WORLD``). One sender: ``src`` is its rank *within* the group (this rank), and
    every other rank receives. Several: ``senders`` lists their group ranks (this rank among
    them; every rank passes the same list, in the same order, and ``src`` is ignored); every
    other rank receives, and the buckets are shared out among the senders (plan.py): each sender
    is given the same tensors and sends its share of whole tensors, and its own shard of each
    DTensor. ``device`` is where the two buckets live (default: CPU; pass ``"cuda"`` for an
    NCCL group). Tensors on any device are copied into them. Nothing is allocated before the
    first ``send``, and a sender allocates its buckets only when it has bytes to pack; they are
    kept for the next ``send`` until :meth:`release`. ``shared_memory`` (default: when ``group``
    is an xccl_rs group) puts CPU buckets in a shared window that receivers on this host read in
    place (the package docstring); ``False`` always sends them.

    ``payload`` says what travels (every sender of a group must pass the same; the receivers
    learn it from the wire, so :class:`WeightReceiver` takes no such option):

    * ``"full"`` (default) -- every tensor as it is;
    * ``"delta"`` -- after a tensor's first full sync, only its elements that changed since the
      version every receiver holds (delta.py: versions are checked before every sync, and what
      a receiver lacks travels in full). ``delta_base`` says where the sender keeps its copy of
      what it sent: ``"copy"`` (default) where each tensor lives, ``"cpu"`` in host memory;
    * ``"fp8"`` -- the weights that ``fp8_select(name, tensor)`` selects (default: 2-D
      ``...weight`` tensors other than embeddings, the head and norms) as ``float8_e4m3fn`` with
      float32 scales ``<name>_scale_inv`` (``fp8_scale="block"``: 128x128 blocks, vLLM's
      block-fp8 checkpoint layout) or ``<name>_scale`` (``"channel"``, ``"tensor"``); the rest
      as they are (fp8.py). A DTensor that is quantized is gathered (``full_tensor()``) first.
    """

    def __init__(
        self, group, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device=None, shared_memory=None,
        senders=None, payload: str = "full", fp8_scale: str = "block", fp8_select=None, delta_base: str = "copy",
    ):
        rank, size, senders = group_senders(group, senders, src, "WeightSender")
        if rank not in senders:
            if len(senders) == 1:
                raise ValueError(
                    f"WeightSender: this is rank {rank} of the group, but src is {senders[0]}; "
                    "only the source rank sends (the others use WeightReceiver)"
                )
            raise ValueError(f"WeightSender: this is rank {rank} of the group, not one of the senders {senders}")
        bucket_bytes = int(bucket_bytes)
        if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(
                f"WeightSender: bucket_bytes must be in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}], got {bucket_bytes}"
            )
        self.group = group
        self.src = rank
        self.senders = senders
        self.receivers = [r for r in range(size) if r not in senders]
        self.bucket_bytes = bucket_bytes
        if payload not in PAYLOADS:
            raise ValueError(f"WeightSender: payload must be one of {sorted(PAYLOADS)}, got {payload!r}")
        self.payload = payload
        self._fp8 = Fp8Rule(fp8_scale, fp8_select) if payload == "fp8" else None
        self._bases = delta_mod.SenderBases(delta_base) if payload == "delta" else None
        self.device = resolve_device(device)
        self._slots = [_Slot(), _Slot()]
        self.last_stats: Optional[SyncStats] = None
        if shared_memory is None:
            shared_memory = window.uses_shared_memory(group)
        # The shared window: CPU buckets only, and only with receivers.
        self.shared_memory = bool(shared_memory) and self.device.type == "cpu" and bool(self.receivers)

    def release(self) -> None:
        """Frees the buckets (after waiting for any transfer still reading them), and the
        shared window kept for this bucket size."""
        for s in self._slots:
            s.wait()
            s.buf = None
        window.drop_kept(self.bucket_bytes)

    @property
    def delta_base_bytes(self) -> int:
        """What this sender keeps to compute deltas (its copies), in bytes; 0 for other payloads."""
        return self._bases.nbytes if self._bases is not None else 0

    def send(self, named_tensors: Iterable, progress: bool = False) -> SyncStats:
        """Sends every ``(name, tensor)`` of ``named_tensors`` (consumed lazily, one at a time,
        so a generator that gathers each weight on demand works). Returns when every transfer
        has completed. Every receiver must run :meth:`WeightReceiver.receive` to the end at the
        same time, and every other sender ``send`` with the same tensors."""
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
    """One sync in progress on a sender (see :meth:`WeightSender.stream`)."""

    def __init__(self, sender: WeightSender, progress: bool, total_bytes: Optional[int]):
        s = self.s = sender
        self.t0 = time.perf_counter()
        self.stats = SyncStats()
        self.total = total_bytes
        self.bar = progress_bar(progress, total_bytes, "weight sync (send)")
        self.n = len(s.senders)
        self.me = s.senders.index(s.src)
        self.plan = PlanHash(s.bucket_bytes, self.n)
        self.entries: list[Entry] = []  # this sender's bucket of the current round
        self.names: set[str] = set()  # receivers refuse a name sent twice
        self.done = False
        self.broken = False  # a transfer failed: the group cannot carry an abort notice
        # The shared windows: this sender's, created with its first bucket if every receiver
        # can share its memory; shared[i]: sender i's buckets are read in place.
        self.window: Optional[window.Window] = None
        # Copies from device tensors into a registered window are queued without waiting; a
        # bucket is published (its header sent) only once they are done.
        self.fence = host_memory.CopyFence()
        self.shared = [False] * self.n
        self.later: list = []  # barriers of other senders' buckets, waited for at the end
        self.round = 0  # the round being packed (the planner may be further on)
        self.stats.payload = s.payload
        self.bases = s._bases  # the delta payload's copies, else None
        self.cursor = 0  # a delta sync packs its encoded ranges one after another, from here
        with self._breaking("the first step with the receivers"):
            sync = delta_mod.new_version() if self.bases is not None else 0
            host = window.host_hash() if s.shared_memory else -1
            records = hello(s.group, s.senders, host, s.device, PAYLOADS[s.payload], sync)
            windows = window_hosts(records, s.senders)
            self.co_located = windows[self.me]
            # A delta sync's entries are encoded ranges, never read whole from the window.
            self.planner = RoundPlanner(s.bucket_bytes, self.n, s.shared_memory and self.co_located and s._bases is None)
            # Without shared windows, a round's buckets from several senders travel at once:
            # every header of the round first, then each sender's bucket to every receiver.
            self.batched = self.n > 1 and not any(windows)
            self.version = records[s.senders[0]].sync
            if self.bases is not None:
                mine = self.bases.base_list()
                flags = delta_mod.check_bases(s.group, s.senders, mine, None, s.device)
                self.bases.keep_only(list(mine.names), flags)

    @contextlib.contextmanager
    def _breaking(self, what: str):
        """A failure in the block breaks the stream (the group cannot carry an abort notice
        after it); one that is not a :class:`WeightSyncError` becomes one saying ``what`` failed."""
        try:
            yield
        except WeightSyncError:
            self.broken = True
            raise
        except Exception as e:
            self.broken = True
            raise WeightSyncError(f"weight sync: {what} failed: {type(e).__name__}: {e}") from e

    # ---- packing ---------------------------------------------------------------------

    def _buffer(self) -> torch.Tensor:
        s = self.s
        if s.shared_memory and self.co_located and self.window is None and self.round == 0:
            # A window per sync: receivers map it by name, and it is unlinked right after.
            try:
                self.window = window.take_window(s.bucket_bytes)
            except OSError as e:
                warnings.warn(
                    f"weight sync: no shared window of {2 * s.bucket_bytes} bytes in /dev/shm ({e}); "
                    "sending the buckets instead",
                    RuntimeWarning,
                    stacklevel=2,
                )
                s.shared_memory = False
            else:
                for i, slot in enumerate(s._slots):
                    slot.buf = self.window.slot(i)
        slot = s._slots[self.round % 2]
        if slot.buf is None:  # a sender's device never changes: allocate once, then reuse
            slot.buf = torch.empty(s.bucket_bytes, dtype=torch.uint8, device=s.device)
        return slot.buf

    def _pinned_for(self, device: torch.device) -> bool:
        """Whether copies from ``device`` into the buffers are DMA that may be queued without
        waiting: the window, registered for ``device``'s runtime (the first time, then kept with
        the window). Private buffers, and runtimes that cannot register, copy blocking."""
        return self.window is not None and device.type != "cpu" and self.window.pin(device)

    @torch.no_grad()
    def add(self, name: str, t: torch.Tensor) -> None:
        """Plans one tensor and packs this sender's part of it (sending the rounds it completes)."""
        if self.done:
            raise WeightSyncError("weight sync: add() after finish()")
        rule = self.s._fp8
        if rule is None or not isinstance(t, torch.Tensor):
            return self._add_one(name, t)
        try:
            dtensor = _dtensor_class()
            if dtensor is not None and isinstance(t, dtensor) and rule.select(name, t):
                t = t.full_tensor()  # a 128x128 block may straddle shards: quantize the whole weight
            parts = rule.split(name, t.detach())
        except Exception as e:
            raise WeightSyncError(f"weight sync: send failed in round {self.round} while quantizing {name!r}: "
                                  f"{type(e).__name__}: {e}") from e
        for part_name, part in parts:
            self._add_one(part_name, part)

    def _add_one(self, name: str, t: torch.Tensor) -> None:
        sent, contributed = 0, False
        dense = 0
        base = None
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
            piece = _piece(name, t, self.n)
            if self.bases is not None:
                base = self.bases.usable(name, piece.src)
                self.bases.forget(name)  # until every range of it is packed
            self.names.add(name)
            self.plan.add(piece.token)
            if piece.footprint is None:
                steps = self.planner.add_whole(name, t.dtype, piece.total, elsize)
            else:
                steps = self.planner.add_sharded(name, t.dtype, piece.footprint, elsize)
            for place in steps:
                if place is NEXT_ROUND:
                    self._flush_round(final=False)
                    continue
                if place.sender == self.me:  # this sender's share of a whole tensor
                    entry = Entry(name, t.dtype, piece.shape, place.offset, place.nbytes, place.start, piece.total)
                    start = place.start
                elif place.sender == EVERY:  # this sender's shard, what it has of the range
                    start = place.start
                    nbytes = min(place.nbytes, piece.nbytes - start)
                    if nbytes <= 0:
                        continue
                    offset = place.start if piece.box is not None else piece.base + place.start
                    entry = Entry(name, t.dtype, piece.shape, place.offset, nbytes, offset, piece.total, piece.box)
                else:
                    continue
                if self.bases is not None:
                    entry = self._encode_range(entry, piece, start, base)
                    dense += entry.dense
                self.entries.append(entry)
                contributed = True
                if entry.nbytes == 0 or self.bases is not None:
                    sent += entry.nbytes
                    continue
                dst = self._buffer()[entry.offset : entry.end].view(t.dtype)
                pinned = self._pinned_for(piece.src.device)
                if entry.whole and piece.src.shape == piece.shape:
                    # one strided copy, contiguous or not
                    dst.view(piece.shape).copy_(piece.src, non_blocking=pinned)
                else:
                    e0 = start // elsize
                    _copy_flat_range(dst, piece.src, e0, e0 + entry.nbytes // elsize, pinned)
                if pinned:
                    self.fence.note(piece.src.device)
                sent += entry.nbytes
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(
                f"weight sync: send failed in round {self.round} while packing {name!r}: "
                f"{type(e).__name__}: {e}"
            ) from e
        if contributed:
            self.stats.tensors += 1
            if self.bases is not None:
                self.bases.update(name, piece.src, self.version, base)
        self.stats.bytes += sent
        self.stats.tensor_bytes += dense if self.bases is not None else sent
        if self.bar is not None:
            self.bar.update(sent)

    def _encode_range(self, entry: Entry, piece: _Piece, start: int, base) -> Entry:
        """A delta sync's entry: the range of ``entry`` encoded against ``base`` (delta.py), packed
        right after the bucket's previous entry (the plan's offsets are for the full ranges, so
        the encoded ones always fit)."""
        elsize = entry.dtype.itemsize
        e0 = start // elsize
        enc, write = self.bases.encode(entry.name, piece.src, e0, e0 + entry.nbytes // elsize, self.version, base)
        off = -(-self.cursor // delta_mod.ALIGN) * delta_mod.ALIGN
        wire = enc.wire_nbytes(elsize)
        self.cursor = off + wire
        if wire:
            write(self._buffer()[off : off + wire])
        if enc.kind == "full":
            self.stats.full_ranges += 1 if enc.dense else 0  # an empty tensor is not a range sent in full
        else:
            self.stats.changed += enc.count
        self.stats.elements += enc.dense // elsize
        return Entry(entry.name, entry.dtype, entry.shape, off, wire, entry.chunk_offset, entry.total, entry.box, enc)

    # ---- sending a round -------------------------------------------------------------

    def _encode(self, meta: BucketMeta, index: int, used: int, last: bool = False, aborted: bool = False):
        """The header and metadata tensors of bucket ``index``."""
        s = self.s
        raw = meta.encode()
        header = Header(index, len(raw), used, s.bucket_bytes, last=last, aborted=aborted)
        header_t = torch.tensor(header.encode(), dtype=torch.int64).to(s.device)
        meta_t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(s.device)
        return header_t, meta_t

    def _flush_round(self, final: bool) -> None:
        """Every bucket of the current round, in sender order: this sender's own, and its part
        in the others' (their headers, their windows' votes, the barriers); then the next round.
        Batched (several senders, no window): every header first, then this sender's bucket,
        which travels while the other senders' do."""
        s = self.s
        with self._breaking(f"round {self.round}"):
            self.fence.wait()  # the bucket's copies from the device have landed before anyone reads it
            if self.n > 1:
                out = agree_round(s.group, s.senders, self.round, RoundRecord(self.round, FINAL if final else SENDING,
                                                                              self.plan.value), s.device)
                if out.aborted_by is not None:
                    self._other_abort(out.aborted_by)
            for i in range(self.n):
                k = self.round * self.n + i
                last = final and i == self.n - 1
                if i == self.me:
                    self._post_own(k, last)
                else:
                    self._follow(k, s.senders[i], last)
                if k > 0:
                    self._done_reading(k - 1)
            if self.batched:
                self._post_payload()
            if final:
                self._done_reading(self.round * self.n + self.n - 1)
        self.entries = []
        self.cursor = 0
        self.round += 1
        if not final:
            # The next round reuses the other buffer: its last transfer (or, with the shared
            # window, every receiver's reading of it) must be done.
            self._wait(s._slots[self.round % 2])

    def _post_own(self, k: int, last: bool) -> None:
        s = self.s
        slot = s._slots[self.round % 2]
        entries = self.entries
        used = max((e.end for e in entries), default=0)
        announced = self.window.announcement() if self.round == 0 and self.window is not None else None
        meta = BucketMeta(k, entries, self.total if self.total is not None else -1, announced)
        header, meta_t = self._encode(meta, k, used, last=last)
        slot.label = describe(k, [e.name for e in entries]) + f" of {used} bytes from rank {s.src}"
        try:
            slot.works.append(broadcast(s.group, header, s.src))
            slot.works.append(broadcast(s.group, meta_t, s.src))
            if announced is not None:
                self.shared[self.me] = self._settle_window(announced, used)
                self.window.unlink()  # every rank has mapped it or given up
        except Exception as e:
            raise WeightSyncError(f"weight sync: sending {slot.label} failed: {e}") from e
        slot.keep = [header, meta_t]
        slot.used = 0 if self.shared[self.me] else used
        self.stats.buckets += 1
        if not self.batched:
            self._post_payload()

    def _post_payload(self) -> None:
        """Sends this round's bucket unless the receivers read it in place: with one sender, a
        broadcast; with several (the others do not take it), to each receiver at once."""
        s = self.s
        slot = s._slots[self.round % 2]
        if not slot.used:
            return
        payload = slot.buf[: slot.used]
        try:
            if self.n == 1:
                slot.works.append(broadcast(s.group, payload, s.src))
            else:
                slot.works.extend(send_each(s.group, payload, s.receivers))
        except Exception as e:
            raise WeightSyncError(f"weight sync: sending {slot.label} failed: {e}") from e

    def _receive_control(self, k: int, owner: int) -> tuple[Header, BucketMeta]:
        """Bucket ``k``'s header and metadata from sender ``owner`` (this sender takes part in the
        broadcasts; it reads nothing else of the bucket)."""
        s = self.s
        where = f"bucket {k} from rank {owner}"
        try:
            header_t = torch.empty(HEADER_LEN, dtype=torch.int64, device=s.device)
            broadcast(s.group, header_t, owner).wait()
            h = Header.decode(header_t.cpu().tolist(), where, k, s.bucket_bytes)
            meta_t = torch.empty(h.meta_nbytes, dtype=torch.uint8, device=s.device)
            broadcast(s.group, meta_t, owner).wait()
        except WeightSyncError:
            raise
        except Exception as e:
            raise WeightSyncError(f"weight sync: receiving the header of bucket {k} from rank {owner} failed: {e}") from e
        return h, BucketMeta.decode(tensor_bytes(meta_t), h, where, self.n)

    def _follow(self, k: int, owner: int, last: bool) -> None:
        """This sender's part in another sender's bucket ``k``."""
        h, meta = self._receive_control(k, owner)
        if meta.abort is not None:
            raise WeightSyncError(f"weight sync: the sender (rank {owner}) aborted at bucket {k}: {meta.abort}")
        if h.last != last:
            raise WeightSyncError(
                f"weight sync: bucket {k} from rank {owner} is {'' if h.last else 'not '}the last, "
                f"but this sender's plan says it is {'' if last else 'not '}(the senders' plans differ)"
            )
        if meta.window is not None:
            agreed = window.agree(self.s.group, owner, meta.window, lambda a: True)
            self.shared[k % self.n] = agreed is not None

    def _done_reading(self, k: int) -> None:
        """Joins C_k when bucket ``k`` was read in place: its sender may pack it again once every
        receiver is done with it."""
        i = k % self.n
        if not self.shared[i]:
            return
        work = window.bucket_done(self.s.group)
        if i == self.me:
            self.s._slots[(k // self.n) % 2].works.append(work)
        else:
            self.later.append(work)

    def _settle_window(self, announced: Announcement, used: int) -> bool:
        """The sender's part of the agreement on the window announced in its first bucket
        (window.agree): whether every rank maps it. The fresh window it may offer already holds
        that bucket, so that a newcomer costs one bucket copy, not the window."""
        s = self.s
        fresh: list[window.Window] = []

        def offer() -> Optional[Announcement]:
            try:
                w = window.Window(s.bucket_bytes)
            except OSError:
                return None  # offer nothing: every rank then knows the buckets are sent
            w.slot(0)[:used].copy_(self.window.slot(0)[:used])
            fresh.append(w)
            return w.announcement()

        agreed = window.agree(s.group, s.src, announced, lambda a: True, offer)
        if agreed is None or agreed.name == self.window.name:
            for w in fresh:
                w.close()
            return agreed is not None
        self.window.close()
        self.window = fresh[0]
        for i, slot in enumerate(s._slots):
            slot.buf = self.window.slot(i)
        return True

    def _drop_window(self) -> None:
        """The sync is over: its window is kept for the next sync if every receiver mapped it,
        else unlinked and dropped (the buffers return to private ones either way)."""
        if self.window is not None:
            try:
                self.fence.wait()  # a sync that failed may leave copies into the window queued
            except Exception:  # noqa: BLE001 - the device's own error is the one that surfaces
                pass
            if self.shared[self.me] and self.done and not self.broken:
                window.keep_window(self.window)  # with its registration: kept windows pin once
            else:
                self.window.close()
            self.window = None
            for slot in self.s._slots:
                slot.buf = None

    def _wait(self, slot: _Slot) -> None:
        with self._breaking(f"sending {slot.label}"):
            slot.wait()

    def _wait_later(self) -> None:
        works, self.later = self.later, []
        with self._breaking("waiting for the receivers of the other senders' buckets"):
            for w in works:
                w.wait()

    # ---- the end ---------------------------------------------------------------------

    def finish(self) -> SyncStats:
        """Sends the last round and waits for every transfer."""
        if self.done:
            raise WeightSyncError("weight sync: finish() called twice")
        self.done = True
        try:
            self._flush_round(final=True)
            for slot in self.s._slots:
                self._wait(slot)
            self._wait_later()
            if self.s.device.type != "cpu":
                # An accelerator backend's wait() only orders streams: finish the transfers.
                synchronize(self.s.device)
            if self.bases is not None:
                with self._breaking("the confirmation of the delta sync"):
                    delta_mod.confirm(self.s.group, 0, self.s.device)
        finally:
            self._drop_window()
            if self.bar is not None:
                self.bar.close()
        self.stats.shared_window = self.shared[self.me]
        self.stats.seconds = time.perf_counter() - self.t0
        self.s.last_stats = self.stats
        return self.stats

    def _notice(self, index: int, reason: str) -> None:
        """Posts this sender's abort notice as bucket ``index``'s header and metadata."""
        slot = self.s._slots[self.round % 2]
        slot.label = f"the abort notice at bucket {index}"
        header, meta_t = self._encode(BucketMeta(index, abort=str(reason)), index, 0, aborted=True)
        slot.works.append(broadcast(self.s.group, header, self.s.src))
        slot.works.append(broadcast(self.s.group, meta_t, self.s.src))
        slot.keep = [header, meta_t]

    def _other_abort(self, by: int) -> None:
        """Another sender aborted this round: take its notice (as every rank does) and raise it."""
        k = self.round * self.n
        _, meta = self._receive_control(k, by)
        raise WeightSyncError(f"weight sync: the sender (rank {by}) aborted at bucket {k}: {meta.abort}")

    def abort(self, reason: str = "the sender gave up") -> None:
        """Gives up (the producer of the weights failed): every other rank raises
        ``WeightSyncError`` with ``reason`` at the same place, rather than wait for the group
        timeout or take a truncated model for a complete one. One sender sends an abort notice in
        place of its next header; several say so in the next round's agreement, and the first of
        them sends its notice. When a transfer already failed, only waits for what is still in
        flight."""
        if self.done:
            return
        self.done = True
        try:
            if not self.broken:
                s = self.s
                if self.n == 1:
                    self._notice(self.round, reason)
                else:
                    out = agree_round(s.group, s.senders, self.round, RoundRecord(self.round, ABORTED_ROUND, 0), s.device)
                    if out.aborted_by == s.src:
                        self._notice(self.round * self.n, reason)
                    else:  # another aborted first: every rank takes its notice
                        self._receive_control(self.round * self.n, out.aborted_by)
            for slot in self.s._slots:
                try:
                    slot.wait()
                except WeightSyncError:
                    pass
            try:
                self._wait_later()
            except WeightSyncError:
                pass
        except Exception:  # noqa: BLE001 - the original error is the one the caller raises
            pass
        finally:
            self._drop_window()
            if self.bar is not None:
                self.bar.close()
