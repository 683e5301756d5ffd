"""A shared-memory window for the weight-sync engine: its two buckets in one file of /dev/shm
that the sender and every receiver on the host map, so that a bucket's bytes are packed once
and read in place instead of being broadcast (weight_sync.py describes the protocol).

The file is created with ``O_EXCL`` and mode 0600 under an unguessable name, and unlinked as soon
as every rank of the group has mapped it (or failed to): from then on nothing of it is visible in
/dev/shm, and the memory goes when the last mapping does, even if a process is killed. Only a
sender killed between creating it and the group's agreement leaves the file behind.

A window is kept mapped for the next sync (the same sender process and bucket size, the same
receiver processes), so that steady-state syncs create, zero and fault in nothing: its two
buckets stay allocated, shared by every process that maps them, until :func:`release`.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
from typing import Optional

import torch

PREFIX = "xccl_rs-ws-"
SHM_DIR = "/dev/shm"


# Windows are kept for the next sync (creating, zeroing and faulting in a window of two buckets
# costs as much as copying them): the sender's by bucket size, the receivers' mappings by name.
# A window whose sync fell back to broadcasts is not kept: the next sync makes a fresh one.
_kept: dict[int, "Window"] = {}
_mapped: dict[str, torch.Tensor] = {}
_MAPPED_KEPT = 2


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """The file as a shared uint8 tensor (unmapped when the tensor goes)."""
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive; unmapped with the tensor


def host_identity() -> str:
    """Which ranks can share memory, decided as the transport decides: ``XCCL_RS_HOST_ID`` when
    set, else the hostname with /dev/shm's device and inode. Empty when there is no /dev/shm."""
    override = os.environ.get("XCCL_RS_HOST_ID", "")
    if override:
        return override
    try:
        st = os.stat(SHM_DIR)
    except OSError:
        return ""
    return f"{socket.gethostname()}/{st.st_dev}/{st.st_ino}"


def uses_shared_memory(group) -> bool:
    """Whether ``group`` is an xccl_rs group (the engine's default for windows: groups of other
    backends keep broadcasting their buckets, as the comparison in the demo needs)."""
    try:
        return group._get_backend(torch.device("cpu")).name() == "xccl_rs"
    except Exception:  # noqa: BLE001 (no CPU backend, or an older torch)
        return False


class Window:
    """The sender's side: creates and maps the file; ``slot(i)`` is bucket buffer ``i``. Raises
    OSError when /dev/shm cannot hold it."""

    def __init__(self, bucket_bytes: int):
        self.bucket_bytes = bucket_bytes
        self.nbytes = 2 * bucket_bytes
        self.path: Optional[str] = os.path.join(SHM_DIR, PREFIX + secrets.token_hex(16))
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserved, not sparse: a /dev/shm too small for it (64 MB in a default container)
            # fails here with ENOSPC, where a sparse file would kill the process with SIGBUS on
            # the first write past the limit.
            os.posix_fallocate(fd, 0, self.nbytes)
            self.memory = _map(fd, self.nbytes)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.name = os.path.basename(self.path)
        self.reused = False  # kept from an earlier sync: its file is gone, newcomers cannot map it

    def slot(self, i: int) -> torch.Tensor:
        return self.memory[i * self.bucket_bytes : (i + 1) * self.bucket_bytes]

    def announce(self) -> dict:
        """What receivers need to map it (travels in bucket 0's metadata)."""
        return {"name": self.name, "host": host_identity(), "bytes": self.nbytes, "reused": self.reused}

    def unlink(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

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
        window.unlink()


def drop_mapped() -> None:
    """A receiver's kept mappings go."""
    _mapped.clear()


def release() -> None:
    """Drops every kept window and mapping of this process (their memory goes with the last
    process that maps them)."""
    for size in list(_kept):
        drop_kept(size)
    drop_mapped()


def open_window(announced: dict) -> Optional[torch.Tensor]:
    """The receiver's side: the announced window, mapped (or kept from an earlier sync), or None
    when this rank cannot map it (another host, or a kept window this rank never mapped)."""
    name = str(announced.get("name", ""))
    if announced.get("host") != host_identity() or not name.startswith(PREFIX) or "/" in name:
        return None
    kept = _mapped.get(name)
    if kept is not None:
        return kept if kept.numel() == announced.get("bytes") else None
    memory = _open(name, announced)
    if memory is not None:
        while len(_mapped) >= _MAPPED_KEPT:
            _mapped.pop(next(iter(_mapped)))
        _mapped[name] = memory
    return memory


def _open(name: str, announced: dict) -> Optional[torch.Tensor]:
    path = os.path.join(SHM_DIR, name)
    try:
        nbytes = int(announced["bytes"])
        fd = os.open(path, os.O_RDWR)
    except (OSError, KeyError, ValueError):
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        return _map(fd, nbytes)
    except (OSError, RuntimeError, ValueError):
        return None
    finally:
        os.close(fd)
