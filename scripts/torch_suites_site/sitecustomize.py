"""Makes xccl_rs the CPU backend of torch's own test files, for scripts/torch_suites.py.

Python imports ``sitecustomize`` at start-up from the first directory on PYTHONPATH that has
one; the runner puts this directory first, so every process of a run loads it: the pytest
process and the ranks torch's harnesses spawn. With ``XCCL_RS_TORCH_SUITES_BACKEND=xccl_rs`` it

- turns every group the tests make with gloo into an xccl_rs group: ``init_process_group`` and
  ``new_group`` get ``"xccl_rs"`` for ``"gloo"``, and ``"cpu:xccl_rs"`` for a ``"cpu:gloo"`` pair
  of a device-mapped string, so torch sees the name xccl_rs everywhere (``dist.get_backend()``,
  ``BackendConfig``), as a user's code would;
- gives ``init_process_group()`` without a backend xccl_rs where torch would have picked gloo (a
  host without accelerator; ``new_group()`` without one takes the default group's);
- appends one line to ``$XCCL_RS_TORCH_SUITES_LOG`` for each xccl_rs backend torch creates, so
  the runner can tell a run that used xccl_rs from one that silently did not.

Swapping the string where the group is made, not in torch's harnesses and not in
``Backend.default_device_backend_map``, keeps the harnesses' own choices as they are for gloo:
they ask ``dist.get_default_backend_for_device("cpu")`` for their backend, and treat any backend
whose name contains "xccl" as an accelerator backend (``DTensorTestBase.init_pg`` and
``DistributedTestBase.create_pg`` skip every test on a host without enough accelerators). With
any other value, or none, this file does nothing.
"""

import os


def _install() -> None:
    import functools
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import xccl_rs

    def swap(backend):
        text = str(backend)
        if text.lower() == "gloo":
            return xccl_rs.BACKEND_NAME
        if ":" in text:
            pairs = [p.split(":", 1) for p in text.split(",")]
            return ",".join(
                f"{d}:{xccl_rs.BACKEND_NAME if d.strip().lower() == 'cpu' and b.strip().lower() == 'gloo' else b}"
                for d, b in pairs
            )
        return backend

    def cpu_default():
        """What init_process_group() without a backend gets: xccl_rs where torch picks gloo."""
        if torch.accelerator.current_accelerator(check_available=True) is None:
            return xccl_rs.BACKEND_NAME
        return None

    def wrap(fn, default):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs)
            backend = bound.arguments.get("backend")
            bound.arguments["backend"] = default() if backend is None else swap(backend)
            return fn(*bound.args, **bound.kwargs)

        return wrapper

    wrapped = wrap(c10d.init_process_group, cpu_default)
    c10d.init_process_group = dist.init_process_group = wrapped
    wrapped = wrap(c10d.new_group, lambda: None)  # None: the default group's backend
    c10d.new_group = dist.new_group = wrapped

    log = os.environ.get("XCCL_RS_TORCH_SUITES_LOG")
    if log:
        # Counted below torch's creator, not by wrapping it: xccl_rs's creator reads the frame of
        # torch's _new_process_group_helper that called it.
        xccl_rs._C = _CountingModule(xccl_rs._C, log)


class _CountingModule:
    """Stands for xccl_rs's native module; appends a line to ``log`` for every backend made."""

    def __init__(self, module, log: str):
        self._module = module
        self._log = log

    def __getattr__(self, name):
        return getattr(self._module, name)

    def create_backend(self, *args, **kwargs):
        backend = self._module.create_backend(*args, **kwargs)
        with open(self._log, "a") as f:
            f.write(f"{os.getpid()} created an xccl_rs backend\n")
        return backend


if os.environ.get("XCCL_RS_TORCH_SUITES_BACKEND") == "xccl_rs":
    try:
        _install()
    except BaseException:  # noqa: BLE001  (Python would print it and run the tests with gloo)
        import sys
        import traceback

        traceback.print_exc()
        sys.stderr.write("torch_suites: could not make xccl_rs the CPU backend (above); stopping\n")
        sys.stderr.flush()
        os._exit(3)
