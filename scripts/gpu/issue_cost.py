"""What issuing an async collective on device tensors costs, piece by piece, on the GPU machine.

Times 100 calls of each: a pinned host buffer of 1 MiB, its device-to-host copy launch, an
event record, a device clone, and async xccl_rs all_reduces of 1 MiB on device and on host
tensors, three times (the first pays pinned allocation). One rank:
    PYTHONPATH=$PWD/python python3 scripts/gpu/issue_cost.py
Four ranks, started together (VIA_NEW_GROUP=1: the group comes from
dist.new_group(backend="xccl_rs") beside a gloo world, as in xccl_rs.bench):
    for r in 0 1 2 3; do RANK=$r WORLD=4 PYTHONPATH=$PWD/python python3 scripts/gpu/issue_cost.py & done; wait
"""

import os
import time

import torch
import torch.distributed as dist

from ranks import cuda_group

dev, rank, world, group = cuda_group(29611, via_new_group=bool(os.environ.get("VIA_NEW_GROUP")))
tensors = [torch.ones(1 << 18, device=dev) for _ in range(100)]


def timed(label, calls):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = calls()
    dt = time.perf_counter() - t0
    for r in results:
        if hasattr(r, "wait"):
            r.wait()
    torch.cuda.synchronize()
    print(f"world {world} rank {rank} {label}: {dt * 1e3:.2f} ms", flush=True)


for _ in range(3):
    timed("pinned empty x100", lambda: [torch.empty(1 << 18, pin_memory=True) for _ in range(100)])
    hosts = [torch.empty(1 << 18, pin_memory=True) for _ in range(100)]
    timed("d2h copy x100", lambda: [h.copy_(t, non_blocking=True) for h, t in zip(hosts, tensors)])
    timed("event record x100", lambda: [torch.cuda.Event().record() for _ in range(100)])
    timed("clone x100", lambda: [t.clone() for t in tensors])
    timed("xccl_rs async all_reduce x100", lambda: [dist.all_reduce(t, group=group, async_op=True) for t in tensors])
    on_host = [t.cpu() for t in tensors]
    timed("xccl_rs async all_reduce CPU x100", lambda: [dist.all_reduce(t, group=group, async_op=True) for t in on_host])
