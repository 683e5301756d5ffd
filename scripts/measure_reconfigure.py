"""How long a reconfigure takes (torch >= 2.15): N ranks on this host connect with
`dist._reconfigure`, then the last rank leaves and the others reconfigure without it; prints
each survivor's time for that shrink (from the call to the completed Work) and for the all_reduce
after it, over several rounds.

    python scripts/measure_reconfigure.py [--ranks 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, rounds: int, out) -> None:
    import xccl_rs  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("xccl_rs", rank=rank, world_size=world, store=store, enable_reconfigure=True)

    def handles(key, members):
        store.set(f"{key}/{rank}", dist._get_reconfigure_handle())
        return [store.get(f"{key}/{m}").decode() for m in members]

    everyone = list(range(world))
    survivors = everyone[:-1]
    uuid = 1
    times = []
    for r in range(rounds):
        dist._reconfigure(uuid, handles(f"all{r}", everyone)).wait()
        uuid += 1
        dist.all_reduce(torch.ones(4))
        if rank in survivors:
            h = handles(f"shrink{r}", survivors)
            t0 = time.perf_counter()
            dist._reconfigure(uuid, h).wait()
            t1 = time.perf_counter()
            dist.all_reduce(torch.ones(4))
            times.append((t1 - t0, time.perf_counter() - t1))
        uuid += 1
        store.set(f"done{r}/{rank}", "1")
        for m in everyone:
            store.get(f"done{r}/{m}")
    if rank in survivors:
        out.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.rounds, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    results = [out.get() for _ in range(args.ranks - 1)]
    shrink = [t[0] * 1e3 for _, ts in results for t in ts]
    after = [t[1] * 1e6 for _, ts in results for t in ts]
    print(f"{args.ranks} ranks on one host, the last one dropped, {args.rounds} rounds, torch {torch.__version__}")
    print(f"reconfigure without it: median {statistics.median(shrink):.1f} ms, max {max(shrink):.1f} ms "
          f"(every survivor, every round)")
    print(f"the all_reduce after it: median {statistics.median(after):.0f} us")


if __name__ == "__main__":
    main()
