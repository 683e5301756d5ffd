# Type stubs of the weight-sync engine's public API (python/xccl_rs/weight_sync/__init__.py).
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Callable, Literal, Union

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES: int
MIN_BUCKET_BYTES: int

_Device = Union[str, torch.device, None]
_NamedTensors = Union[Iterable[tuple[str, torch.Tensor]], Mapping[str, torch.Tensor]]

class WeightSyncError(RuntimeError): ...

class SyncStats:
    bytes: int
    tensors: int
    buckets: int
    seconds: float
    shared_window: bool
    payload: str
    tensor_bytes: int
    elements: int
    changed: int
    full_ranges: int
    def __init__(
        self,
        bytes: int = 0,
        tensors: int = 0,
        buckets: int = 0,
        seconds: float = 0.0,
        shared_window: bool = False,
        payload: str = "full",
        tensor_bytes: int = 0,
        elements: int = 0,
        changed: int = 0,
        full_ranges: int = 0,
    ) -> None: ...
    @property
    def gbps(self) -> float: ...

def plan_buckets(named_tensors: _NamedTensors, bucket_bytes: int, senders: int = 1) -> list[list[list[object]]]: ...

class SendStream:
    def add(self, name: str, t: torch.Tensor) -> None: ...
    def finish(self) -> SyncStats: ...
    def abort(self, reason: str = "the sender gave up") -> None: ...

class WeightSender:
    group: dist.ProcessGroup
    src: int
    senders: list[int]
    receivers: list[int]
    bucket_bytes: int
    device: torch.device
    shared_memory: bool
    payload: str
    last_stats: SyncStats | None
    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int = 0,
        bucket_bytes: int = ...,
        device: _Device = None,
        shared_memory: bool | None = None,
        senders: Sequence[int] | None = None,
        payload: Literal["full", "delta", "fp8"] = "full",
        fp8_scale: Literal["block", "channel", "tensor"] = "block",
        fp8_select: Callable[[str, torch.Tensor], bool] | None = None,
        delta_base: Literal["copy", "cpu"] = "copy",
    ) -> None: ...
    @property
    def delta_base_bytes(self) -> int: ...
    def release(self) -> None: ...
    def send(self, named_tensors: _NamedTensors, progress: bool = False) -> SyncStats: ...
    def stream(self, progress: bool = False, total_bytes: int | None = None) -> SendStream: ...

class WeightReceiver:
    group: dist.ProcessGroup
    src: int
    senders: list[int]
    bucket_bytes: int | None
    bucket_device: torch.device
    device: torch.device
    last_stats: SyncStats | None
    def __init__(
        self,
        group: dist.ProcessGroup,
        src: int = 0,
        bucket_bytes: int | None = None,
        device: _Device = None,
        bucket_device: _Device = None,
        senders: Sequence[int] | None = None,
    ) -> None: ...
    @property
    def versions(self) -> dict[str, int]: ...
    def forget(self) -> None: ...
    def release(self) -> None: ...
    def receive(self, progress: bool = False, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]: ...
