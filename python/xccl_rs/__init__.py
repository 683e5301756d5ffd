"""xccl_rs: a torch.distributed backend written in Rust.

``import xccl_rs`` registers the backend ``"xccl_rs"`` for CPU, XPU and CUDA tensors, so that

    import torch.distributed as dist
    import xccl_rs
    dist.init_process_group("xccl_rs")

works like any other backend. On torch >= 2.14 the import is optional: torch finds the backend
through the ``torch.distributed.backends`` entry point of this package.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import _C  # the Rust cdylib, which is also this Python extension

__all__ = ["BACKEND_NAME", "destroy_group", "new_group", "register", "torch_version_built"]
__version__ = "0.1.0"

BACKEND_NAME = "xccl_rs"
DEVICES = ["cpu", "xpu", "cuda"]

#: The torch version (major.minor) the native module was compiled against.
torch_version_built: str = _C.torch_version_built


def _check_torch_version() -> None:
    running = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if running != torch_version_built:
        raise ImportError(
            f"xccl_rs was built against torch {torch_version_built} but torch {running} is "
            "installed; the c10d Backend ABI changes between torch releases, so rebuild xccl_rs "
            "(pip install --force-reinstall --no-build-isolation .)"
        )


def _timeout_of(opts) -> timedelta:
    timeout = getattr(opts, "timeout", None)
    if timeout is None or timeout.total_seconds() <= 0:
        return timedelta(minutes=30)
    return timeout


def _create_backend(dist_backend_opts, backend_options=None):
    """The creator torch calls for every group (extended API)."""
    o = dist_backend_opts
    return _C.create_backend(
        o.store, o.group_rank, o.group_size, _timeout_of(o), str(getattr(o, "group_id", ""))
    )


def register() -> None:
    """Registers the backend with torch.distributed (idempotent). Called on import, and by
    torch's backend autoload (entry point) on torch >= 2.14."""
    if BACKEND_NAME in getattr(dist.Backend, "backend_list", []):
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_backend, extended_api=True, devices=list(DEVICES)
    )


def new_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta = timedelta(minutes=10),
    device=None,
    name: str = "xccl_rs_private",
) -> dist.ProcessGroup:
    """Builds a private xccl_rs process group on any c10d Store.

    No default process group is needed, and the default world (if any) is left untouched:
    nothing is registered with torch.distributed. Every rank of the group calls this with the
    same store (for example ``PrefixStore(f"sync/{round}", TCPStore(host, port, is_master=rank == 0))``)
    and its own rank. It returns once every rank has connected, or raises after ``timeout``.

    Use the group's own methods, which need no registration with torch::

        opts = dist.BroadcastOptions(); opts.rootRank = 0
        pg.broadcast([tensor], opts).wait()
        pg.allreduce([tensor]).wait()
        pg.barrier().wait()

    ``device`` names the device the group's tensors live on (``"cpu"``, ``"cuda"``, ``"xpu"``
    or a torch.device; ``"cuda"`` alone means the current CUDA device): an accelerator binds
    this rank to it, so a tensor on another device raises. Accelerator tensors are staged
    through the host. Destroy a group with
    :func:`destroy_group`; building the next one under the same name over a new store prefix
    works any number of times.
    """
    if not isinstance(store, dist.Store):
        raise TypeError(f"xccl_rs.new_group: store must be a torch.distributed.Store, got {type(store).__name__}")
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"xccl_rs.new_group: rank {rank} is not in a group of size {world_size}")
    return _C.new_process_group(store, rank, world_size, timeout, name, _bound_device(device))


def _bound_device(device) -> "torch.device | None":
    """The accelerator a private group binds this rank to (None for the host or unset); a
    device type without an index means that type's current device."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type not in DEVICES:
        raise ValueError(f"xccl_rs.new_group: device {device} is not one of {DEVICES}")
    if device.type == "cpu":
        return None
    if device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    return device


def destroy_group(group: dist.ProcessGroup) -> None:
    """Shuts a group from :func:`new_group` down: finishes queued work, closes its connections
    and shared memory. Later operations on it raise. Safe to call twice."""
    group.shutdown()


_check_torch_version()
register()
