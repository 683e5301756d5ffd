# Type stubs of the verl checkpoint engine (python/xccl_rs/verl_engine.py). The engine class
# exists only when verl is installed (it subclasses verl's CheckpointEngine); else it is None.
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .door import SyncGroup, SyncOptions

def make_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    device: str | torch.device | None = None,
    name: str = "xccl_rs_weight_sync",
    backend: str = "xccl_rs",
) -> dist.ProcessGroup: ...
def destroy_group(group: dist.ProcessGroup | None) -> None: ...

class _Engine:
    bucket_size: int
    is_master: bool
    group_name: str
    rebuild_group: bool
    device: str | None
    bucket_device: str
    timeout: timedelta
    senders: str
    n_senders: int
    options: SyncOptions
    sync: SyncGroup
    @property
    def group(self) -> dist.ProcessGroup | None: ...
    @property
    def group_key(self) -> tuple[str, int, int, int] | None: ...
    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        group_name: str = "xccl_rs_weight_sync",
        rebuild_group: bool = False,
        device: str | None = None,
        bucket_device: str = "cpu",
        timeout_s: float = 600.0,
        master_addr: str | None = None,
        master_port: int = 0,
        progress: bool = False,
        senders: str = "rank0",
        payload: str = "full",
        fp8_scale: str = "block",
        fp8_select: str | None = None,
        delta_base: str = "copy",
        shared_memory: bool | None = None,
        **unused: Any,
    ) -> None: ...
    def prepare(self) -> dict[str, Any]: ...
    @classmethod
    def build_topology(
        cls, actor_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]: ...
    def init_process_group(
        self, rank: int, world_size: int, master_metadata: dict[str, Any], generation: int, senders: int = 1
    ) -> None: ...
    def finalize(self) -> None: ...
    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict[str, float]: ...
    def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]: ...

XcclRsCheckpointEngine: type[_Engine] | None
