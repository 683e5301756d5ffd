"""The main demo: ``python -m xccl_rs.demo``.

Starts 4 local processes and, on gloo and on xccl_rs side by side, runs an AVG all_reduce (the
op users monkeypatch today on oneCCL) and a broadcast, checks every result against the value
computed here, and prints timings with the ratio to gloo.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn, iters: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _worker(rank: int, world: int, port: int, numel: int, iters: int, queue) -> None:
    import xccl_rs  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    groups = {"gloo": dist.group.WORLD, "xccl_rs": dist.new_group(backend="xccl_rs")}
    results = {}
    for name, group in groups.items():
        t = torch.full((numel,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        expected = sum(range(1, world + 1)) / world
        assert torch.allclose(t, torch.full_like(t, expected)), f"{name}: wrong AVG result"
        b = torch.arange(numel, dtype=torch.float32) if rank == 0 else torch.zeros(numel)
        dist.broadcast(b, src=0, group=group)
        assert torch.equal(b, torch.arange(numel, dtype=torch.float32)), f"{name}: wrong broadcast"
        small = torch.ones(2)
        results[name] = {
            "avg_all_reduce": _time(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group), iters),
            "broadcast": _time(lambda: dist.broadcast(b, src=0, group=group), iters),
            "all_reduce_8B": _time(lambda: dist.all_reduce(small, group=group), iters * 5),
            "avg_value": t[0].item(),
        }
    dist.barrier()
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--mib", type=float, default=16.0, help="tensor size in MiB (float32)")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    numel = int(args.mib * (1 << 20)) // 4
    print(f"xccl_rs demo: {args.world_size} local processes, float32 tensors of {args.mib} MiB, torch {torch.__version__}")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.world_size, _free_port(), numel, args.iters, queue), nprocs=args.world_size, start_method="spawn")
    r = queue.get()
    print(f"AVG all_reduce result on every rank: {r['xccl_rs']['avg_value']} (expected {sum(range(1, args.world_size + 1)) / args.world_size})")
    print(f"{'operation':<22}{'gloo':>12}{'xccl_rs':>12}{'speed-up':>10}")
    for op in ("avg_all_reduce", "broadcast", "all_reduce_8B"):
        g, x = r["gloo"][op], r["xccl_rs"][op]
        unit, scale = ("us", 1e6) if op.endswith("8B") else ("ms", 1e3)
        print(f"{op:<22}{g * scale:>9.2f} {unit}{x * scale:>9.2f} {unit}{g / x:>9.2f}x")
    print("all results verified")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
