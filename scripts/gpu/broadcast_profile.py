"""A timeline of the 1 GiB float32 broadcast of CUDA tensors at 2 ranks on one GPU (issue 44's
staged broadcast against its PCIe floor): every rank profiles 3 broadcasts after 3 warm-up ones,
writes its trace to $OUT/broadcast_trace_<rank>.json and prints, from its own trace:
  - its device copies: how many, their bytes, their busy time and rate, and the time between
    the first copy's start and the last one's end;
  - the idle gaps between consecutive copies (sum, and the largest);
  - the busy time of each `xccl_rs:` range on the host.
    for r in 0 1; do RANK=$r WORLD=2 PYTHONPATH=$PWD/python python3 scripts/gpu/broadcast_profile.py & done; wait
"""

import json
import os

import torch
import torch.distributed as dist

from ranks import cuda_group, seconds_per_call

ITERATIONS = 3
dev, rank, world, group = cuda_group(29614)
t = torch.ones(256 << 20, dtype=torch.float32, device=dev)


def iterations(n):
    return seconds_per_call(lambda: dist.broadcast(t, src=0, group=group), n)


def summary(trace_path):
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    lines = []
    if copies:
        busy = sum(e["dur"] for e in copies)
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
        span = copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(copies, copies[1:])]
        kinds = sorted({e["name"] for e in copies})
        lines.append(f"copies {len(copies)} ({', '.join(kinds)}), {nbytes / 2**20:.0f} MiB, busy {busy / 1e3:.2f} ms "
                     f"({nbytes / max(busy, 1) / 1e3:.1f} GB/s while busy), span {span / 1e3:.2f} ms")
        lines.append(f"gaps between copies: {sum(g for g in gaps if g > 0) / 1e3:.2f} ms in all, largest {max(gaps, default=0) / 1e3:.3f} ms")
    ranges = {}
    for e in events:
        if e["name"].startswith("xccl_rs:") and e.get("cat") in ("user_annotation", "cpu_op"):
            ranges.setdefault(e["name"], []).append(e["dur"])
    for name, durs in sorted(ranges.items()):
        lines.append(f"{name}: {len(durs)} ranges, {sum(durs) / 1e3:.2f} ms in all")
    return lines


print(f"rank {rank} warm-up: {iterations(ITERATIONS) * 1e3:.2f} ms per broadcast", flush=True)
print(f"rank {rank} plain: {iterations(5) * 1e3:.2f} ms per broadcast", flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
    per = iterations(ITERATIONS)
path = os.path.join(os.environ.get("OUT", "/tmp"), f"broadcast_trace_{rank}.json")
prof.export_chrome_trace(path)
print(f"rank {rank} profiled: {per * 1e3:.2f} ms per broadcast", flush=True)
for line in summary(path):
    print(f"rank {rank} ({ITERATIONS} broadcasts) {line}", flush=True)
dist.destroy_process_group()
