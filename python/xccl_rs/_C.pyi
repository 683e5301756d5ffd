# Type stubs of the compiled module (csrc/module.cc).
from datetime import timedelta

import torch
import torch.distributed as dist

torch_version_built: str

def create_backend(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    group_id: str = "",
    enable_reconfigure: bool = False,
) -> dist.Backend: ...
def new_process_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    name: str,
    device: torch.device | None = None,
) -> dist.ProcessGroup: ...
def host_identity() -> str: ...
def named_process_group(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup: ...
def zero_copy_ops(backend: dist.Backend) -> int: ...
def set_global_ranks(backend: dist.Backend, ranks: list[int]) -> None: ...
def stats(backend: dist.Backend) -> list[dict]: ...
def wait_for_failure_hooks() -> bool: ...
