"""An emulated ``xpu`` device for the tests, on a torch built without XPU (CPU-only or CUDA).

``activate()`` builds (once, cached) and loads the C++ extension in this directory and makes
``torch.xpu`` answer as if one Intel GPU were there; call it in each rank process before the
first XPU tensor (``run_ranks(..., setup=xpu_emu.ACTIVATE)``). What it provides and its
limits: docs/testing.md.

The build directory: ``$XCCL_RS_CACHE/xpu_emu`` (default ``~/.cache/xccl_rs/xpu_emu``),
outside the clone, keyed by torch's version (torch.utils.cpp_extension rebuilds when a
source changes and locks the directory, so that ranks starting together build it once).
"""

from __future__ import annotations

import contextlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = ["runtime.cc", "memory.cc", "kernels.cc", "c10d_ops.cc", "module.cc"]
_EXT = None

# For harness.run_ranks(setup=...): a (module, function) reference a spawned rank resolves.
ACTIVATE = (__name__, "activate")


def build_dir() -> str:
    import torch

    root = os.environ.get("XCCL_RS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "xccl_rs")
    d = os.path.join(root, "xpu_emu", "torch-" + torch.__version__.replace("+", "_"))
    os.makedirs(d, exist_ok=True)
    return d


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here (None if it can)."""
    import torch

    if hasattr(torch, "xpu") and torch.xpu.is_available() and _EXT is None:
        return "this torch has a real XPU; the emulator is for torch builds without one"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "the emulated XPU needs ninja to build (pip install ninja)"
    return None


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the pip package's binary is not on it when the venv
    is not activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def _unity_source(directory: str) -> str:
    """One translation unit that includes every source: each includes torch's headers, whose
    parsing is most of the build, so compiled together they are parsed once (ninja's depfile
    still rebuilds it when any included source changes)."""
    path = os.path.join(directory, "xpu_emu_unity.cc")
    text = "".join(f'#include "{os.path.join(_HERE, s)}"\n' for s in _SOURCES)
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except OSError:
        pass
    with open(path + ".tmp", "w") as f:  # ranks may start together: replace atomically
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def load():
    """Builds (if needed) and loads the extension; returns its module."""
    global _EXT
    if _EXT is None:
        from torch.utils.cpp_extension import load as cpp_load

        _ninja_on_path()
        _EXT = cpp_load(
            name="xccl_rs_xpu_emu",
            sources=[_unity_source(build_dir())],
            extra_cflags=["-O2", "-std=c++20"],
            build_directory=build_dir(),
            verbose=bool(os.environ.get("XCCL_RS_XPU_EMU_VERBOSE")),
        )
    return _EXT


def activate():
    """Loads the emulator and points torch.xpu's runtime queries at it (test-only patches:
    torch's own XPU runtime bindings do not exist in a build without XPU)."""
    import torch

    ext = load()
    xpu = torch.xpu
    xpu._initialized = True  # else torch.xpu._lazy_init raises "not compiled with XPU"
    xpu.is_available = lambda: True
    xpu.device_count = ext.device_count
    xpu.current_device = ext.current_device

    def _index(device=None) -> int:
        if device is None:
            return -1
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return -1 if device.index is None else device.index

    xpu.set_device = lambda device: ext.set_device(_index(device) if _index(device) >= 0 else 0)
    xpu.synchronize = lambda device=None: ext.synchronize(_index(device))
    xpu.current_stream = lambda device=None: ext.current_stream(_index(device))
    xpu.stream = stream
    # torch's Python asks torch.accelerator which device type the build supports (e.g.
    # init_process_group(device_id=...)); an XPU build answers xpu. (c10's at::getAccelerator
    # still answers the build's own accelerator: docs/testing.md.)
    acc = torch.accelerator
    acc.current_accelerator = lambda check_available=False: torch.device("xpu", ext.current_device())
    acc.device_count = ext.device_count
    acc.is_available = lambda: True
    acc.current_device_index = ext.current_device
    return ext


@contextlib.contextmanager
def stream(s):
    """Makes the XPU ``torch.Stream`` ``s`` current inside the block (torch.xpu.stream)."""
    ext = load()
    old = ext.exchange_stream(s.stream_id, s.device_index)
    try:
        yield s
    finally:
        ext.exchange_stream(old, s.device_index)
