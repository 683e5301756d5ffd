"""A timeline of the CUDA weight sync of the demo (issue 44's device sync against its PCIe floor):
rank 0 sends the demo's Qwen2.5-0.5B-shaped bf16 weights with WeightSender, ranks 1 and 2 load
them into engine tensors with WeightReceiver, every rank on cuda:0 with buckets on the device,
as `python -m xccl_rs.demo --device cuda` does. Each round builds its own group and destroys it
after the sync, as the demo does (GROUP=one keeps one group for every round instead).

Rounds 1-3 warm up and are timed; round 4 is profiled. Every rank writes its trace to
$OUT/weight_sync_trace_<rank>.json and prints, from its own trace:
  - the sync's wall time on this rank and where its first and last device copy fall in it;
  - its device copies by kind (count, MiB, busy time, rate while busy);
  - the idle gaps between its consecutive copies off the device or onto it;
  - the busy time of each `xccl_rs:` range on the host.
    for r in 0 1 2; do RANK=$r WORLD=3 PYTHONPATH=$PWD/python python3 scripts/gpu/weight_sync_profile.py & done; wait
"""

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import xccl_rs
from xccl_rs.demo import initial_weights, train_step
from xccl_rs.weight_sync import WeightReceiver, WeightSender
from xccl_rs.weight_sync._common import synchronize

ROUNDS, PROFILED = 4, 3
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD", "3"))
one_group = os.environ.get("GROUP", "each") == "one"
dev = torch.device(os.environ.get("DEVICE", "cuda:0"))  # DEVICE=cpu: a smoke test without a GPU
if dev.type == "cuda":
    torch.cuda.set_device(dev)
store = dist.TCPStore("127.0.0.1", int(os.environ.get("PORT", "29615")), world, rank == 0,
                      timeout=timedelta(seconds=120))
weights = initial_weights(24, torch.bfloat16, dev)
engine = {n: torch.zeros_like(t) for n, t in weights.items()} if rank > 0 else None


def group_of(round_):
    return xccl_rs.new_group(dist.PrefixStore(f"r{0 if one_group else round_}/", store), rank, world)


def sync(pg):
    """The sync's wall time on this rank, from a barrier to its device's last work."""
    pg.barrier().wait()
    synchronize(dev)
    t0 = time.perf_counter()
    if rank == 0:
        WeightSender(pg, src=0, device=dev).send(weights)
    else:
        for name, t in WeightReceiver(pg, src=0, device=dev, bucket_device=dev).receive(copy=False):
            engine[name].copy_(t)
    synchronize(dev)
    return t0, time.perf_counter() - t0


def summary(trace_path, sync_seconds):
    events = [e for e in json.load(open(trace_path))["traceEvents"] if e.get("ph") == "X"]
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    marks = [e for e in events if e["name"] == "weight_sync_profile:sync"]
    lines = [f"sync {sync_seconds * 1e3:.1f} ms"]
    if marks and copies:
        start = marks[0]["ts"]
        first, last = copies[0]["ts"] - start, copies[-1]["ts"] + copies[-1]["dur"] - start
        lines.append(f"first device copy at {first / 1e3:.1f} ms, last one ends at {last / 1e3:.1f} ms")
    for kind in sorted({e["name"] for e in copies}):
        these = [e for e in copies if e["name"] == kind]
        busy = sum(e["dur"] for e in these)
        nbytes = sum(int(e.get("args", {}).get("bytes", 0)) for e in these)
        span = these[-1]["ts"] + these[-1]["dur"] - these[0]["ts"]
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(these, these[1:])]
        lines.append(f"{kind}: {len(these)} copies, {nbytes / 2**20:.0f} MiB, busy {busy / 1e3:.2f} ms "
                     f"({nbytes / max(busy, 1) / 1e3:.1f} GB/s while busy), span {span / 1e3:.2f} ms, "
                     f"gaps {sum(g for g in gaps if g > 0) / 1e3:.2f} ms (largest {max(gaps, default=0) / 1e3:.2f} ms)")
    ranges = {}
    for e in events:
        if e["name"].startswith("xccl_rs:") and e.get("cat") in ("user_annotation", "cpu_op"):
            ranges.setdefault(e["name"], []).append(e["dur"])
    for name, durs in sorted(ranges.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"{name}: {len(durs)} ranges, {sum(durs) / 1e3:.2f} ms in all")
    return lines


pg = None
for round_ in range(ROUNDS):
    train_step(weights, round_)
    if pg is None or not one_group:
        made = time.perf_counter()
        pg = group_of(round_)
        made = time.perf_counter() - made
    if round_ == PROFILED:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("weight_sync_profile:sync"):
                _, seconds = sync(pg)
        path = os.path.join(os.environ.get("OUT", "/tmp"), f"weight_sync_trace_{rank}.json")
        prof.export_chrome_trace(path)
        for line in summary(path, seconds):
            print(f"rank {rank} profiled: {line}", flush=True)
    else:
        _, seconds = sync(pg)
        print(f"rank {rank} round {round_}: sync {seconds * 1e3:.1f} ms (group made in {made * 1e3:.1f} ms)", flush=True)
    if not one_group:
        pg.barrier().wait()
        xccl_rs.destroy_group(pg)
        pg = None
if pg is not None:
    xccl_rs.destroy_group(pg)
