"""Collective benchmark: python -m xccl_rs.bench

Runs N local ranks and times all_reduce, broadcast, all_gather and reduce_scatter on gloo and
on xccl_rs side by side, in one run, over the same tensors, in the shape of nccl-tests'
all_reduce_perf: one line per size and backend with out-of-place and in-place columns (time,
algbw, busbw, #wrong), then closing lines with the wrong elements and the average bus
bandwidth. --json writes every field, each iteration's time included; --plot draws busbw
against size. --peer deepspeed adds DeepSpeed's CPU shared-memory all-reduce (when DeepSpeed
imports) and --memory-bound the bound the machine's copy bandwidth sets (bench_peers.py says
how both work); --backends ... zero-copy times xccl_rs on tensors from its shared-memory heap
(xccl_rs.empty).

Columns (n ranks):
  size     bytes of the op's buffer S (all_gather: the gathered output; reduce_scatter: the
           full input), B
  count    its elements; type: the dtype; redop: sum, avg or none; root: broadcast's, else -1
  time     the slowest rank's mean time per iteration over the timed iterations, us
  algbw    S / time, GB/s (10^9 bytes per second)
  busbw    algbw * the op's bus factor (nccl-tests' PERFORMANCE.md), GB/s:
             all_reduce 2(n-1)/n, broadcast 1, all_gather and reduce_scatter (n-1)/n
  #wrong   elements of the result that differ from the reference, summed over the ranks
  vs gloo  gloo's time / this line's (vs ds: DeepSpeed's time / this line's)

Out of place and in place: torch's all_reduce (SUM, and AVG as all_reduce_avg) and broadcast
work in place only, one tensor being input and output, so they fill the in-place columns and
out-of-place shows "-". all_gather (all_gather_into_tensor) and reduce_scatter
(reduce_scatter_tensor) run both: out of place on separate tensors, in place as nccl-tests
does, the input being this rank's slot of the output (all_gather) or the output this rank's
slot of the input (reduce_scatter).

The check, after the timed iterations: every rank fills its input from a seed of (op, dtype,
size, rank), fills its output with NaN, runs the op once and compares the result with a
reference computed with plain torch ops from every rank's input, regenerated locally (never
with a backend). Inputs are small integers, so sums are exact in every dtype and must match
exactly; AVG may differ by one rounding of the dtype. --no-check skips it (#wrong N/A).

Closing lines: the wrong elements of the whole run (exit status 1 if any), and per backend
its average bus bandwidth: the mean over its results (every op, dtype, size and mode) of busbw,
then the same mean of each result's per-iteration min, median and max busbw.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xccl_rs._processes import free_port

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
REDOP = {"all_reduce": "sum", "all_reduce_avg": "avg", "broadcast": "none", "all_gather": "none",
         "reduce_scatter": "sum"}
MODES = ("out_of_place", "in_place")
IN_PLACE_ONLY = ("all_reduce", "all_reduce_avg", "broadcast")  # torch's ops take one tensor
CHUNK = 1 << 20  # elements per step of filling and checking: bounds the reference's memory
# Testing the benchmark itself (hidden --inject wrong): rank 0 adds this to the first element of
# every result after the checked run, so #wrong must be > 0 and the exit status 1.
INJECTED_ERROR = 100.0


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


def iterations(nbytes: int, scale: float) -> int:
    """Enough repetitions for a stable median, few for huge tensors."""
    return max(3, min(200, int(scale * (256 << 20) / max(nbytes, 1 << 16))))


def modes(op: str) -> tuple[str, ...]:
    return ("in_place",) if op in IN_PLACE_ONLY else MODES


# ---------------------------------------------------------------- inputs and the reference


def pattern(key: int, start: int, stop: int, amplitude: int) -> torch.Tensor:
    """Elements [start, stop) of the input seeded by `key`: integers in [-amplitude, amplitude]
    (int64), a hash of (key, index), so that any slice can be made on its own."""
    h = torch.arange(start, stop, dtype=torch.int64).mul_(0x9E3779B1).add_(key).bitwise_and_(0xFFFFFFFF)
    h.bitwise_xor_(h >> 15).mul_(0x2C1B3C6D).bitwise_and_(0xFFFFFFFF)
    h.bitwise_xor_(h >> 12)
    return h.remainder_(2 * amplitude + 1).sub_(amplitude)


def shape(op: str, nbytes: int, dtype: torch.dtype, world: int) -> tuple[int, int, int]:
    """(per, count, size) of an op asked for `nbytes`: all_gather and reduce_scatter have `per`
    elements per rank and a buffer of `count = per * world` (the gathered output, the full
    input); all_reduce and broadcast one tensor of `count` (= per). `size`: the bytes of that
    buffer, S, which can exceed `nbytes` at tiny sizes (at least one element per rank)."""
    esz = torch.empty((), dtype=dtype).element_size()
    if op in ("all_gather", "reduce_scatter"):
        per = max(1, nbytes // esz // world)
        return per, per * world, per * world * esz
    count = max(1, nbytes // esz)
    return count, count, count * esz


class Case:
    """One op in one mode on this rank: its tensors, `run(group)`, `fill()` (the input from the
    seed, the output poisoned) and `wrong()` (the elements of the output that differ from the
    reference). Its sizes are `shape`'s."""

    def __init__(self, op, mode, nbytes, dtype, rank, world, device, heap=None, runner=None):
        self.op, self.mode, self.dtype, self.rank, self.world = op, mode, dtype, rank, world
        self.per, self.count, self.size = shape(op, nbytes, dtype, world)
        # Small integers: a sum over the ranks stays exact in bfloat16 (8-bit significand).
        self.amplitude = max(1, min(4, 256 // world))
        self.keys = [zlib.crc32(f"{op}/{dtype}/{self.count}/{r}".encode()) for r in range(world)]
        if heap is not None:
            import xccl_rs

            def alloc(n):
                return xccl_rs.empty((n,), dtype=dtype, group=heap)
        else:
            def alloc(n):
                return torch.empty((n,), dtype=dtype, device=device)
        in_place = mode == "in_place"
        lo, hi = rank * self.per, (rank + 1) * self.per
        if op in IN_PLACE_ONLY:
            self.inp = self.out = alloc(self.count)
        elif op == "all_gather":
            self.out = alloc(self.count)
            self.inp = self.out[lo:hi] if in_place else alloc(self.per)
        elif op == "reduce_scatter":
            self.inp = alloc(self.count)
            self.out = self.inp[lo:hi] if in_place else alloc(self.per)
        else:
            raise ValueError(op)
        self.runner = runner

    def run(self, group) -> None:
        if self.runner is not None:
            self.runner(self.inp)
        elif self.op in ("all_reduce", "all_reduce_avg"):
            reduce_op = dist.ReduceOp.AVG if self.op == "all_reduce_avg" else dist.ReduceOp.SUM
            dist.all_reduce(self.inp, op=reduce_op, group=group)
        elif self.op == "broadcast":
            dist.broadcast(self.inp, src=dist.get_global_rank(group, 0), group=group)
        elif self.op == "all_gather":
            dist.all_gather_into_tensor(self.out, self.inp, group=group)
        else:
            dist.reduce_scatter_tensor(self.out, self.inp, group=group)

    def fill(self) -> None:
        """The output NaN (a result that is not written cannot pass), then the input from this
        rank's seed (broadcast: only the root's; the others' tensor stays NaN)."""
        self.out.fill_(float("nan"))
        if self.op == "broadcast" and self.rank != 0:
            return
        for a in range(0, self.inp.numel(), CHUNK):
            b = min(a + CHUNK, self.inp.numel())
            self.inp[a:b].copy_(pattern(self.keys[self.rank], a, b, self.amplitude))

    def expected(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of this rank's correct output, float64, from every rank's input."""
        amp, keys = self.amplitude, self.keys
        if self.op in ("all_reduce", "all_reduce_avg"):
            ref = sum(pattern(k, a, b, amp) for k in keys).double()
            return ref / self.world if self.op == "all_reduce_avg" else ref
        if self.op == "broadcast":
            return pattern(keys[0], a, b, amp).double()
        if self.op == "reduce_scatter":
            lo = self.rank * self.per
            return sum(pattern(k, lo + a, lo + b, amp) for k in keys).double()
        # all_gather: slot r of the output is rank r's input
        parts, i = [], a
        while i < b:
            r, off = divmod(i, self.per)
            j = min(b, (r + 1) * self.per)
            parts.append(pattern(keys[r], off, off + j - i, amp))
            i = j
        return torch.cat(parts).double()

    def wrong(self) -> int:
        """Elements of the output that differ from the reference: exactly (sums of small
        integers are exact in every dtype), or for AVG beyond one rounding of the dtype."""
        bad = 0
        eps = torch.finfo(self.dtype).eps
        for a in range(0, self.out.numel(), CHUNK):
            b = min(a + CHUNK, self.out.numel())
            got = self.out[a:b].to("cpu", torch.float64)
            exp = self.expected(a, b)
            if self.op == "all_reduce_avg":
                ok = (got - exp).abs() <= eps * exp.abs()
            else:
                ok = got == exp.to(self.dtype).double()
            bad += int((~ok).sum())
        return bad


# ---------------------------------------------------------------- timing


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


def _iteration_seconds(run, iters: int, device: torch.device) -> list[float]:
    """This rank's time of each of `iters` back-to-back calls of `run()`: host clock stamps
    between the calls on CPU; on a device, events recorded on the current stream between the
    calls (no synchronisation in the loop, so the calls pipeline as they would without
    timing)."""
    if device.type == "cpu":
        stamps = [time.perf_counter()]
        for _ in range(iters):
            run()
            stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]
    if hasattr(torch, "Event"):  # torch >= 2.4: device-generic
        events = [torch.Event(device=device, enable_timing=True) for _ in range(iters + 1)]
    else:
        events = [getattr(torch, device.type).Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for e in events[1:]:
        run()
        e.record()
    events[-1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]


def _time(run, group, iters, device, control) -> tuple[list[float], int]:
    """The time of each iteration of `run(group)` (seconds) on the slowest rank (the one whose
    mean is the largest), and that rank; all ranks start together. One rank's iterations, not
    the slowest of each iteration over the ranks: ranks in lock-step often alternate short and
    long iterations out of phase (one waits while the other works), and the maximum of each
    pair would count every iteration as a long one."""
    dist.barrier(group=control)
    own = torch.tensor(_iteration_seconds(lambda: run(group), iters, device), dtype=torch.float64)
    every = [torch.empty_like(own) for _ in range(dist.get_world_size(control))]
    dist.all_gather(every, own, group=control)
    slowest = max(range(len(every)), key=lambda r: every[r].mean().item())
    return every[slowest].tolist(), slowest


def result(secs: list[float], size: int, factor: float) -> dict:
    """time, algbw and busbw of one result (its mean), the spread of busbw over its
    iterations, and every iteration's time."""
    mean = statistics.fmean(secs)
    algbw = size / mean / 1e9
    busbws = [size / s / 1e9 * factor for s in secs]
    return {"time_us": mean * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor,
            "busbw_GBps_min": min(busbws), "busbw_GBps_median": statistics.median(busbws),
            "busbw_GBps_max": max(busbws), "times_us": [s * 1e6 for s in secs]}


def _measure(case: Case, group, name: str, iters: int, device, control, args, rank: int) -> dict | None:
    """One result: warm-up, timed iterations, then the check. None if the backend cannot
    run the op (told on rank 0)."""
    failed = torch.zeros(1)
    try:
        case.fill()
        for _ in range(max(1, iters // 10)):
            case.run(group)
        _sync(device)
    except RuntimeError as e:  # gloo lacks some ops on device tensors
        if rank == 0:
            mode = case.mode.replace("_", "-")
            print(f"# {name} {case.op} {mode} on {device}: not run ({str(e).splitlines()[0][:100]})", flush=True)
        failed.fill_(1)
    dist.all_reduce(failed, group=control)
    if failed.item():
        return None
    secs, slowest = _time(case.run, group, iters, device, control)
    out = result(secs, case.size, BUS_FACTOR[case.op](case.world))
    out["slowest_rank"] = slowest
    out["wrong"] = None
    if args.check:
        case.fill()
        case.run(group)
        _sync(device)
        if args.inject == "wrong" and rank == 0:
            case.out.view(-1)[:1].add_(INJECTED_ERROR)
        wrong = torch.tensor([case.wrong()], dtype=torch.float64)
        dist.all_reduce(wrong, group=control)
        out["wrong"] = int(wrong.item())
    return out


def _entry(results: dict, op: str) -> dict:
    """A backend's results for one (op, dtype, size): time, algbw and busbw of its main mode
    (in place for torch's in-place ops, else out of place), the wrong elements of both, and
    each mode's result."""
    main = results.get("in_place") if op in IN_PLACE_ONLY else (results.get("out_of_place") or results.get("in_place"))
    wrongs = [r["wrong"] for r in results.values() if r.get("wrong") is not None]
    entry = {k: main[k] for k in ("time_us", "algbw_GBps", "busbw_GBps")}
    entry["wrong"] = sum(wrongs) if wrongs else None
    for mode in MODES:
        entry[mode] = results.get(mode)
    return entry


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
    if args.issue_async and "xccl_rs" in groups:
        note = _issue_async(groups["xccl_rs"], control, device, args.issue_async)
        if rank == 0:
            queue.put(("note", note))
    for op in args.ops:
        for dname in args.dtypes:
            dtype = DTYPES[dname]
            for size_text in args.sizes:
                nbytes = parse_size(size_text)
                iters = iterations(nbytes, args.scale)
                _, count, size = shape(op, nbytes, dtype, world)
                row = {"op": op, "dtype": dname, "bytes": nbytes, "size": size, "count": count,
                       "redop": REDOP[op], "root": 0 if op == "broadcast" else -1, "ranks": world, "iters": iters}
                for name, group in groups.items():
                    heap = group if name == "zero-copy" else None
                    results = {}
                    for mode in modes(op):
                        case = Case(op, mode, nbytes, dtype, rank, world, device, heap)
                        r = _measure(case, group, name, iters, device, control, args, rank)
                        del case
                        if r is not None:
                            results[mode] = r
                    if results:
                        row[name] = _entry(results, op)
                if peer is not None and peer.supports(op, dname) is None:
                    case = Case(op, "in_place", nbytes, dtype, rank, world, device, runner=peer.all_reduce_)
                    r = _measure(case, None, "deepspeed", iters, device, control, args, rank)
                    del case
                    if r is not None:
                        row["deepspeed"] = _entry({"in_place": r}, op)
                if args.memory_bound:
                    size = row["size"]
                    per_rank = copy_bandwidth(size, iters, control, copier_threads(world // args.fake_hosts))
                    sec = size * BUS_FACTOR[op](world) / per_rank
                    bound = {"time_us": sec * 1e6, "algbw_GBps": size / sec / 1e9, "busbw_GBps": per_rank / 1e9}
                    row["bound"] = {**bound, "wrong": None, **{m: (dict(bound) if m in modes(op) else None) for m in MODES}}
                if "gloo" in row and "xccl_rs" in row:
                    row["speedup"] = row["gloo"]["time_us"] / row["xccl_rs"]["time_us"]
                if "deepspeed" in row and "xccl_rs" in row:
                    row["vs_deepspeed"] = row["deepspeed"]["time_us"] / row["xccl_rs"]["time_us"]
                if "deepspeed" in row and "zero-copy" in row:
                    row["zero_copy_vs_deepspeed"] = row["deepspeed"]["time_us"] / row["zero-copy"]["time_us"]
                if rank == 0:
                    queue.put(("row", row))
    if rank == 0:
        queue.put(("done", None))
    dist.barrier(group=control)
    dist.destroy_process_group()


# ---------------------------------------------------------------- the parent: the table


def _columns(args) -> list[str]:
    """The lines of each size, top to bottom: the backends, then the peer, then the bound."""
    return list(args.backends) + (["deepspeed"] if args.peer else []) + (["bound"] if args.memory_bound else [])


LEAD = f"{'':>12} {'':>12} {'':>9} {'':>6} {'':>5} {'':>10}"


def header_lines(args) -> list[str]:
    """The table's header, nccl-tests' shape: the modes, the column names, their units."""
    mode_w = 9 + 1 + 7 + 1 + 7 + 1 + 6
    names = (f"{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5} {'backend':>10}"
             + f" {'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}" * 2)
    units = (f"{'(B)':>12} {'(elements)':>12} {'':>9} {'':>6} {'':>5} {'':>10}"
             + f" {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}" * 2)
    ratios = _ratio_names(args)
    for name in ratios:
        names += f" {name:>8}"
        units += f" {'(x)':>8}"
    return [f"#{LEAD[1:]} {'out-of-place':^{mode_w}} {'in-place':^{mode_w}}".rstrip(),
            "#" + names[1:], "#" + units[1:].rstrip()]


def _ratio_names(args) -> list[str]:
    out = ["vs gloo"] if "gloo" in args.backends and len(args.backends) > 1 else []
    return out + (["vs ds"] if args.peer else [])


def _mode_cells(r: dict | None, check: bool) -> str:
    if r is None:
        return f" {'-':>9} {'-':>7} {'-':>7} {'-':>6}"
    wrong = "N/A" if r.get("wrong") is None else str(r["wrong"])
    if "times_us" not in r:  # the bound: nothing to check
        wrong = "-"
    elif not check:
        wrong = "N/A"
    return f" {r['time_us']:>9.1f} {r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f} {wrong:>6}"


def row_lines(row: dict, args) -> list[str]:
    lines = []
    for b in _columns(args):
        e = row.get(b)
        if e is None:
            continue
        line = (f"{row['size']:>12} {row['count']:>12} {row['dtype']:>9} {row['redop']:>6} {row['root']:>5} {b:>10}"
                + "".join(_mode_cells(e.get(m), args.check) for m in MODES))
        for name in _ratio_names(args):
            ref = row.get("gloo" if name == "vs gloo" else "deepspeed")
            shown = f"{ref['time_us'] / e['time_us']:.2f}" if ref and b not in ("gloo", "deepspeed", "bound") else ""
            line += f" {shown:>8}"
        lines.append(line.rstrip())
    return lines


def _section(op: str) -> str:
    what = {
        "all_reduce": "all_reduce, ReduceOp.SUM: torch's all_reduce is in place (in-place columns only)",
        "all_reduce_avg": "all_reduce, ReduceOp.AVG: torch's all_reduce is in place (in-place columns only)",
        "broadcast": "broadcast from rank 0: torch's broadcast is in place (in-place columns only)",
        "all_gather": "all_gather_into_tensor (size: the gathered output; in place: the input is this rank's slot of it)",
        "reduce_scatter": "reduce_scatter_tensor, ReduceOp.SUM (size: the full input; in place: the output is this "
                          "rank's slot of it)",
    }[op]
    return f"# {what}"


def summary(rows: list[dict], backends: list[str]) -> dict:
    """Per backend: the mean over its results (op, dtype, size, mode) of busbw and of each
    result's per-iteration min, median and max busbw; and the wrong elements of the run."""
    out = {"backends": {}, "wrong": 0, "wrong_results": [], "checked": False}
    for b in backends:
        stats = []
        for row in rows:
            for mode in MODES:
                r = (row.get(b) or {}).get(mode)
                if r is None or "times_us" not in r:
                    continue
                stats.append((r["busbw_GBps"], r["busbw_GBps_min"], r["busbw_GBps_median"], r["busbw_GBps_max"]))
                if r.get("wrong") is not None:
                    out["checked"] = True
                    out["wrong"] += r["wrong"]
                    if r["wrong"]:
                        out["wrong_results"].append(
                            f"{row['op']} {row['dtype']} {row['size']} B {b} {mode.replace('_', '-')}: {r['wrong']}")
        if stats:
            avg, lo, med, hi = (statistics.fmean(s[i] for s in stats) for i in range(4))
            out["backends"][b] = {"avg_busbw_GBps": avg, "min_GBps": lo, "median_GBps": med, "max_GBps": hi,
                                  "results": len(stats)}
    return out


def closing_lines(s: dict) -> list[str]:
    if not s["checked"]:
        lines = ["# Wrong elements       : not checked (--no-check)"]
    elif s["wrong"]:
        lines = [f"# Wrong elements       : {s['wrong']} FAILED in {len(s['wrong_results'])} results: "
                 + "; ".join(s["wrong_results"][:10]) + (" ..." if len(s["wrong_results"]) > 10 else "")]
    else:
        lines = ["# Wrong elements       : 0 OK"]
    width = max((len(b) for b in s["backends"]), default=0)
    for b, v in s["backends"].items():
        lines.append(f"# Avg bus bandwidth    : {b:<{width}} {v['avg_busbw_GBps']:.3f} GB/s  (per iteration: "
                     f"min {v['min_GBps']:.3f}, median {v['median_GBps']:.3f}, max {v['max_GBps']:.3f}; "
                     f"mean over {v['results']} results)")
    return lines


def plot(path: str, rows: list[dict], backends: list[str]) -> None:
    """busbw against size, one panel per op, one line per backend (its colour, the same in every
    panel), dtype (its marker) and mode (out of place solid, in place dashed)."""
    try:  # main() refuses --plot up front where matplotlib is missing
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib (pip install matplotlib): {e}") from e

    ops = list(dict.fromkeys(r["op"] for r in rows if "size" in r))
    cols = min(3, max(1, len(ops)))
    nrows = max(1, math.ceil(len(ops) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows if "size" in r))
    for ax, op in zip(axes.flat, ops):
        for colour, b in enumerate(backends):
            for dname in dtypes:
                for mode in MODES:
                    pts = sorted((r["size"], r[b][mode]["busbw_GBps"]) for r in rows
                                 if r.get("op") == op and r["dtype"] == dname and (r.get(b) or {}).get(mode))
                    if pts:
                        ax.plot(*zip(*pts), color=f"C{colour}", marker="os^vD"[dtypes.index(dname) % 5],
                                linestyle="-" if mode == "out_of_place" else "--",
                                label=f"{b} {dname} {mode.replace('_', '-')}")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("size (B)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not check the results against the reference (#wrong N/A); the check makes every "
                        "rank's input on each rank, which takes longer than the op at the largest sizes")
    p.add_argument("--json", metavar="PATH", help="write every field to this file, each iteration's time included")
    p.add_argument("--plot", metavar="PNG", help="draw busbw against size for every backend to this file (needs matplotlib)")
    # Testing the benchmark itself: rank 0 corrupts one element of every result after the checked
    # run (INJECTED_ERROR), so #wrong must be > 0 and the exit status 1 (python_tests/test_bench.py).
    p.add_argument("--inject", choices=["wrong"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib, which is not installed here (pip install matplotlib)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "zero-copy" in args.backends and args.device != "cpu":
        print("# --backends zero-copy: not run (the heap holds CPU tensors)", flush=True)
        args.backends = [b for b in args.backends if b != "zero-copy"]
    if args.peer and args.device != "cpu":
        print(f"# --peer {args.peer}: not run (it takes CPU tensors only)", flush=True)
        args.peer = None
    if args.peer == "deepspeed":
        from xccl_rs.bench_peers import build_deepspeed_op, deepspeed_available

        why = deepspeed_available()
        if why is None:
            _, why = build_deepspeed_op()  # once here, so that the ranks load the cached build
        if why is not None:
            print(f"# --peer deepspeed: not run ({why})", flush=True)
            args.peer = None
    hosts = f" as {args.fake_hosts} hosts" if args.fake_hosts > 1 else ""
    print(f"# xccl_rs.bench: {args.ranks} ranks{hosts}, {args.device} tensors, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs; check: {'on' if args.check else 'off'}", flush=True)
    if args.memory_bound:
        from xccl_rs.bench_peers import copier_threads

        print(f"# bound: {args.ranks} concurrent copiers of {copier_threads(args.ranks // args.fake_hosts)} threads each",
              flush=True)
    print("#")
    for line in header_lines(args):
        print(line)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows, notes, op_shown = [], [], None
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
                print(f"# issuing {row['count']} async all_reduces of 1 MiB ({row['device']}, {label}): "
                      f"{row[label + '_issue_ms']:.2f} ms to return, {row[label + '_complete_ms']:.2f} ms to complete",
                      flush=True)
            notes.append(row)
            continue
        rows.append(row)
        if row["op"] != op_shown:
            print(_section(row["op"]), flush=True)
            op_shown = row["op"]
        for line in row_lines(row, args):
            print(line, flush=True)
    for proc in procs:
        proc.join()
    s = summary(rows, [b for b in _columns(args) if b != "bound"])
    for line in closing_lines(s):
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "device": args.device, "torch": torch.__version__, "cpus": os.cpu_count(),
                       "check": args.check, "rows": notes + rows, "summary": s}, f, indent=1)
    if args.plot:
        plot(args.plot, rows, _columns(args))
        print(f"# plot: {args.plot}", flush=True)
    if any(proc.exitcode != 0 for proc in procs):
        return 1
    return 1 if s["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
