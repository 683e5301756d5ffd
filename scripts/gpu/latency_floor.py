"""Where the time of an 8-byte all_reduce goes, layer by layer (issue 13, part 3).

    python3 scripts/gpu/latency_floor.py --ranks 8 [--iters 20000]

Every rank times, per call (best of 5 rounds, the slowest rank's):
- `dist.all_reduce(t)`: what users call (torch's Python layer, then the ProcessGroup);
- `pg.allreduce([t], opts).wait()`: torch's ProcessGroup through its dispatcher op
  (`c10d::allreduce_`, with torch's pre/post collective hooks), without the Python layer;
- `backend.allreduce([t], opts).wait()`: the xccl_rs backend object alone (pybind call, our C++,
  the Rust core, the shared-memory synchronization);
and, in one more process, `dist.all_reduce` on torch's `fake` backend, which communicates
nothing: torch's own floor, which every backend pays through `dist.all_reduce`.
Runs on CPU tensors; hide any GPU (`CUDA_VISIBLE_DEVICES=`).
"""

from __future__ import annotations

import argparse
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _best(f, iters: int) -> float:
    for _ in range(min(iters, 2000)):
        f()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            f()
        best = min(best, (time.perf_counter_ns() - t0) / iters / 1e3)
    return best


def _rank(rank, world, port, iters, q):
    import xccl_rs  # noqa: F401

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world)
    t = torch.ones(2)
    pg = dist.group.WORLD
    backend = pg._get_backend(torch.device("cpu"))
    opts = dist.AllreduceOptions()
    opts.asyncOp = False  # as dist.all_reduce(async_op=False) passes it
    out = {}
    for name, f in [
        ("dist.all_reduce", lambda: dist.all_reduce(t)),
        ("ProcessGroup.allreduce", lambda: pg.allreduce([t], opts).wait()),
        ("Backend.allreduce", lambda: backend.allreduce([t], opts).wait()),
    ]:
        dist.barrier()
        mine = torch.tensor([_best(f, iters)], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        out[name] = mine.item()
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def _fake_floor(iters: int) -> float:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    t = torch.ones(2)
    floor = _best(lambda: dist.all_reduce(t), iters)
    dist.destroy_process_group()
    return floor


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--iters", type=int, default=20000)
    args = p.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.iters, q)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    out = q.get()
    for proc in procs:
        proc.join()
    fake = ctx.Process(target=_fake_child, args=(args.iters, q))
    fake.start()
    out["dist.all_reduce on torch's fake backend"] = q.get()
    fake.join()
    print(f"8-byte all_reduce, {args.ranks} ranks, torch {torch.__version__}: µs per call (slowest rank, best of 5 rounds of {args.iters})")
    for name, us in out.items():
        print(f"  {name:<42} {us:8.2f}")


def _fake_child(iters, q):
    q.put(_fake_floor(iters))


if __name__ == "__main__":
    main()
