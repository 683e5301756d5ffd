# Type stubs of xccl_rs's public API (python/xccl_rs/__init__.py).
from datetime import timedelta

import torch
import torch.distributed as dist

__version__: str
BACKEND_NAME: str
DEVICES: list[str]
REBUILD: str
torch_version_built: str

def register() -> None: ...
def new_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: timedelta = ...,
    device: str | torch.device | None = None,
    name: str = "xccl_rs_private",
) -> dist.ProcessGroup: ...
def destroy_group(group: dist.ProcessGroup) -> None: ...
def dump(group: dist.ProcessGroup | None = None) -> list[dict]: ...
def empty(*size: int | tuple[int, ...], dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None) -> torch.Tensor: ...
def zeros(*size: int | tuple[int, ...], dtype: torch.dtype | None = None, group: dist.ProcessGroup | None = None) -> torch.Tensor: ...
def zero_copy_ops(group: dist.ProcessGroup | None = None) -> int: ...
def stats(group: dist.ProcessGroup | None = None, device: str = "cpu") -> dict: ...
