"""Host memory that a device copies to and from at the link's speed: page-locking memory that is
already mapped (a weight-sync window in /dev/shm) with the device runtime, and the fence that
non-blocking copies through it need.

A copy between a device and ordinary (pageable) host memory goes through the runtime's own
pinned staging buffer, a piece at a time, at a fraction of the link's speed; a copy to or from
page-locked memory is one DMA, and may be queued without waiting (``non_blocking=True``).
Memory that torch allocates pinned (``pin_memory=True``) is page-locked already; memory mapped by
someone else is not, and the CUDA runtime can lock it where it is (``cudaHostRegister``), which
is what :func:`register_host` does. Registering costs about as much as touching every page once,
so callers register memory they keep (the weight-sync windows, kept between syncs), once.

Where the runtime has no such call -- XPU's in torch today, and no device at all -- nothing is
registered (``Registration.pinned`` is False) and callers keep their copies blocking: correct,
at the speed of pageable memory.

A registration must end before its memory is unmapped (a mapping that goes while registered
leaves its pages locked in the driver, and the address range unusable for a later registration):
a :class:`Registration` holds a reference to the tensor, so the memory stays mapped at least until
it is unregistered, by :meth:`Registration.unregister` or when the registration is collected.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from typing import Optional

import torch

# cudaHostRegisterPortable: page-locked for every CUDA context of the process, not only the
# current device's (a rollout whose tensors live on another device than the current one).
_CUDA_PORTABLE = 1

_warned = False


def can_register(device) -> bool:
    """Whether host memory can be page-locked for ``device`` (a torch.device or its string)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available()


class Registration:
    """``tensor``'s memory (a contiguous CPU tensor) page-locked for ``device``'s runtime, when it
    has a way to (:func:`can_register`), until :meth:`unregister`. ``pinned``: copies between
    the memory and the device are DMA, and may be non-blocking (behind a :class:`CopyFence`)."""

    def __init__(self, tensor: torch.Tensor, device):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"register_host: expected a contiguous CPU tensor, got {tensor.device} "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'}")
        self.device = torch.device(device)
        self.tensor: Optional[torch.Tensor] = tensor  # keeps the memory mapped while registered
        self.pinned = False
        self._owned = False  # this registration page-locked it (and unregisters it)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or not can_register(self.device):
            return
        if tensor.is_pinned():  # torch's pinned memory, or registered already: not ours to end
            self.pinned = True
            return
        err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _CUDA_PORTABLE))
        if err == 0:
            self.pinned = self._owned = True
        else:
            _clear_cuda_error()
            _warn_once(f"xccl_rs: could not page-lock {nbytes} bytes of host memory for {self.device} "
                       f"(cudaHostRegister: {_cuda_error_name(err)}); copies through it stay blocking")

    def unregister(self) -> None:
        """Ends the registration (the memory stays mapped while other references to it live).
        Every non-blocking copy through the memory must have completed (:meth:`CopyFence.wait`)."""
        if self._owned:
            self._owned = False
            err = int(torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr()))
            if err != 0:
                _clear_cuda_error()
        self.pinned = False
        self.tensor = None

    def __del__(self):
        try:
            self.unregister()
        except Exception:  # noqa: BLE001 - at interpreter exit the runtime may be gone already
            pass


def register_host(tensor: torch.Tensor, device) -> Registration:
    """Page-locks ``tensor``'s memory for copies to and from ``device`` (see :class:`Registration`;
    nothing is registered on devices whose runtime cannot, and ``pinned`` is then False)."""
    return Registration(tensor, device)


class CopyFence:
    """The non-blocking copies issued between pinned host memory and a device, so that the host
    memory is read or reused only once they are done: :meth:`note` right after issuing one (it
    remembers the device's current stream), :meth:`wait` before the memory changes hands (it
    waits for every stream noted since the last wait)."""

    def __init__(self):
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def note(self, device: torch.device) -> None:
        stream = torch.cuda.current_stream(device)
        self._streams.setdefault((stream.device_index, stream.stream_id), stream)

    def wait(self) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.synchronize()


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _cuda_error_name(err: int) -> str:
    try:
        return f"{torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaError(err))} ({err})"
    except Exception:  # noqa: BLE001 - an error code the bindings do not know
        return str(err)


def _clear_cuda_error() -> None:
    """Resets the runtime's last error that a failed registration left (torch checks it after
    every kernel launch, and would raise it there). torch's bindings have no cudaGetLastError, so
    the runtime library torch loaded is asked directly; where it is linked in statically, there
    is nothing to reach (and torch's own later checks are the runtime's)."""
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
        except OSError:
            continue
        lib.cudaGetLastError()
        return
