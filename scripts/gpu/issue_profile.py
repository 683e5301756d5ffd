"""Where the caller's time goes when issuing async collectives on device tensors, with every
rank in step (the case of the "100 async all_reduces return in < 10 ms" target).

Each rank issues 100 async all_reduces of 1 MiB on CUDA tensors, several rounds; it prints the
distribution of one call's time (median, 90th percentile, max, total). Rank 0 then runs one
more round under torch.profiler and prints, per thread, the device-runtime calls (count, total,
max): the caller's thread and the progress thread are told apart by their thread ids.
    for r in 0 1 2 3; do RANK=$r WORLD=4 PYTHONPATH=$PWD/python python3 scripts/gpu/issue_profile.py & done; wait
PROFILE_ROUND=0 profiles the first round instead (the trace goes to $OUT/issue_trace.json);
WARM_FIRST=1 makes one small device all_reduce first, so that round 0 shows what the first
use of the backend on the device costs, apart from the sizes seen first.
"""

import collections
import os
import threading
import time

import torch
import torch.distributed as dist

from ranks import cuda_group

dev, rank, world, group = cuda_group(29612)
tensors = [torch.ones(1 << 18, device=dev) for _ in range(100)]


def one_round():
    torch.cuda.synchronize()
    dist.barrier()
    times, works = [], []
    t0 = time.perf_counter()
    for t in tensors:
        a = time.perf_counter()
        works.append(dist.all_reduce(t, group=group, async_op=True))
        times.append(time.perf_counter() - a)
    total = time.perf_counter() - t0
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    return total, sorted(times)


if os.environ.get("WARM_FIRST"):
    a = time.perf_counter()
    dist.all_reduce(torch.ones(1, device=dev), group=group, async_op=True).wait()
    print(f"rank {rank} first call (1 element, waited): {(time.perf_counter() - a) * 1e3:.2f} ms", flush=True)

profile_round = int(os.environ.get("PROFILE_ROUND", "4"))
profile = rank == 0
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
prof = None
for i in range(4):
    if i == profile_round and profile:
        prof = torch.profiler.profile(activities=activities)
        prof.__enter__()
    total, times = one_round()
    if i == profile_round and profile:
        prof.__exit__(None, None, None)
    print(f"rank {rank} round {i}: total {total * 1e3:.2f} ms; one call: median {times[50] * 1e6:.0f} us, "
          f"p90 {times[90] * 1e6:.0f} us, max {times[-1] * 1e6:.0f} us; first 5 "
          f"{[round(t * 1e6) for t in times[:5]]}", flush=True)

if profile_round == 4:
    if profile:
        with torch.profiler.profile(activities=activities) as prof:
            total, times = one_round()
    else:
        total, times = one_round()
    print(f"rank {rank} profiled round: total {total * 1e3:.2f} ms", flush=True)
if prof is not None:
    main_tid = threading.get_native_id()
    by_thread = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0, 0.0]))
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        s = by_thread[e.thread][e.name]
        s[0] += 1
        s[1] += e.cpu_time_total
        s[2] = max(s[2], e.cpu_time_total)
    print(f"main thread id {main_tid}", flush=True)
    for tid, names in by_thread.items():
        busy = sorted(names.items(), key=lambda kv: -kv[1][1])[:14]
        print(f"thread {tid}{' (caller)' if tid == main_tid else ''}:")
        for name, (n, tot, mx) in busy:
            print(f"   {name[:60]:<60} x{n:<5} total {tot / 1e3:8.2f} ms  max {mx:8.0f} us")
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), "issue_trace.json"))
dist.destroy_process_group()
