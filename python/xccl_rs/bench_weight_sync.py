"""Weight sync with one sender and with several, side by side: python -m xccl_rs.bench_weight_sync.

Local processes play trainers and rollouts, as in the demo (a state dict shaped like Qwen2.5-0.5B,
random values, the same on every process), and every round runs three modes, each over a
private xccl_rs group of its own (xccl_rs.new_group):

* single  -- trainer 0 sends every full tensor (the other trainers take no part);
* multi   -- every trainer holds the full tensors and sends its share, bucket by bucket;
* sharded -- every trainer sends only its shards (a DTensor per weight, Shard(0) over the
  trainers' own world, as FSDP2's state dict), as they are. (The trainers also hold the full
  tensors, for the other modes: memory that is there before any sync, not the sync's.)

``--gather`` makes single and multi an FSDP2 trainer's: each full tensor is then gathered from
the shards as it is sent (``full_tensor()`` on every trainer, what verl's generator does; the
trainers outside the group still take part in each gather), and that time and memory count.

Each rollout loads every tensor into its "engine" (parameters allocated once) as it arrives and
checks every one, bit for bit, against the weights it computes itself. The report gives each
mode's time (the slowest rank's, from a barrier to its end), speed, and each rank's peak extra
memory during a sync (the RSS high-water mark over the sync, after malloc_trim, above the RSS
before it: the window's pages count on the senders, and on the rollouts that read them in
place). By default the buckets go through each sender's shared window (one host);
``--no-shared-memory`` sends them instead (a broadcast with one sender, point to point with
several).

``--payloads`` runs another comparison instead: the payloads full, delta and fp8 after real
AdamW steps of a small transformer (bench_payloads.py says what it measures).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xccl_rs import copy_floor
from xccl_rs._processes import free_port, join_all, messages
from xccl_rs.demo import DTYPES, LAYERS, initial_weights, qwen25_05b_shapes

MODES = ("single", "multi", "sharded")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _mark() -> int:
    """Gives freed heap memory back (so that it cannot serve the sync unseen), resets the RSS
    high-water mark, returns the RSS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _same_bits(ref: torch.Tensor, got: torch.Tensor) -> bool:
    return ref.dtype == got.dtype and ref.shape == got.shape and torch.equal(
        ref.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)
    )


def _shards(weights: dict, mesh) -> dict:
    """Each weight as a DTensor holding only this trainer's rows (a copy of them, as FSDP2 holds)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, n = mesh.get_coordinate()[0], mesh.size()
    out = {}
    for name, t in weights.items():
        rows = -(-t.shape[0] // n)
        local = t[rank * rows : (rank + 1) * rows].clone()
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=t.shape, stride=t.stride())
    return out


def _gather(shards: dict):
    """Each full tensor, gathered from the trainers' shards as it is needed (collective)."""
    for name, t in shards.items():
        yield name, t.full_tensor()


def _worker(proc: int, args, port: int, queue) -> None:
    import xccl_rs
    from torch.distributed.device_mesh import DeviceMesh
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.timeout)
    world = args.trainers + args.rollouts
    launcher = dist.TCPStore("127.0.0.1", port, world + 1, False, timeout=timeout)
    dtype = DTYPES[args.dtype]
    trainer = proc < args.trainers
    if trainer:  # the trainers' own world (what FSDP2 shards over)
        dist.init_process_group("xccl_rs", store=dist.PrefixStore("trainers/", launcher), rank=proc,
                                world_size=args.trainers, timeout=timeout)
    weights = initial_weights(args.layers, dtype, "cpu")
    engine = None if trainer else {n: torch.zeros_like(t) for n, t in weights.items()}
    shards = _shards(weights, DeviceMesh("cpu", torch.arange(args.trainers))) if trainer else None
    bucket = args.bucket_mb << 20
    shared = None if args.shared_memory else False
    for round_ in range(args.rounds):
        for mode in MODES:
            n_send = 1 if mode == "single" else args.trainers
            gathered = args.gather and mode != "sharded"
            if trainer and proc >= n_send:
                if gathered:  # outside the group, but every gather needs it (verl drains its generator)
                    mark = _mark()
                    t0 = time.perf_counter()
                    for _ in _gather(shards):
                        pass
                    queue.put(("sync", mode, round_, proc, time.perf_counter() - t0, _status("VmHWM") - mark, 0))
                continue  # not in this mode's group: allocates nothing for it
            size = n_send + args.rollouts
            rank = proc if trainer else n_send + proc - args.trainers
            store = dist.PrefixStore(f"{mode}/{round_}/", launcher)
            pg = xccl_rs.new_group(store, rank, size, timeout=timeout)
            senders = list(range(n_send))
            if engine is not None:
                for t in engine.values():
                    t.zero_()  # a tensor that does not arrive cannot pass the check
            pg.barrier().wait()
            mark = _mark()
            t0 = time.perf_counter()
            if rank < n_send:
                source = shards if mode == "sharded" else (_gather(shards) if gathered else weights)
                stats = WeightSender(pg, bucket_bytes=bucket, senders=senders, shared_memory=shared).send(source)
                sent = stats.bytes
            else:
                for name, t in WeightReceiver(pg, bucket_bytes=bucket, senders=senders).receive(copy=False):
                    engine[name].copy_(t)
                sent = 0
            seconds = time.perf_counter() - t0
            extra = _status("VmHWM") - mark
            if engine is not None:
                bad = [n for n in weights if not _same_bits(weights[n], engine[n])]
                if bad:
                    raise AssertionError(f"{mode}, round {round_}: {len(bad)} tensors differ (first: {bad[:3]})")
            queue.put(("sync", mode, round_, proc, seconds, extra, sent))
            if args.shared_memory:  # the same copies alone, with the same tensors
                own = None
                if rank < n_send:
                    own = [s.to_local() for s in shards.values()] if mode == "sharded" else weights.values()
                part = copy_floor.measure(pg, own, engine.values() if engine is not None else None, bucket,
                                          send_bytes=sent if rank < n_send else None)
                queue.put(("floor", mode, round_, part))
            pg.barrier().wait()
            xccl_rs.destroy_group(pg)
    if trainer:
        dist.destroy_process_group()
    queue.put(("done", proc))


def _reporting(mode: str, args) -> int:
    """How many processes report a sync of `mode`: its group, and with --gather the trainers
    outside it that still take part in the gathers."""
    n_send = 1 if mode == "single" else args.trainers
    outside = args.trainers - n_send if args.gather and mode != "sharded" else 0
    return n_send + args.rollouts + outside


def main(argv=None) -> int:
    from xccl_rs.bench import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m xccl_rs.bench_weight_sync", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--trainers", type=int, default=2, help="trainer processes (the senders of multi and sharded)")
    p.add_argument("--rollouts", type=int, default=2, help="rollout processes")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the weights' dtype")
    p.add_argument("--layers", type=int, default=LAYERS, help="decoder layers (Qwen2.5-0.5B has 24)")
    p.add_argument("--bucket-mb", type=int, default=128, metavar="MIB", help="bucket size, MiB")
    p.add_argument("--rounds", type=int, default=3, help="rounds (each runs every mode; the first pays the warm-up)")
    p.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                   help="send the buckets (no shared window)")
    p.add_argument("--gather", action="store_true",
                   help="single and multi gather each full tensor from the trainers' shards (an FSDP2 trainer)")
    p.add_argument("--timeout", type=float, default=600.0, help="group timeout, seconds")
    from xccl_rs import bench_payloads

    bench_payloads.add_arguments(p)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.payloads:
        return bench_payloads.run(args)
    dtype = DTYPES[args.dtype]
    numel = sum(torch.Size(s).numel() for _, s in qwen25_05b_shapes(args.layers))
    nbytes = numel * dtype.itemsize
    print(f"weight sync modes: {args.trainers} trainers -> {args.rollouts} rollouts, Qwen2.5-0.5B layout, "
          f"{numel / 1e6:.1f}M parameters, {args.dtype}, {nbytes / 1e9:.2f} GB per sync, buckets of "
          f"{args.bucket_mb} MiB, {'shared window' if args.shared_memory else 'sent'}, {args.rounds} rounds, "
          f"{'full tensors gathered from shards' if args.gather else 'full tensors held'} for single and multi, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    world = args.trainers + args.rollouts
    launcher = dist.TCPStore("127.0.0.1", port, world + 1, True, timeout=timedelta(seconds=args.timeout),
                             wait_for_workers=False)
    procs = [ctx.Process(target=_worker, args=(i, args, port, queue)) for i in range(world)]
    for proc in procs:
        proc.start()
    syncs: dict[tuple[str, int], list] = {}
    parts: dict[tuple[str, int], list] = {}
    for msg in messages(procs, queue):
        if msg[0] == "floor":
            parts.setdefault((msg[1], msg[2]), []).append(msg[3])
        elif msg[0] == "sync":
            _, mode, round_, proc, seconds, extra, sent = msg
            rows = syncs.setdefault((mode, round_), [])
            rows.append((proc, seconds, extra, sent))
            if len(rows) == _reporting(mode, args):  # progress: one line per sync as it ends
                print(f"  round {round_ + 1}/{args.rounds} {mode:<8} {max(r[1] for r in rows):.3f} s", flush=True)
    if not join_all(procs, "bench_weight_sync"):
        return 1
    del launcher

    def who(proc: int) -> str:
        return f"t{proc}" if proc < args.trainers else f"r{proc - args.trainers}"

    print(f"\n{'mode':<9}{'senders':>8}{'median':>9}{'first':>9}{'GB/s':>7}{'floor':>8}{'x floor':>8}   GB sent per sender   "
          "peak extra memory per rank, MB: first sync / median of the later ones")
    for mode in MODES:
        rounds = [syncs[(mode, r)] for r in range(args.rounds)]
        times = [max(s for _, s, _, _ in rows) for rows in rounds]
        med = statistics.median(times[1:] or times)
        floors = [copy_floor.floor_of(parts[(mode, r)]) for r in range(args.rounds) if (mode, r) in parts]
        if len(floors) == len(times):
            ratios = [t / f for t, f in zip(times, floors)]
            floor = f"{statistics.median(floors[1:] or floors):>7.3f}s{statistics.median(ratios[1:] or ratios):>7.2f}x"
        else:
            floor = f"{'-':>8}{'-':>8}"
        mem: dict[int, list] = {}
        for rows in rounds:
            for proc, _, extra, _ in rows:
                mem.setdefault(proc, []).append(extra)
        shown = "  ".join(
            f"{who(p)} {max(v[0], 0) / 1e6:.0f}/{max(statistics.median(v[1:] or v), 0) / 1e6:.0f}" for p, v in sorted(mem.items())
        )
        shares = "/".join(f"{sent / 1e9:.2f}" for p, _, _, sent in sorted(rounds[0]) if p < args.trainers)
        n = 1 if mode == "single" else args.trainers
        print(f"{mode:<9}{n:>8}{med:>8.3f}s{times[0]:>8.3f}s{nbytes / med / 1e9:>7.2f}{floor}   {shares:<20} {shown}")
    if args.shared_memory:
        print("floor: the copies of a sync alone, with the same tensors in the same run (each sender's share into a "
              "bucket, then every rollout's out of one); x floor: the sync's time over it (medians after the first round)")
    print("every rollout's tensors verified bit for bit after every sync; buckets: "
          f"{args.bucket_mb} MiB (two per sender: {2 * args.bucket_mb * 1.048576:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
