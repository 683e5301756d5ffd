"""The shared window: a sender's two buckets in one file of /dev/shm that every receiver on the
host maps, so that a bucket's bytes are packed once and read in place instead of being sent;
and the protocol by which a group agrees to use one (every role calls the same functions). With
several senders each has its own window, agreed on separately.

The file is created with ``O_EXCL`` and mode 0600 under an unguessable name, and unlinked as soon
as every rank of the group has mapped it (or failed to): from then on nothing of it is visible in
/dev/shm, and the memory goes when the last mapping does, even if a process is killed. Only a
sender killed between creating it and the group's agreement leaves the file behind.

A window is kept mapped for the next sync (the same sender process and bucket size, the same
receiver processes), so that steady-state syncs create, zero and fault in nothing: its two
buckets stay allocated, shared by every process that maps them, until the roles' ``release()``.

A process that copies between a window and a device (a sender's CUDA tensors, a receiver's
``device="cuda"``) registers its mapping with the device runtime the first time it does
(``pin``, host_memory.py), so that those copies are DMA at the link's speed; the registration
is kept with the mapping and ends before it is unmapped. Where the runtime cannot register
host memory (XPU, no device), nothing is, and the copies stay blocking.

The protocol, on every rank of the group, in this order:

1. The hello (agreement.py), once per sync, before anything else: every rank gives a hash of its
   host identity, or -1 (a sender that will not share, a receiver whose buckets are not on the
   CPU). A sender makes a window only when every receiver gave its host
   (:func:`agreement.window_hosts`), so a group that spans hosts never pays for one.
2. :func:`agree`, right after a sender's first bucket's metadata announced its window: every
   rank votes whether it mapped it (a rank that does not receive says yes). When the vote fails
   on a *reused* window (kept from an earlier sync, whose file is gone, so a rank new to it
   cannot map it), the sender offers a fresh window that already holds that bucket and a second
   vote decides; when it could make none it offers nothing, and every rank knows that sender's
   buckets are sent.
3. :func:`bucket_done` (``C_k``), once per bucket read in place: a barrier that tells its sender
   every receiver is done with bucket ``k``, so its buffer can be packed again.

Every vote is ``vote`` (_common.py): a MIN all-reduce of 0/1, true only when every rank says yes.
"""

from __future__ import annotations

import mmap
import os
import secrets
import zlib
from typing import Callable, Optional

import torch

from .. import _C, host_memory
from ._common import broadcast, tensor_bytes, vote
from .format import MAX_OFFER_BYTES, Announcement, check_length, decode_offer, encode_offer

# The naming rule of the Rust core's shared-memory segments, which it must agree with:
# src/transport/shm/segment.rs (SHM_DIR; Segment::create names files "xccl_rs-..."; Segment::open
# maps only a name with that prefix, no "/" and at most 128 bytes). Windows are segments of that
# family, "xccl_rs-ws-<32 hex digits>".
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "xccl_rs-"
MAX_SEGMENT_NAME = 128
PREFIX = SEGMENT_PREFIX + "ws-"


def is_window_name(name: str) -> bool:
    """Whether a peer's ``name`` may be opened in SHM_DIR (segment.rs's ``Segment::open`` check)."""
    return name.startswith(PREFIX) and "/" not in name and len(name.encode()) <= MAX_SEGMENT_NAME


def host_identity() -> str:
    """Which ranks can share memory, as the core decides it (empty when there is no /dev/shm)."""
    return _C.host_identity()


def host_hash() -> int:
    identity = host_identity()
    return zlib.crc32(identity.encode()) if identity else -1


def uses_shared_memory(group) -> bool:
    """Whether ``group`` is an xccl_rs group (the engine's default for windows: groups of other
    backends keep broadcasting their buckets, as the comparison in the demo needs)."""
    try:
        return group._get_backend(torch.device("cpu")).name() == "xccl_rs"
    except Exception:  # noqa: BLE001 (no CPU backend, or an older torch)
        return False


# --------------------------------------------------------------------------------------
# the protocol (module docstring)
# --------------------------------------------------------------------------------------


def agree(
    group,
    src: int,
    announced: Announcement,
    join: Callable[[Announcement], bool],
    offer: Optional[Callable[[], Optional[Announcement]]] = None,
) -> Optional[Announcement]:
    """Step 2: the window of sender ``src`` that every rank mapped, or None (its buckets are sent).

    ``join(a)`` maps window ``a`` on this rank and says whether it could (the sender's is
    mapped already; another sender says yes). ``offer()``, called on ``src`` only, makes the
    fresh window offered when the vote fails on a reused one (None when it cannot).
    """
    if vote(group, join(announced)):
        return announced
    if not announced.reused:
        return None
    fresh = offer() if group.rank() == src and offer is not None else None
    fresh = _exchange_offer(group, src, fresh, announced.nbytes)
    if fresh is None:
        return None  # nothing offered: every rank knows it without a vote
    return fresh if vote(group, join(fresh)) else None


def _exchange_offer(group, src: int, offer: Optional[Announcement], nbytes: int) -> Optional[Announcement]:
    """The sender broadcasts ``offer`` (its length, then its JSON); every rank returns it."""
    where = f"the window offer from rank {src}"
    sender = group.rank() == src
    raw = encode_offer(offer) if sender else b""
    length = torch.tensor([len(raw)], dtype=torch.int64)
    broadcast(group, length, src).wait()
    n = check_length(int(length.item()), where, "length", MAX_OFFER_BYTES)
    if n == 0:
        return None
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if sender else torch.empty(n, dtype=torch.uint8)
    broadcast(group, buf, src).wait()
    return offer if sender else decode_offer(tensor_bytes(buf), where, nbytes)


def bucket_done(group):
    """Step 3, ``C_k``: every receiver is done with a bucket of the window (async: the Work)."""
    return group.barrier()


# --------------------------------------------------------------------------------------
# the windows
# --------------------------------------------------------------------------------------

# Windows are kept for the next sync (creating, zeroing and faulting in a window of two buckets
# costs as much as copying them): the sender's by bucket size, the receivers' mappings by name.
# A window whose sync fell back to broadcasts is not kept: the next sync makes a fresh one.
_kept: dict[int, "Window"] = {}
_mapped: dict[str, "Mapping"] = {}
_MAPPED_KEPT = 2


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The file as a shared uint8 tensor (unmapped when the tensor goes)."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive; unmapped with the tensor


class Mapping:
    """A window's memory in this process, and its registration with a device runtime (made by
    the first :meth:`pin`, kept until :meth:`unpin`: once per kept window, not per sync)."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self.registration: Optional[host_memory.Registration] = None

    def pin(self, device: torch.device) -> bool:
        """Whether copies between this memory and ``device`` are DMA (registering it the first
        time a device asks); False for the CPU and for runtimes that cannot register."""
        if device.type == "cpu":
            return False
        if self.registration is None or self.registration.device.type != device.type:
            self.unpin()
            self.registration = host_memory.register_host(self.memory, device)
        return self.registration.pinned

    def unpin(self) -> None:
        """Ends the registration; every non-blocking copy through the memory must be done."""
        registration, self.registration = self.registration, None
        if registration is not None:
            registration.unregister()


class Window(Mapping):
    """The sender's side: creates and maps the file; ``slot(i)`` is bucket buffer ``i``. Raises
    OSError when /dev/shm cannot hold it."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.nbytes = 2 * bucket_bytes
        self.name = PREFIX + secrets.token_hex(16)
        self.path: Optional[str] = os.path.join(SHM_DIR, self.name)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserved, not sparse: a /dev/shm too small for it (64 MB in a default container)
            # fails here with ENOSPC, where a sparse file would kill the process with SIGBUS on
            # the first write past the limit.
            os.posix_fallocate(fd, 0, self.nbytes)
            super().__init__(_map(fd, self.nbytes))
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.reused = False  # kept from an earlier sync: its file is gone, newcomers cannot map it

    def slot(self, i: int) -> torch.Tensor:
        return self.memory[i * self.bucket_bytes : (i + 1) * self.bucket_bytes]

    def announcement(self) -> Announcement:
        """What receivers need to map it (travels in bucket 0's metadata)."""
        return Announcement(self.name, host_identity(), self.nbytes, self.reused)

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    def close(self) -> None:
        """Unlinks the file and ends the registration (the memory goes with the last view)."""
        self.unlink()
        self.unpin()

    def __del__(self):
        self.unlink()


def take_window(bucket_bytes: int) -> Window:
    """A window for a sender's sync: the one kept from its last shared sync, else a new one."""
    window = _kept.pop(bucket_bytes, None)
    if window is None:
        return Window(bucket_bytes)
    window.reused = True
    return window


def keep_window(window: Window) -> None:
    """After a sync in which every receiver mapped ``window``: keep it for the next one."""
    _kept[window.bucket_bytes] = window


def drop_kept(bucket_bytes: int) -> None:
    """A sender's kept window of that bucket size goes."""
    window = _kept.pop(bucket_bytes, None)
    if window is not None:
        window.close()


def drop_mapped() -> None:
    """A receiver's kept mappings go (their registrations first)."""
    while _mapped:
        _mapped.popitem()[1].unpin()


def open_window(announced: Announcement, keep: int = _MAPPED_KEPT) -> Optional[Mapping]:
    """The receiver's side: the announced window, mapped (or kept from an earlier sync, with its
    registration), or None when this rank cannot map it (another host, or a kept window this rank
    never mapped). ``keep``: how many mappings stay kept (a receiver of ``N`` senders keeps ``2 * N``)."""
    name = announced.name
    if announced.host != host_identity() or not is_window_name(name):
        return None
    kept = _mapped.get(name)
    if kept is not None:
        return kept if kept.memory.numel() == announced.nbytes else None
    memory = _open(name, announced.nbytes)
    if memory is None:
        return None
    while len(_mapped) >= max(keep, 1):
        _mapped.pop(next(iter(_mapped))).unpin()
    mapping = _mapped[name] = Mapping(memory)
    return mapping


def _open(name: str, nbytes: int) -> Optional[torch.Tensor]:
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        return _map(fd, nbytes)
    except (OSError, RuntimeError, ValueError):
        return None
    finally:
        os.close(fd)
