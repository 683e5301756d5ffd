"""How xccl_rs's set-up scales with the world size, with ranks as processes of this machine
posing as hosts of --per-host ranks each (XCCL_RS_HOST_ID), so that the group is a mixed one:
shared memory within a fake host, TCP between them.

    python scripts/bench_setup_scale.py [--per-host 8] [--sizes 64 128] [--build LABEL=DIR ...]

For each build and world size, one line: the set-up time (from a common start, after every
process has imported torch, to the last rank's first all-reduce done: torch's
init_process_group and the communicator's connections), the descriptors and the sockets each
process holds after set-up (its /proc/self/fd, less what it held before; mean over the ranks),
and the mean time of an 8 B and a 1 MiB float32 all_reduce (the slowest rank's mean over the
timed iterations, after a warm-up).

--build LABEL=DIR runs the xccl_rs package found in DIR (its compiled _C included; put first on
PYTHONPATH), e.g. before=/tmp/before after=/tmp/after; without it, the installed one. Builds
alternate per size, so the machine's drift spreads over both. Every process imports torch: about
0.4 GiB of memory each, so 128 ranks want a machine with 64 GiB or more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta

WORKER = "--worker"


def fd_counts() -> tuple[int, int]:
    fds = sockets = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return fds, sockets


def worker(rank: int, size: int, port: int, small_iters: int, large_iters: int) -> None:
    import torch
    import torch.distributed as dist

    import xccl_rs  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    fds0, sockets0 = fd_counts()
    store.set(f"ready/{rank}", "1")
    store.wait(["go"])
    start = time.time()
    dist.init_process_group("xccl_rs", store=dist.PrefixStore("bench", store), rank=rank, world_size=size, timeout=timedelta(seconds=600))
    dist.all_reduce(torch.zeros(2))
    connected = time.time()
    fds, sockets = fd_counts()

    def mean_us(numel: int, iters: int) -> float:
        t = torch.ones(numel)
        for _ in range(3):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        return (time.perf_counter() - t0) / iters * 1e6

    small = mean_us(2, small_iters)
    large = mean_us(1 << 18, large_iters)
    check = torch.full((1 << 18,), float(rank))
    dist.all_reduce(check)
    ok = bool(torch.all(check == size * (size - 1) / 2))
    print(json.dumps({"rank": rank, "start": start, "connected": connected, "fds": fds - fds0, "sockets": sockets - sockets0, "small_us": small, "large_us": large, "ok": ok}), flush=True)
    dist.destroy_process_group()


def run(size: int, per_host: int, package: str | None, small_iters: int, large_iters: int) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(package), env.get("PYTHONPATH", "")) if p)
    procs = []
    for rank in range(size):
        rank_env = dict(env, XCCL_RS_HOST_ID=f"bench-host-{rank // per_host}", OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), WORKER, str(rank), str(size), str(store.port), str(small_iters), str(large_iters)]
        procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.PIPE, text=True))
    store.wait([f"ready/{r}" for r in range(size)], timedelta(seconds=600))
    store.set("go", "1")
    rows = []
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"rank {rank} exited with {proc.returncode}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    if not all(r["ok"] for r in rows):
        raise SystemExit(f"{size} ranks: a wrong all_reduce result on ranks {[r['rank'] for r in rows if not r['ok']]}")
    return {
        "setup_ms": (max(r["connected"] for r in rows) - min(r["start"] for r in rows)) * 1e3,
        "fds": sum(r["fds"] for r in rows) / size,
        "sockets": sum(r["sockets"] for r in rows) / size,
        "small_us": max(r["small_us"] for r in rows),
        "large_ms": max(r["large_us"] for r in rows) / 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == WORKER:
        worker(*(int(a) for a in argv[1:6]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--build", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument("--small-iters", type=int, default=200)
    p.add_argument("--large-iters", type=int, default=20)
    args = p.parse_args(argv)
    builds = [tuple(b.split("=", 1)) for b in args.build] or [("installed", None)]
    print(f"{args.per_host} ranks per fake host (XCCL_RS_HOST_ID), {os.cpu_count()} CPUs")
    print(f"{'build':<10} {'ranks':>6} {'hosts':>6} {'set-up ms':>10} {'fds/rank':>9} {'sockets/rank':>13} {'allreduce 8 B':>14} {'allreduce 1 MiB':>16}")
    for size in args.sizes:
        for label, package in builds:
            r = run(size, args.per_host, package, args.small_iters, args.large_iters)
            hosts = -(-size // args.per_host)
            print(
                f"{label:<10} {size:>6} {hosts:>6} {r['setup_ms']:>10.0f} {r['fds']:>9.1f} {r['sockets']:>13.1f} {r['small_us']:>11.1f} us {r['large_ms']:>13.2f} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
