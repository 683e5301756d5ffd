"""Collective benchmark: python -m xccl_rs.bench

Runs N local ranks and times all_reduce, broadcast, all_gather and reduce_scatter on gloo and
on xccl_rs side by side, in one run, over the same tensors. Prints time, algorithm bandwidth,
bus bandwidth (nccl-tests formulas) and xccl_rs's speed-up over gloo; writes JSON with --json.
--peer deepspeed adds DeepSpeed's CPU shared-memory all-reduce (when DeepSpeed imports) and
--memory-bound the bound the machine's copy bandwidth sets (bench_peers.py says how both work);
--backends ... zero-copy times xccl_rs on tensors from its shared-memory heap (xccl_rs.empty).

Bus bandwidth (n ranks, S bytes, t seconds; nccl-tests' PERFORMANCE.md):
  all_reduce      algbw = S / t,  busbw = algbw * 2 (n-1) / n   (all_reduce_avg: ReduceOp.AVG)
  broadcast       algbw = S / t,  busbw = algbw
  all_gather      algbw = S / t,  busbw = algbw * (n-1) / n     (S: the gathered output)
  reduce_scatter  algbw = S / t,  busbw = algbw * (n-1) / n     (S: the full input)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_reduce", "all_reduce_avg", "broadcast", "all_gather", "reduce_scatter"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_DTYPES = ["float32", "bfloat16"]
DEFAULT_SIZES = ["8", "1K", "64K", "1M", "16M", "64M", "256M"]
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_reduce_avg": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help of the package's commands (bench, demo, soak): the description as written, and each
    option's default after its help (none for flags, which take no value, nor for options unset
    by default)."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if action.nargs == 0 or default is None or default == argparse.SUPPRESS or "%(default)" in text:
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B") or "0"
    if text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def iterations(nbytes: int, scale: float) -> int:
    """Enough repetitions for a stable median, few for huge tensors."""
    return max(3, min(200, int(scale * (256 << 20) / max(nbytes, 1 << 16))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make(op: str, nbytes: int, dtype: torch.dtype, rank: int, world: int, device: torch.device, heap=None):
    """The tensors of one op, and a closure that runs it on a group. `heap`: the group whose
    shared-memory heap holds the tensors (`xccl_rs.empty`: the zero-copy column)."""
    esz = torch.tensor([], dtype=dtype).element_size()
    count = max(1, nbytes // esz)
    kw = {"dtype": dtype, "device": device}
    if heap is not None:
        import xccl_rs

        def full(shape, value, dtype, device):
            return xccl_rs.empty(shape, dtype=dtype, group=heap).fill_(value)

        def empty(shape, dtype, device):
            return xccl_rs.empty(shape, dtype=dtype, group=heap)
    else:
        full, empty = torch.full, torch.empty
    if op in ("all_reduce", "all_reduce_avg"):
        t = full((count,), float(rank + 1), **kw)
        reduce_op = dist.ReduceOp.AVG if op == "all_reduce_avg" else dist.ReduceOp.SUM
        return lambda g: dist.all_reduce(t, op=reduce_op, group=g)
    if op == "broadcast":
        t = full((count,), float(rank), **kw)
        return lambda g: dist.broadcast(t, src=dist.get_global_rank(g, 0), group=g)
    if op == "all_gather":
        per = max(1, count // world)
        out = empty((per * world,), **kw)
        inp = full((per,), float(rank), **kw)
        return lambda g: dist.all_gather_into_tensor(out, inp, group=g)
    if op == "reduce_scatter":
        per = max(1, count // world)
        inp = full((per * world,), float(rank), **kw)
        out = empty((per,), **kw)
        return lambda g: dist.reduce_scatter_tensor(out, inp, group=g)
    raise ValueError(op)


def _issue_async(group, control, device: torch.device, count: int) -> dict:
    """How long issuing `count` async all_reduces of 1 MiB takes on the host (the calls only,
    not their completion), the slowest rank's: the first time (cold: the first device
    collective of a process pays the runtime's first use of events and streams once) and the
    second (steady state, as in a training loop)."""
    ts = [torch.ones(1 << 18, device=device) for _ in range(count)]
    out = {"op": "issue_async", "count": count, "bytes": 1 << 20, "device": str(device)}
    for label in ("cold", "warm"):
        _sync(device)
        dist.barrier(group=control)
        t0 = time.perf_counter()
        works = [dist.all_reduce(t, group=group, async_op=True) for t in ts]
        issue = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        for w in works:
            w.wait()
        _sync(device)
        total = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(issue, op=dist.ReduceOp.MAX, group=control)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=control)
        out[f"{label}_issue_ms"] = issue.item() * 1e3
        out[f"{label}_complete_ms"] = total.item() * 1e3
    return out


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def _time(run, group, iters, device, control, nbytes, op, world, warm=True) -> dict:
    """The slowest rank's mean time per call of `run(group)`, all ranks starting together."""
    if warm:
        for _ in range(max(1, iters // 10)):
            run(group)
    dist.barrier(group=control)
    t0 = time.perf_counter()
    for _ in range(iters):
        run(group)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
    sec = elapsed.item()
    algbw = nbytes / sec / 1e9
    return {"time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[op](world)}


def _worker(rank, world, port, args, queue):
    import xccl_rs  # noqa: F401

    from xccl_rs.bench_peers import DeepSpeedPeer, copier_threads, copy_bandwidth

    torch.set_num_threads(1)
    if args.fake_hosts > 1:
        # Consecutive blocks of ranks pose as hosts: a mixed group (shared memory within a
        # "host", TCP between them) measured on one machine. Read when the group is created.
        os.environ["XCCL_RS_HOST_ID"] = f"bench-host-{rank * args.fake_hosts // world}"
    device = torch.device(args.device)
    if device.type != "cpu":
        if device.index is None:
            device = torch.device(device.type, 0)  # every rank on the one device
        getattr(torch, device.type).set_device(device)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    xccl = dist.new_group(backend="xccl_rs")
    # "zero-copy": the same xccl_rs group, on tensors from its heap (xccl_rs.empty).
    groups = {"gloo": dist.group.WORLD, "xccl_rs": xccl, "zero-copy": xccl}
    groups = {k: v for k, v in groups.items() if k in args.backends}
    control = dist.new_group(backend="gloo")
    peer = DeepSpeedPeer(rank, world, port, control) if args.peer == "deepspeed" else None
    rows = []
    if args.issue_async and "xccl_rs" in groups:
        rows.append(_issue_async(groups["xccl_rs"], control, device, args.issue_async))
        if rank == 0:
            queue.put(("note", rows[-1]))
    for op in args.ops:
        for dname in args.dtypes:
            for size_text in args.sizes:
                nbytes = parse_size(size_text)
                iters = iterations(nbytes, args.scale)
                row = {"op": op, "dtype": dname, "bytes": nbytes, "ranks": world, "iters": iters}
                for name, group in groups.items():
                    heap = group if name == "zero-copy" else None
                    run = _make(op, nbytes, DTYPES[dname], rank, world, device, heap)
                    failed = torch.zeros(1)
                    try:
                        for _ in range(max(1, iters // 10)):
                            run(group)
                        _sync(device)
                    except RuntimeError as e:  # gloo lacks some ops on device tensors
                        if rank == 0:
                            print(f"  {name} {op} on {device}: {str(e).splitlines()[0][:100]}", flush=True)
                        failed.fill_(1)
                    dist.all_reduce(failed, group=control)
                    if failed.item():
                        continue
                    row[name] = _time(run, group, iters, device, control, nbytes, op, world, warm=False)
                if peer is not None and peer.supports(op, dname) is None:
                    run = peer.make(nbytes, DTYPES[dname], rank, world, control)
                    row["deepspeed"] = _time(run, None, iters, device, control, nbytes, op, world)
                if args.memory_bound:
                    per_rank = copy_bandwidth(nbytes, iters, control, copier_threads(world // args.fake_hosts))
                    sec = nbytes * BUS_FACTOR[op](world) / per_rank
                    row["bound"] = {"time_us": sec * 1e6, "algbw_GBps": nbytes / sec / 1e9, "busbw_GBps": per_rank / 1e9}
                if "gloo" in row and "xccl_rs" in row:
                    row["speedup"] = row["gloo"]["time_us"] / row["xccl_rs"]["time_us"]
                if "deepspeed" in row and "xccl_rs" in row:
                    row["vs_deepspeed"] = row["deepspeed"]["time_us"] / row["xccl_rs"]["time_us"]
                if "deepspeed" in row and "zero-copy" in row:
                    row["zero_copy_vs_deepspeed"] = row["deepspeed"]["time_us"] / row["zero-copy"]["time_us"]
                rows.append(row)
                if rank == 0:
                    queue.put(("row", row))
    if rank == 0:
        queue.put(("done", None))
    dist.barrier(group=control)
    dist.destroy_process_group()


def _columns(args) -> list[str]:
    """What each row shows, left to right: the backends, then the peer, then the bound."""
    return list(args.backends) + (["deepspeed"] if args.peer else []) + (["bound"] if args.memory_bound else [])


def _print_row(row, columns):
    cells = [f"{row['op']:<15}", f"{row['dtype']:<9}", f"{human(row['bytes']):>9}"]
    for b in columns:
        r = row.get(b)
        cells.append(f"{r['time_us']:>12.1f} {r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f}" if r else f"{'-':>12} {'':>7} {'':>7}")
    for key in ("speedup", "vs_deepspeed", "zero_copy_vs_deepspeed"):
        if key in row:
            cells.append(f"{row[key]:>8.2f}x")
        elif key != "speedup" and "deepspeed" in columns and (key == "vs_deepspeed" or "zero-copy" in columns):
            cells.append(f"{'-':>9}")
    print(" ".join(cells), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m xccl_rs.bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="local rank processes")
    p.add_argument("--ops", nargs="+", default=OPS, choices=OPS, metavar="OP", help=f"collectives to time, of: {' '.join(OPS)}")
    p.add_argument("--dtypes", nargs="+", default=DEFAULT_DTYPES, choices=list(DTYPES), metavar="DTYPE",
                   help=f"of: {' '.join(DTYPES)}")
    p.add_argument("--sizes", nargs="+", default=DEFAULT_SIZES, metavar="SIZE",
                   help="bytes per op, with K, M, G for KiB, MiB, GiB (e.g. 8 64K 16M)")
    p.add_argument("--backends", nargs="+", default=["gloo", "xccl_rs"], choices=["gloo", "xccl_rs", "zero-copy"],
                   metavar="BACKEND",
                   help="of: gloo xccl_rs zero-copy (xccl_rs on tensors from its shared-memory heap, xccl_rs.empty; CPU tensors)")
    p.add_argument("--device", default="cpu", help="where the tensors live: cpu, cuda, xpu (every rank on this device)")
    p.add_argument("--issue-async", type=int, default=0, metavar="N",
                   help="first time how long issuing N async 1 MiB all_reduces takes (xccl_rs; 0: not timed)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the number of iterations")
    p.add_argument("--fake-hosts", type=int, default=1, metavar="H",
                   help="xccl_rs: the ranks pose as H hosts (consecutive blocks, through XCCL_RS_HOST_ID)")
    p.add_argument("--peer", choices=["deepspeed"], help="also time this peer's all-reduce (SUM) where it supports the dtype")
    p.add_argument("--memory-bound", action="store_true",
                   help="also measure the copy bandwidth of as many concurrent copiers as ranks (each with the threads "
                        "an xccl_rs rank uses) and print each op's bound")
    p.add_argument("--json", metavar="PATH", help="write the results to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "zero-copy" in args.backends and args.device != "cpu":
        print("--backends zero-copy: not run (the heap holds CPU tensors)", flush=True)
        args.backends = [b for b in args.backends if b != "zero-copy"]
    if args.peer and args.device != "cpu":
        print(f"--peer {args.peer}: not run (it takes CPU tensors only)", flush=True)
        args.peer = None
    if args.peer == "deepspeed":
        from xccl_rs.bench_peers import build_deepspeed_op, deepspeed_available

        why = deepspeed_available()
        if why is None:
            _, why = build_deepspeed_op()  # once here, so that the ranks load the cached build
        if why is not None:
            print(f"--peer deepspeed: not run ({why})", flush=True)
            args.peer = None
    hosts = f" as {args.fake_hosts} hosts" if args.fake_hosts > 1 else ""
    print(f"xccl_rs.bench: {args.ranks} ranks{hosts}, {args.device} tensors, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    if args.memory_bound:
        from xccl_rs.bench_peers import copier_threads

        print(f"bound: {args.ranks} concurrent copiers of {copier_threads(args.ranks // args.fake_hosts)} threads each", flush=True)
    header = [f"{'op':<15}", f"{'dtype':<9}", f"{'size':>9}"]
    columns = _columns(args)
    for b in columns:
        header.append(f"{b + ' time(us)':>12} {'algbw':>7} {'busbw':>7}")
    if "gloo" in args.backends and "xccl_rs" in args.backends:
        header.append(f"{'vs gloo':>9}")
    if args.peer:
        header.append(f"{'vs ds':>9}")
        if "zero-copy" in args.backends:
            header.append(f"{'zc vs ds':>9}")
    print(" ".join(header))
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = []
    while True:
        if queue.empty():
            if any(proc.exitcode not in (None, 0) for proc in procs):
                print("a rank failed; stopping", file=sys.stderr, flush=True)
                for proc in procs:
                    proc.kill()
                return 1
            time.sleep(0.02)
            continue
        kind, row = queue.get()
        if kind == "done":
            break
        if kind == "note":
            for label in ("cold", "warm"):
                print(f"issuing {row['count']} async all_reduces of 1 MiB ({row['device']}, {label}): "
                      f"{row[label + '_issue_ms']:.2f} ms to return, {row[label + '_complete_ms']:.2f} ms to complete",
                      flush=True)
            rows.append(row)
            continue
        rows.append(row)
        _print_row(row, columns)
    for proc in procs:
        proc.join()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "device": args.device, "torch": torch.__version__, "cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0 if all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
