"""xccl_rs: a torch.distributed backend written in Rust.

``import xccl_rs`` registers the backend ``"xccl_rs"`` for CPU tensors and for the XPU and CUDA
tensors of the devices this host has (see ``DEVICES``), so that

    import torch.distributed as dist
    import xccl_rs
    dist.init_process_group("xccl_rs")

works like any other backend. On torch >= 2.14 the import is optional: torch finds the backend
through the ``torch.distributed.backends`` entry point of this package.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

REBUILD = "pip install --force-reinstall --no-deps ."  # run in the xccl_rs source directory


def _running_torch() -> tuple[str, bool]:
    """(major.minor, C++11 ABI) of the torch in this process."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2]), bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def _mismatch(built: tuple[str, bool | None]) -> ImportError:
    def name(v: str, abi: bool | None) -> str:
        return f"torch {v}" + ("" if abi is None else f" ({'C++11' if abi else 'pre-C++11'} ABI)")

    running = _running_torch()
    return ImportError(
        f"xccl_rs was compiled against {name(*built)} but is being loaded into {name(*running)}, "
        f"and a c10d backend only works in the torch it was compiled against: install the xccl_rs wheel "
        f"for torch {running[0]} (`pip install \"xccl_rs=={running[0]}.*\"`), or rebuild it in the xccl_rs "
        f"source directory with `{REBUILD}`"
    )


def _load_extension():
    """Imports the compiled module, after checking (where the build recorded it, in
    _build_info.py) that it was compiled against this torch: loading it into another one could
    fail on a missing symbol or, worse, run with another c10d::Backend layout."""
    try:
        from . import _build_info
    except ImportError:  # built without setup.py (cargo, scripts/gpu): _C says below
        built = None
    else:
        built = (_build_info.TORCH_VERSION, _build_info.TORCH_CXX11_ABI)
        if built != _running_torch():
            raise _mismatch(built)
    if importlib.util.find_spec(f"{__name__}._C") is None:
        raise ImportError(
            f"xccl_rs at {os.path.dirname(__file__)} has no compiled extension (_C): it was installed "
            f"without its build; rebuild it in the xccl_rs source directory with `{REBUILD}`"
        )
    try:
        from . import _C
    except ImportError as e:
        if built is not None or "undefined symbol" not in str(e):
            raise
        raise _mismatch(("an unknown version", None)) from e
    if _C.torch_version_built != _running_torch()[0]:
        raise _mismatch((_C.torch_version_built, None))
    return _C


_C = _load_extension()

__all__ = ["BACKEND_NAME", "destroy_group", "dump", "empty", "new_group", "register", "stats", "torch_version_built", "zero_copy_ops", "zeros"]
__version__ = "0.1.0"

BACKEND_NAME = "xccl_rs"

#: Every device type xccl_rs can serve, in the order torch should prefer them.
_DEVICE_TYPES = ("cpu", "xpu", "cuda")


def _device_count(device_type: str) -> int:
    """How many devices of ``device_type`` torch sees now (the host counts as one). Asks each
    module's ``device_count()``, which tries NVML (CUDA) or Level Zero Sysman (XPU) before the
    runtime, so it does not poison fork where those work; never raises."""
    if device_type == "cpu":
        return 1
    module = getattr(torch, device_type, None)
    try:
        return int(module.device_count()) if module is not None else 0
    except Exception:  # noqa: BLE001  (no driver, no runtime: no device)
        return 0


def _present_devices() -> list[str]:
    return [d for d in _DEVICE_TYPES if _device_count(d) > 0]


#: The device types xccl_rs is registered for: ``cpu`` and each accelerator type torch sees
#: when xccl_rs is imported (xpu before cuda). torch's own device-picking code takes the first
#: entry that is not cpu (``ShardedTensor.gather``, hence DCP's resharding, calls
#: ``<device>.current_device()`` on it), so a device type the host lacks must not be listed.
#: A device that becomes visible after the import is not added: make it visible first.
DEVICES = _present_devices()

#: The torch version (major.minor) the native module was compiled against.
torch_version_built: str = _C.torch_version_built


def _timeout_of(opts) -> timedelta:
    timeout = getattr(opts, "timeout", None)
    if timeout is None or timeout.total_seconds() <= 0:
        return timedelta(minutes=30)
    return timeout


def _create_backend(dist_backend_opts, backend_options=None):
    """The creator torch calls for every group (extended API): a Backend, or, for a group that
    init_process_group/new_group make for xccl_rs alone, a whole ProcessGroup (see _whole_group)."""
    o = dist_backend_opts
    backend = _C.create_backend(
        o.store,
        o.group_rank,
        o.group_size,
        _timeout_of(o),
        str(getattr(o, "group_id", "")),
        bool(getattr(o, "enable_reconfigure", False)),  # torch >= 2.15: connect at reconfigure()
    )
    _C.set_global_ranks(backend, list(getattr(o, "global_ranks_in_group", None) or []))  # profiler records
    _check_devices_present(sys._getframe(1))
    helper = _group_served_by_us_alone(sys._getframe(1))
    return backend if helper is None else _whole_group(backend, o, helper)


def _check_devices_present(frame) -> None:
    """Raises, on every rank alike and before connecting, when the group torch's
    ``_new_process_group_helper`` (``frame``) is making gives xccl_rs a device type that torch
    sees none of here (``"cpu:gloo,cuda:xccl_rs"`` on a host without CUDA), as NCCL refuses a
    host without GPUs; otherwise such a group would be made and its first use would fail far
    from the cause."""
    if frame is None or frame.f_code.co_name != "_new_process_group_helper":
        return
    config = frame.f_locals.get("backend_config")
    if config is None:
        return
    mapping = config.get_device_backend_map()
    ours = [d for d, b in mapping.items() if b == BACKEND_NAME]
    missing = [d for d in ours if d in _DEVICE_TYPES and _device_count(d) == 0]
    if not missing:
        return
    spec = ",".join(f"{d}:{b}" for d, b in mapping.items())
    kept = ",".join(f"{d}:{b}" for d, b in mapping.items() if d not in missing)
    counts = ", ".join(f"torch.{d}.device_count() is 0" for d in missing)
    raise RuntimeError(
        f"xccl_rs: the backend string {spec!r} gives xccl_rs the {' and '.join(missing)} tensors, "
        f"but this host has no {' or '.join(missing)} device ({counts}); xccl_rs serves "
        f"{_present_devices()} here. Leave {' and '.join(repr(f'{d}:{BACKEND_NAME}') for d in missing)} "
        f"out of the string" + (f" ({kept!r})" if kept else f" (e.g. 'cpu:{BACKEND_NAME}')")
    )


def _group_served_by_us_alone(frame):
    """The frame of torch's ``_new_process_group_helper`` when it is making a group whose every
    device is xccl_rs's (``"xccl_rs"``, not ``"cpu:gloo,xpu:xccl_rs"``), else None."""
    if frame is None or frame.f_code.co_name != "_new_process_group_helper":
        return None
    config, pg = frame.f_locals.get("backend_config"), frame.f_locals.get("pg")
    if config is None or not isinstance(pg, dist.ProcessGroup):
        return None
    if set(config.get_device_backend_map().values()) != {BACKEND_NAME}:
        return None
    return frame


def _whole_group(backend, opts, helper):
    """torch names a group by its backend type, and every backend registered from outside torch
    is of type CUSTOM: DDP's logging data and ProcessGroup.name() would say "custom". torch lets
    a creator return a whole ProcessGroup instead (``_new_process_group_helper`` then uses it as
    the group); ours answers "xccl_rs". It gets what torch gives the group it made for a backend
    in that function: the backend on every device of the group, the default backend type, the
    bound device, and TORCH_DISTRIBUTED_DEBUG=DETAIL's checking wrapper."""
    from torch.distributed import distributed_c10d as c10d

    f = helper.f_locals
    torch_pg = f["pg"]
    store = f.get("prefix_store") or opts.store
    custom = dist.ProcessGroup.BackendType.CUSTOM
    if c10d.get_debug_level() == c10d.DebugLevel.DETAIL and c10d.is_gloo_available():
        backend = c10d._create_process_group_wrapper(
            wrapped_pg=backend,
            store_prefix=f.get("group_name"),
            store=opts.store,
            rank=opts.group_rank,
            world_size=opts.group_size,
            timeout=_timeout_of(opts),
        )
    pg = _C.named_process_group(store, opts.group_rank, opts.group_size)
    if torch_pg.bound_device_id is not None:  # before the backends: registering passes it on
        pg.bound_device_id = torch_pg.bound_device_id
    for device in f["backend_config"].get_device_backend_map():
        pg._register_backend(torch.device(device), custom, backend)
    pg._set_default_backend(custom)
    return pg


def register() -> None:
    """Registers the backend with torch.distributed for the device types in ``DEVICES``
    (idempotent: torch's ``register_backend`` is called once per name). Called on import, and
    by torch's backend autoload (entry point) on torch >= 2.14."""
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
    this rank to it, so a tensor on another device raises; a device torch does not see here
    raises ValueError. Accelerator tensors are staged through the host. Destroy a group with
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
    if device.type not in _DEVICE_TYPES:
        raise ValueError(f"xccl_rs.new_group: device {device} is not one of {list(_DEVICE_TYPES)}")
    if device.type == "cpu":
        return None
    count = _device_count(device.type)
    if count == 0:
        raise ValueError(
            f"xccl_rs.new_group: device {device}: this host has no {device.type} device "
            f"(torch.{device.type}.device_count() is 0); the devices here are {_present_devices()}"
        )
    if device.index is None:
        device = torch.device(device.type, getattr(torch, device.type).current_device())
    elif device.index >= count:
        raise ValueError(f"xccl_rs.new_group: device {device}: this host has {count} {device.type} device(s)")
    return device


def destroy_group(group: dist.ProcessGroup) -> None:
    """Shuts a group from :func:`new_group` down: finishes queued work, closes its connections
    and shared memory. Later operations on it raise. Safe to call twice."""
    group.shutdown()


register()

# A failure's abort hooks run on a thread of their own (torch's flight recorder writes its trace
# from one) while the error goes on to the caller. The interpreter's exit waits for them (at most
# XCCL_RS_FAILURE_HOOKS_WAIT_MS) while Python can still serve them: a hook still running when
# Python finalizes is killed mid-write, and with it, through torch's catch-all, the process.
atexit.register(_C.wait_for_failure_hooks)


from .debug import dump  # noqa: E402  (the flight recorder's entries of a group; debug.py)
from .memory import empty, zero_copy_ops, zeros  # noqa: E402  (tensors peers read in place; memory.py)
from .stats import stats  # noqa: E402  (what a group's ops cost; stats.py)
