"""What the measuring scripts in scripts/gpu share: this process's place in a group of ranks
started by hand (RANK, WORLD and PORT from the environment) and an xccl_rs group, with every
rank on cuda:0; the time of a collective called back to back."""

import os
import time

import torch
import torch.distributed as dist

import xccl_rs


def cuda_group(default_port: int, via_new_group: bool = True):
    """(device, rank, world size, group). via_new_group: the group comes from
    dist.new_group(backend="xccl_rs") beside a gloo world, as xccl_rs.bench makes it (the gloo
    world is then the default group, for barriers); else from xccl_rs.new_group on the store."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD", "1"))
    store = dist.TCPStore("127.0.0.1", int(os.environ.get("PORT", str(default_port))), world, rank == 0)
    if via_new_group:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        return dev, rank, world, dist.new_group(backend="xccl_rs")
    return dev, rank, world, xccl_rs.new_group(store, rank, world)


def seconds_per_call(call, n: int) -> float:
    """The mean time of ``n`` calls of ``call()`` in a row, from a barrier of every rank to the
    device's last work."""
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n
