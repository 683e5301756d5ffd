"""A timeline of the 64 MiB bfloat16 all_reduce on CUDA tensors at 4 ranks (the "5x gloo"
target): rank 0 profiles 3 iterations after 5 warm-up ones and writes the trace (device copies
per stream, the progress thread's runtime calls) to $OUT/allreduce_trace.json; every rank
prints its mean time per iteration.
    for r in 0 1 2 3; do RANK=$r WORLD=4 PYTHONPATH=$PWD/python python3 scripts/gpu/allreduce_profile.py & done; wait
"""

import os

import torch
import torch.distributed as dist

from ranks import cuda_group, seconds_per_call

dev, rank, world, group = cuda_group(29613)
t = torch.ones(32 << 20, dtype=torch.bfloat16, device=dev)


def iterations(n):
    return seconds_per_call(lambda: dist.all_reduce(t, group=group), n)


print(f"rank {rank} warm-up: {iterations(5) * 1e3:.2f} ms per all_reduce", flush=True)
print(f"rank {rank} plain: {iterations(10) * 1e3:.2f} ms per all_reduce", flush=True)
if rank == 0:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        per = iterations(3)
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), "allreduce_trace.json"))
else:
    per = iterations(3)
print(f"rank {rank} profiled: {per * 1e3:.2f} ms per all_reduce", flush=True)
dist.destroy_process_group()
