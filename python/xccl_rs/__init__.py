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

__all__ = ["BACKEND_NAME", "register", "torch_version_built"]
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


_check_torch_version()
register()
