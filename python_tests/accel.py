"""Device-generic helpers of the accelerator tests: the same rank functions (test_gpu.py) run
on CUDA (the GPU machine) and on the emulated XPU (test_xpu.py, python_tests/xpu_emu).
Imported inside rank functions (after torch)."""

from __future__ import annotations


def use(device_type: str):
    """Makes device 0 of ``device_type`` current; returns it."""
    import torch

    getattr(torch, device_type).set_device(0)
    return torch.device(device_type, 0)


def sleep(device_type: str, ms: float) -> None:
    """Holds the current stream for about ``ms`` milliseconds of device time."""
    import torch

    if device_type == "cuda":
        torch.cuda._sleep(int(ms * 2_000_000))  # cycles, ~2 GHz
    elif device_type == "xpu":
        import xpu_emu

        xpu_emu.load().sleep_ms(ms)
    else:
        raise ValueError(f"no sleep kernel for {device_type}")


def synchronize(device_type: str) -> None:
    import torch

    getattr(torch, device_type).synchronize()


def current_stream(device_type: str):
    import torch

    return getattr(torch, device_type).current_stream()


def side_stream(device_type: str):
    """A new stream of device 0, and a context manager that makes it current."""
    import torch

    if device_type == "cuda":
        s = torch.cuda.Stream()
        return s, torch.cuda.stream(s)
    s = torch.Stream(device=torch.device(device_type, 0))
    return s, getattr(torch, device_type).stream(s)
