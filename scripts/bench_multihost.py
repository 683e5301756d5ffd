#!/usr/bin/env python
"""Between hosts, on one machine: xccl_rs and gloo side by side over shaped links.

    sudo $PY scripts/bench_multihost.py [--layouts 2x2 4x1] [--rate 1gbit] [--weight-sync]

Builds the test bed of python_tests/netns.py: every "host" a network namespace, every local rank
its own veth (rail) to a bridge of that rail, every veth shaped with tbf to --rate each way on
both ends, so that the links, not this machine's cores, bound what crosses hosts. Local rank i
of host h advertises its rail address (XCCL_RS_SOCKET_HOST) and host (XCCL_RS_HOST_ID); gloo
binds the same interface (GLOO_SOCKET_IFNAME); ``--transport ofi`` runs xccl_rs between hosts over
libfabric's tcp provider. Then, in one run, per layout:

- all_reduce (SUM), all_gather (all_gather_into_tensor) and reduce_scatter (reduce_scatter_tensor)
  at each size on xccl_rs and gloo in turn, each checked once against the sum or concatenation
  of every rank's input (#wrong);
- p2p: an 8-byte ping-pong between rank 0 and the first rank of the last host (half a round
  trip: the per-message cost between hosts, the cost model's alpha);
- with --weight-sync, on --ws-layout (4 hosts of 1 rank): a state dict of Qwen2.5-0.5B's shapes (0.99 GB of bf16) from every rank of
  the first half of the hosts (the trainers, each its share: ``senders`` = all) to every rank of
  the others (the rollouts), through xccl_rs.weight_sync, and through gloo (each trainer
  broadcasts its share of the tensors in a group of it and the rollouts, all trainers at once).

Columns: size S (all_gather: the gathered output; reduce_scatter: the full input, as in
python -m xccl_rs.bench), time (the slowest rank's mean per iteration, median of --reps loops),
algbw = S / time and busbw = algbw * the bus factor of nccl-tests (all_reduce 2(n-1)/n,
all_gather and reduce_scatter (n-1)/n, n ranks), vs gloo (gloo's time / this one's), floor and
x floor (time / floor).

The link floor: the bytes the busiest rail must carry divided by --rate, for the best any
algorithm can do when the ranks of a host share memory for free: with H hosts of k ranks, each
with k rails, every host must send and receive 2(H-1)/H * S for an all_reduce and (H-1)/H * S
for an all_gather or reduce_scatter, spread over its k rails: floor = that / (k * rate). The
weight sync's: every rollout host must receive the W bytes of the state dict over its k rails,
and the trainer hosts must send them to each rollout host over theirs: max of W / (k * rate)
and W * rollout hosts / (trainer hosts * k * rate).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_tests"))
import netns  # noqa: E402
from multihost import TRANSPORT_ENV  # noqa: E402

OPS = ("all_reduce", "all_gather", "reduce_scatter")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n}
HOST_FACTOR = {"all_reduce": lambda h: 2 * (h - 1) / h, "all_gather": lambda h: (h - 1) / h,
               "reduce_scatter": lambda h: (h - 1) / h}
BACKENDS = ("gloo", "xccl_rs")  # gloo first: its time is on the screen when xccl_rs's line shows the ratio


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def parse_rate(text: str) -> float:
    """A tc rate ("1gbit", "500mbit") in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, bits in units.items():
        if text.lower().endswith(unit):
            return float(text[: -len(unit)]) * bits / 8
    raise ValueError(f"--rate: give gbit, mbit or kbit, got {text!r}")


def parse_layout(text: str) -> tuple[int, int]:
    hosts, ranks = text.lower().split("x")
    return int(hosts), int(ranks)


def link_floor(op: str, nbytes: int, hosts: int, per_host: int, rate: float) -> float:
    return HOST_FACTOR[op](hosts) * nbytes / (per_host * rate)


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ------------------------------------------------------------------------------ ranks


def _enter(rank: int, world: int, port: int, hosts_names: list[str], per_host: int, addresses, transport: str):
    """This rank's store client (on the machine's loopback, connected before leaving it), then its
    host's namespace and rail."""
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=300))
    h, i = divmod(rank, per_host)
    netns.enter(hosts_names[h])
    os.environ.update({"XCCL_RS_SOCKET_HOST": addresses[h][i], "XCCL_RS_HOST_ID": f"netns-{h}",
                       "GLOO_SOCKET_IFNAME": f"rail{i}", **TRANSPORT_ENV[transport]})
    return store


def _timed(fn, iters: int, reps: int, control) -> list[float]:
    """The slowest rank's mean seconds per call over `iters` calls, for each of `reps` loops."""
    out = []
    for _ in range(reps):
        dist.barrier(group=control)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
        out.append(elapsed.item())
    return out


def _iters(nbytes: int, floor: float) -> int:
    """About 2 s of calls at the floor's pace, 3 to 50."""
    return max(3, min(50, int(2.0 / max(floor, 1e-4))))


def _collective(op: str, group, nbytes: int, rank: int, world: int):
    """(call, check): one op of S = nbytes on float32 tensors; check() fills the inputs, runs it
    once and returns the wrong elements of this rank's result."""
    per = max(1, nbytes // 4 // (world if op != "all_reduce" else 1))
    if op == "all_reduce":
        t = torch.empty(per)

        def call():
            dist.all_reduce(t, group=group)

        def check():
            t.fill_(rank + 1)
            call()
            return int((t != world * (world + 1) // 2).sum())
    elif op == "all_gather":
        inp, out = torch.empty(per), torch.empty(per * world)

        def call():
            dist.all_gather_into_tensor(out, inp, group=group)

        def check():
            inp.fill_(rank + 1)
            out.fill_(float("nan"))
            call()
            want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(per)
            return int((out != want).sum())
    else:
        inp, out = torch.empty(per * world), torch.empty(per)

        def call():
            dist.reduce_scatter_tensor(out, inp, group=group)

        def check():
            inp.copy_(torch.arange(world, dtype=torch.float32).repeat_interleave(per) + rank)
            out.fill_(float("nan"))
            call()
            return int((out != world * rank + world * (world - 1) // 2).sum())
    return call, check


def _ping_pong(group, peer: int, rank: int):
    t = torch.zeros(2)  # 8 bytes

    def call():
        if rank == 0:
            dist.send(t, peer, group=group)
            dist.recv(t, peer, group=group)
        elif rank == peer:
            dist.recv(t, 0, group=group)
            dist.send(t, 0, group=group)

    return call


def _rank_main(rank, args, world, port, names, addresses, queue):
    try:
        _rank_body(rank, args, world, port, names, addresses, queue)
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        import traceback

        queue.put(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    queue.put(("done", rank))


def _rank_body(rank, args, world, port, names, addresses, queue):
    import xccl_rs  # noqa: F401

    torch.set_num_threads(1)
    hosts, per_host = args.layout_now
    store = _enter(rank, world, port, names, per_host, addresses, args.transport)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("xccl_rs", store=dist.PrefixStore("xccl_rs/", store), rank=rank, world_size=world,
                            timeout=timeout)
    groups = {"xccl_rs": dist.group.WORLD, "gloo": dist.new_group(backend="gloo", timeout=timeout)}
    control = groups["gloo"]
    rate = parse_rate(args.rate)
    for nbytes in [parse_size(s) for s in args.sizes]:
        for op in OPS:
            floor = link_floor(op, nbytes, hosts, per_host, rate)
            for backend in args.backends:
                call, check = _collective(op, groups[backend], nbytes, rank, world)
                call()  # warm-up (connections, buffers)
                times = _timed(call, _iters(nbytes, floor), args.reps, control)
                wrong = torch.tensor([check()])
                dist.all_reduce(wrong, group=control)
                if rank == 0:
                    queue.put(("row", {"op": op, "bytes": nbytes, "backend": backend, "times": times,
                                       "wrong": int(wrong.item()), "floor": floor}))
    peer = world - per_host  # the first rank of the last host
    for backend in args.backends:
        call = _ping_pong(groups[backend], peer, rank)
        call()
        times = _timed(call, 200, args.reps, control)
        if rank == 0:
            queue.put(("row", {"op": "p2p", "bytes": 8, "backend": backend, "times": [t / 2 for t in times],
                               "wrong": 0, "floor": None}))
    if args.weight_sync:
        _weight_sync(rank, world, store, args, groups, control, hosts, per_host, queue)
    dist.barrier(group=control)
    dist.destroy_process_group()


def _shares(weights: dict, senders: int) -> list[list[str]]:
    """Whole tensors shared out among the senders, largest first to the least loaded (for gloo)."""
    loads, shares = [0] * senders, [[] for _ in range(senders)]
    for name in sorted(weights, key=lambda n: -weights[n].nbytes):
        s = loads.index(min(loads))
        shares[s].append(name)
        loads[s] += weights[name].nbytes
    return shares


def _weight_sync(rank, world, store, args, groups, control, hosts, per_host, queue):
    import xccl_rs
    from xccl_rs.demo import initial_weights
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    trainers = world // 2  # the first half of the hosts
    trainer = rank < trainers
    weights = initial_weights(args.ws_layers, torch.bfloat16, "cpu")
    engine = None if trainer else {n: torch.zeros_like(t) for n, t in weights.items()}
    senders = list(range(trainers))
    gloo_groups = [dist.new_group([t, *range(trainers, world)], backend="gloo", timeout=timedelta(seconds=args.timeout))
                   for t in senders]
    shares = _shares(weights, trainers)
    pg = xccl_rs.new_group(dist.PrefixStore("weight-sync/", store), rank, world,
                           timeout=timedelta(seconds=args.timeout))
    for round_ in range(args.ws_rounds):
        for backend in args.backends:
            if engine is not None:
                for t in engine.values():
                    t.zero_()  # a tensor that does not arrive cannot pass the check
            dist.barrier(group=control)
            t0 = time.perf_counter()
            if backend == "xccl_rs":
                if trainer:
                    WeightSender(pg, bucket_bytes=args.bucket_mb << 20, senders=senders).send(weights)
                else:
                    for name, t in WeightReceiver(pg, bucket_bytes=args.bucket_mb << 20, senders=senders).receive(copy=False):
                        engine[name].copy_(t)
            else:
                works = []
                for s, names in enumerate(shares):
                    if trainer and rank != s:
                        continue
                    for name in names:
                        t = weights[name] if trainer else engine[name]
                        works.append(dist.broadcast(t, src=s, group=gloo_groups[s], async_op=True))
                for w in works:
                    w.wait()
            seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            bad = 0 if engine is None else sum(not torch.equal(weights[n], engine[n]) for n in weights)
            result = torch.tensor([bad], dtype=torch.float64)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=control)
            dist.all_reduce(result, group=control)
            if rank == 0:
                nbytes = sum(t.nbytes for t in weights.values())
                queue.put(("ws", {"backend": backend, "round": round_, "seconds": seconds.item(),
                                  "wrong_tensors": int(result.item()), "bytes": nbytes}))
    xccl_rs.destroy_group(pg)


# ------------------------------------------------------------------------------ the parent


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _run_layout(args, layout, out):
    hosts, per_host = layout
    world = hosts * per_host
    rate = parse_rate(args.rate)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timedelta(seconds=300), wait_for_workers=False)
    with netns.NamespaceHosts(hosts, rails=per_host, rate=args.rate) as bed:
        addresses = [[bed.address(h, i) for i in range(per_host)] for h in range(hosts)]
        args.layout_now = layout
        procs = [ctx.Process(target=_rank_main, args=(r, args, world, store.port, bed.names, addresses, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        print(f"\n## {hosts} hosts x {per_host} ranks ({world} ranks), xccl_rs over {args.transport}, rails of {args.rate} "
              f"({rate / 1e6:.0f} MB/s each way)", flush=True)
        print(f"{'op':<15}{'size':>6}  {'backend':<8}{'time us':>12}{'algbw':>8}{'busbw':>8}{'#wrong':>7}"
              f"{'vs gloo':>8}{'floor us':>11}{'x floor':>10}", flush=True)
        done, gloo_time = 0, {}
        rows = []
        while done < world:
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                time.sleep(0.05)
                continue
            msg = queue.get()
            if msg[0] == "done":
                done += 1
            elif msg[0] == "error":
                print(f"rank {msg[1]} failed: {msg[2]}", file=sys.stderr, flush=True)
            elif msg[0] == "row":
                row = msg[1]
                row.update(layout=f"{hosts}x{per_host}", ranks=world, rate=args.rate)
                rows.append(row)
                _print_row(row, world, gloo_time)
            elif msg[0] == "ws":
                row = msg[1]
                floor = max(row["bytes"] / (per_host * rate), row["bytes"] * (hosts - hosts // 2) / (hosts // 2 * per_host * rate))
                row.update(layout=f"{hosts}x{per_host}", rate=args.rate, floor=floor)
                rows.append(row)
                print(f"weight sync {row['bytes'] / 1e9:.2f} GB, {hosts // 2} trainer hosts -> {hosts - hosts // 2} "
                      f"rollout hosts, round {row['round'] + 1} {row['backend']:<8} {row['seconds']:8.2f} s "
                      f"{row['bytes'] / row['seconds'] / 1e9:6.3f} GB/s  floor {floor:.2f} s  x floor "
                      f"{row['seconds'] / floor:.2f}  wrong tensors {row['wrong_tensors']}", flush=True)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        ok = all(p.exitcode == 0 for p in procs)
    out.extend(rows)
    return ok and all(r.get("wrong", 0) == 0 and r.get("wrong_tensors", 0) == 0 for r in rows)


def _print_row(row, world, gloo_time):
    t = statistics.median(row["times"])
    key = (row["op"], row["bytes"])
    if row["backend"] == "gloo":
        gloo_time[key] = t
    vs = gloo_time.get(key)
    algbw = row["bytes"] / t / 1e9
    busbw = algbw * BUS_FACTOR[row["op"]](world) if row["op"] in BUS_FACTOR else float("nan")
    floor = row["floor"]
    print(f"{row['op']:<15}{human(row['bytes']):>6}  {row['backend']:<8}{t * 1e6:12.1f}{algbw:8.3f}{busbw:8.3f}"
          f"{row['wrong']:7d}{(f'{vs / t:.2f}' if vs and row['backend'] != 'gloo' else '-'):>8}"
          f"{(f'{floor * 1e6:.1f}' if floor else '-'):>11}{(f'{t / floor:.2f}' if floor else '-'):>10}", flush=True)


# ------------------------------------------------------------------------------ the cost model

NODES = (2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = 8
NIC_GBS = (25, 50)
ALL_REDUCE_BYTES = 1 << 30
WEIGHTS_7B = 7.62e9 * 2  # Qwen2.5-7B's parameters in bf16


NCCL_ALPHA = 5e-6  # an assumed per-step latency of NCCL on an RDMA fabric, for the last column


def cost_model(path: str) -> str:
    """The projection table (markdown) from a run's JSON, whose inputs come from its layout of one
    rank (one rail) per host: alpha, xccl_rs's per-message cost between hosts (its 8-byte p2p,
    half a round trip), and eta, the fraction of the link rate its largest all_reduce and its
    weight sync reached (floor / time)."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    mine = [r for r in rows if r.get("backend") == "xccl_rs" and r["layout"].endswith("x1")]
    layout = mine[0]["layout"]
    alpha = statistics.median(next(r for r in mine if r.get("op") == "p2p")["times"])
    ar = max((r for r in mine if r.get("op") == "all_reduce"), key=lambda r: r["bytes"])
    eta_ar = ar["floor"] / statistics.median(ar["times"])
    ws = [r for r in mine if "seconds" in r]
    eta_ws = max(r["floor"] / r["seconds"] for r in ws) if ws else 1.0
    g = GPUS_PER_NODE
    buckets = math.ceil(WEIGHTS_7B / (128 << 20))
    lines = [
        f"Measured ({os.path.basename(path)}, {layout}): alpha = {alpha * 1e6:.0f} us; all_reduce "
        f"{human(ar['bytes'])} at eta = {eta_ar:.2f} of the link floor; weight sync at eta = {eta_ws:.2f}.",
        "",
        "| nodes x 8 | NIC | all_reduce 1 GiB: floor | xccl_rs, rails | NCCL ring | NCCL ring, alpha 5 us "
        "| 7B sync: node floor | xccl_rs, each GPU all | NCCL broadcast | NCCL broadcast, alpha 5 us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def t(x):
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"

    for nic in NIC_GBS:
        b = nic * 1e9
        for n in NODES:
            ranks, rollouts = n * g, n // 2 * g
            floor = 2 * (n - 1) / n * ALL_REDUCE_BYTES / (g * b)
            ring_bytes = 2 * (ranks - 1) / ranks * ALL_REDUCE_BYTES / (g * b)
            ws_floor = WEIGHTS_7B / (g * b)
            cells = [
                floor,
                floor / eta_ar + 2 * (n - 1) * alpha,
                ring_bytes + 2 * (ranks - 1) * alpha,
                ring_bytes + 2 * (ranks - 1) * NCCL_ALPHA,
                ws_floor,
                WEIGHTS_7B / (b * eta_ws) + buckets * alpha,
                ws_floor + rollouts * alpha,
                ws_floor + rollouts * NCCL_ALPHA,
            ]
            lines.append(f"| {n} x {g} | {nic} GB/s | " + " | ".join(t(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=["2x2", "4x1"], help="HOSTSxRANKS, e.g. 2x2 4x1 2x4")
    p.add_argument("--transport", default="tcp", choices=list(TRANSPORT_ENV),
                   help="xccl_rs between hosts: tcp, or ofi (libfabric's tcp provider)")
    p.add_argument("--rate", default="1gbit", help="every rail's rate each way (tc tbf rate)")
    p.add_argument("--sizes", nargs="+", default=["8", "1M", "16M", "64M"])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--reps", type=int, default=3, help="timed loops per case (the median is shown)")
    p.add_argument("--weight-sync", action="store_true", help="also the weight sync, on the layout --ws-layout")
    p.add_argument("--ws-layout", default="4x1", help="the weight sync's layout (its first half of hosts are trainers)")
    p.add_argument("--ws-layers", type=int, default=24, help="decoder layers of the state dict (24: 0.99 GB)")
    p.add_argument("--ws-rounds", type=int, default=2)
    p.add_argument("--bucket-mb", type=int, default=128)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="write every row here")
    p.add_argument("--label", default="", help="printed in the header (e.g. the build's commit)")
    p.add_argument("--cost-model", metavar="JSON", help="print the projection table from a run's --json, and exit")
    args = p.parse_args(argv)
    if args.cost_model:
        print(cost_model(args.cost_model))
        return 0
    why = netns.shaping_unavailable()
    if why is not None:
        print(f"cannot build the test bed: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import xccl_rs

    print(f"bench_multihost: {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"xccl_rs from {os.path.dirname(xccl_rs.__file__)}, this checkout at {_commit()}", flush=True)
    if args.label:
        print(f"build: {args.label}")
    print("command: " + " ".join([os.path.basename(sys.executable), "scripts/bench_multihost.py", *(argv or sys.argv[1:])]))
    rows, ok = [], True
    layouts = [parse_layout(x) for x in args.layouts]
    if args.weight_sync and parse_layout(args.ws_layout) not in layouts:
        layouts.append(parse_layout(args.ws_layout))
    for layout in layouts:
        ws = args.weight_sync and layout == parse_layout(args.ws_layout)
        sub = argparse.Namespace(**{**vars(args), "weight_sync": ws})
        ok &= _run_layout(sub, layout, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _commit(), "torch": torch.__version__, "rate": args.rate, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
