"""The soak: python -m xccl_rs.soak (docs/reliability.md, the soak).

Starts N rank processes (default 4) on this host. In each, three groups run at once, one Python
thread per group, each issuing its own random sequence of c10d collectives:

  shm      the default world, ``init_process_group("xccl_rs")``: one host, so shared memory
  tcp      ``dist.new_group(backend="xccl_rs")`` created under ``XCCL_RS_TRANSPORT=tcp``
  private  ``xccl_rs.new_group`` on a store of its own

Every rank draws the same sequence per group from the seed (op, dtype, size, root, reduce op,
splits), so the ranks agree without talking. A rank's input to op i is a deterministic function
of (seed, group, i, rank), so for every ``--check-every``-th op each rank regenerates all inputs
and computes the expected result with plain torch ops (never with xccl_rs), and counts
wrong results. Values are small integers so every result is exact (see ``_values``).

Every ``--interval`` seconds each rank samples its RSS, open fds, threads and mappings of
/dev/shm, and rank 0 the /dev/shm entries. After the warm-up (the first ``--warmup`` of the
samples) a least-squares slope is fitted per metric and rank. Before the first sample each group
runs one all-to-all of one element per rank: TCP links are made on first use (src/peers.rs), and
a link that first carries an op after the samples began would read as a leaked fd. The run passes when no result is
wrong, fds, threads, mappings and /dev/shm entries keep no growth after the warm-up (the last
quarter of the samples never all above the start; a peak that goes away is not growth), RSS
does not grow (fitted) by more than ``max(--rss-tol-mib, --rss-tol-pct of the RSS)``, and
/dev/shm has no entry of the ranks left after they exit.

RSS is judged by ``rss_verdict``: a run long enough to tell a leak from the allocator settling
(``--rss-min-ops`` ops after the warm-up) on the second half of its samples after the warm-up,
where growth beyond the tolerance fails it if it is beyond the samples' jitter and not slowing
down; a shorter run on all its samples after the warm-up, where growth beyond the tolerance is
INCONCLUSIVE. Exit status 0 on a pass, 1 on a failure, 3 when inconclusive (and nothing failed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import queue as queue_mod
import random
import subprocess
import sys
import threading
import time
import traceback
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xccl_rs._processes import free_port

GROUPS = ("shm", "tcp", "private")
DTYPES = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8,
}
FLOATS = {"float32", "float64", "bfloat16", "float16"}
REDUCE_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT", "PREMUL_SUM")
# (op, weight): the rooted and all-to-all ops come in two flavours each.
OPS = (
    ("all_reduce", 6), ("broadcast", 2), ("reduce", 2), ("all_gather", 1), ("all_gather_into_tensor", 2),
    ("reduce_scatter", 1), ("reduce_scatter_tensor", 2), ("all_to_all_single", 1), ("all_to_all_uneven", 1),
    ("gather", 1), ("scatter", 1), ("send_recv", 2), ("barrier", 1),
)
METRICS = ("rss", "fds", "threads", "shm_maps", "shm_entries", "shm_total")
EXACT_METRICS = ("fds", "threads", "shm_maps", "shm_entries")  # must not grow at all
STOP_EVERY = 25  # --seconds: the ranks of a group agree every this many ops whether to stop
MiB = 1 << 20
EXIT = {"pass": 0, "fail": 1, "inconclusive": 3}  # 2 is argparse's usage error


# ---------------------------------------------------------------- the op sequence and the data


def draw_op(rng: random.Random, world: int, max_bytes: int) -> dict:
    """One op of a group's sequence, the same on every rank (rng is seeded alike everywhere)."""
    op = rng.choices([o for o, _ in OPS], [w for _, w in OPS])[0]
    dname = rng.choice(list(DTYPES))
    spec = {"op": op, "dtype": dname, "root": rng.randrange(world), "reduce": "SUM", "factor": 1.0}
    if op in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"):
        valid = [r for r in REDUCE_OPS if r != "PREMUL_SUM" or dname in FLOATS]
        spec["reduce"] = rng.choice(valid)
        spec["factor"] = rng.choice((0.25, 0.5, 2.0))  # powers of two: PREMUL_SUM stays exact
    # Log-uniform in bytes from 1 to max_bytes, and 5% of the ops with no elements at all.
    nbytes = int(2 ** rng.uniform(0, math.log2(max(max_bytes, 2))))
    esz = torch.empty(0, dtype=DTYPES[dname]).element_size()
    numel = 0 if rng.random() < 0.05 else nbytes // esz
    # The largest buffer of an op stays within max_bytes: ops with a buffer n times a rank's
    # share get numel // n per rank.
    per = numel // world
    spec["numel"] = numel if op in ("all_reduce", "broadcast", "reduce", "send_recv") else per
    if op == "all_to_all_uneven":  # splits[src][dst] elements, zeros included
        spec["splits"] = [[rng.randrange(0, 2 * per + 1) for _ in range(world)] for _ in range(world)]
    if op == "send_recv":
        spec["dst"] = rng.choice([r for r in range(world) if r != spec["root"]] or [spec["root"]])
    return spec


def _values(spec: dict) -> tuple[int, int]:
    """The range [lo, hi] of input values that keeps the op's result exact in its dtype:
    sums of |x| <= 16 over <= 16 ranks fit bf16's 8-bit significand; products of values in
    {-2..2} are 0 or +-2^k; integer AVG (integer division of the sum) gets non-negative data
    so that truncation and floor agree; uint8 sums and averages stay below 256."""
    d, r = spec["dtype"], spec["reduce"]
    reducing = spec["op"] in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
    if not reducing:
        return (0, 255) if d == "uint8" else (-100, 100)
    if r == "PRODUCT":
        return (0, 3) if d == "uint8" else (-2, 2)
    if d == "uint8":
        return (0, 255 // spec["world"])
    if r == "AVG" and d not in FLOATS:
        return (0, 16)
    return (-16, 16)


def make_input(spec: dict, seed: int, group: str, index: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s input to op `index` of `group`: a pure function of its arguments, so any
    rank can regenerate any other rank's input for the reference."""
    numel = input_numel(spec, rank)
    key = zlib.crc32(f"{seed}/{group}/{index}/{rank}".encode())
    gen = torch.Generator().manual_seed(key)
    lo, hi = _values(spec)
    return torch.randint(lo, hi + 1, (numel,), generator=gen, dtype=torch.int64).to(DTYPES[spec["dtype"]])


def input_numel(spec: dict, rank: int) -> int:
    n, w, op = spec["numel"], spec["world"], spec["op"]
    if op in ("reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "scatter"):
        return n * w  # n is a rank's share
    if op == "all_to_all_uneven":
        return sum(spec["splits"][rank])
    return n


def reduce_ref(xs: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The reduction of the ranks' inputs in float64 / int64, then cast: independent of xccl_rs."""
    dtype = DTYPES[spec["dtype"]]
    wide = torch.float64 if spec["dtype"] in FLOATS else torch.int64
    stack = torch.stack([x.to(wide) for x in xs]) if xs[0].numel() else torch.zeros(len(xs), 0, dtype=wide)
    r = spec["reduce"]
    if r in ("SUM", "AVG", "PREMUL_SUM"):
        out = stack.sum(0)
        if r == "PREMUL_SUM":
            out = out * spec["factor"]
        elif r == "AVG":
            out = out / len(xs) if wide == torch.float64 else torch.div(out, len(xs), rounding_mode="floor")
    elif r == "PRODUCT":
        out = stack.prod(0)
    elif r == "MIN":
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    if dtype == torch.uint8:
        out = out & 0xFF  # uint8 wraps, as the backend's does
    return out.to(dtype)


def expected(spec: dict, xs: list[torch.Tensor], rank: int):
    """What rank `rank` must hold after the op, given every rank's input `xs` (None: nothing)."""
    op, w, n, root = spec["op"], spec["world"], spec["numel"], spec["root"]
    if op == "all_reduce":
        return reduce_ref(xs, spec)
    if op == "broadcast":
        return xs[root]
    if op == "reduce":
        return reduce_ref(xs, spec) if rank == root else xs[rank]  # non-roots: unchanged
    if op in ("all_gather", "all_gather_into_tensor"):
        return torch.cat(xs)
    if op in ("reduce_scatter", "reduce_scatter_tensor"):
        return reduce_ref([x[rank * n:(rank + 1) * n] for x in xs], spec)
    if op == "all_to_all_single":
        return torch.cat([x[rank * n:(rank + 1) * n] for x in xs])
    if op == "all_to_all_uneven":
        s = spec["splits"]
        return torch.cat([xs[j][sum(s[j][:rank]):sum(s[j][:rank + 1])] for j in range(w)])
    if op == "gather":
        return torch.cat(xs) if rank == root else None
    if op == "scatter":
        return xs[root][rank * n:(rank + 1) * n]
    if op == "send_recv":
        return xs[spec["root"]] if rank == spec["dst"] else None
    return None  # barrier


def dist_reduce_op(spec: dict):
    if spec["reduce"] == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(spec["factor"])
    return getattr(dist.ReduceOp, spec["reduce"])


ROOTED = ("broadcast", "reduce", "gather", "scatter", "send_recv")


def _registered(pg) -> bool:
    """Whether torch.distributed knows the group (its functions translate group ranks only
    for those); the private group is not registered."""
    try:
        dist.get_group_rank(pg, 0)
        return True
    except (ValueError, RuntimeError):
        return False


def _run_rooted_unregistered(spec: dict, x: torch.Tensor, pg, rank: int):
    """The rooted ops and send/recv on a group torch.distributed does not know: the
    ProcessGroup's own methods, in group ranks."""
    op, w, n, root = spec["op"], spec["world"], spec["numel"], spec["root"]
    if op == "broadcast":
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pg.broadcast([x], opts).wait()
        return x
    if op == "reduce":
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = root, dist_reduce_op(spec)
        pg.reduce([x], opts).wait()
        return x
    if op == "gather":
        opts = dist.GatherOptions()
        opts.rootRank = root
        outs = [torch.empty(n, dtype=x.dtype) for _ in range(w)] if rank == root else []
        pg.gather([outs] if rank == root else [], [x], opts).wait()
        return torch.cat(outs) if rank == root else None
    if op == "scatter":
        opts = dist.ScatterOptions()
        opts.rootRank = root
        out = torch.empty(n, dtype=x.dtype)
        chunks = list(x.split(n)) if n else [x[:0]] * w
        pg.scatter([out], [chunks] if rank == root else [], opts).wait()
        return out
    if rank == root:
        pg.send([x], spec["dst"], 0).wait()
    elif rank == spec["dst"]:
        out = torch.empty_like(x)
        pg.recv([out], root, 0).wait()
        return out
    return None


def run_op(spec: dict, x: torch.Tensor, pg, rank: int):
    """Runs the op on group `pg` with this rank's input `x`; returns this rank's result (as
    `expected` describes it). Group ranks throughout (group_src/group_dst): the private group
    is not registered with torch.distributed."""
    op, w, n, root = spec["op"], spec["world"], spec["numel"], spec["root"]
    dtype = x.dtype
    if op in ROOTED and not _registered(pg):
        return _run_rooted_unregistered(spec, x, pg, rank)
    if op == "all_reduce":
        dist.all_reduce(x, op=dist_reduce_op(spec), group=pg)
        return x
    if op == "broadcast":
        dist.broadcast(x, group_src=root, group=pg)
        return x
    if op == "reduce":
        dist.reduce(x, group_dst=root, op=dist_reduce_op(spec), group=pg)
        return x
    if op == "all_gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(w)]
        dist.all_gather(outs, x, group=pg)
        return torch.cat(outs)
    if op == "all_gather_into_tensor":
        out = torch.empty(n * w, dtype=dtype)
        dist.all_gather_into_tensor(out, x, group=pg)
        return out
    if op == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, list(x.split(n)) if n else [x[:0]] * w, op=dist_reduce_op(spec), group=pg)
        return out
    if op == "reduce_scatter_tensor":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, x, op=dist_reduce_op(spec), group=pg)
        return out
    if op == "all_to_all_single":
        out = torch.empty(n * w, dtype=dtype)
        dist.all_to_all_single(out, x, group=pg)
        return out
    if op == "all_to_all_uneven":
        s = spec["splits"]
        incoming = [s[j][rank] for j in range(w)]
        out = torch.empty(sum(incoming), dtype=dtype)
        dist.all_to_all_single(out, x, output_split_sizes=incoming, input_split_sizes=s[rank], group=pg)
        return out
    if op == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(w)] if rank == root else None
        dist.gather(x, outs, group_dst=root, group=pg)
        return torch.cat(outs) if rank == root else None
    if op == "scatter":
        out = torch.empty(n, dtype=dtype)
        chunks = (list(x.split(n)) if n else [x[:0]] * w) if rank == root else None
        dist.scatter(out, chunks, group_src=root, group=pg)
        return out
    if op == "send_recv":  # one pair; the other ranks go on to the next op
        if rank == root:
            dist.send(x, group_dst=spec["dst"], group=pg)
        elif rank == spec["dst"]:
            out = torch.empty_like(x)
            dist.recv(out, group_src=root, group=pg)
            return out
        return None
    dist.barrier(group=pg)
    return None


# ---------------------------------------------------------------- one rank


def _shm_maps() -> int:
    """Mappings of xccl_rs shared-memory segments in this process (unlinked ones included)."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/xccl_rs" in line for line in f)


def sample(rank: int, ops_done: int) -> dict:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    s = {"t": time.time(), "ops": ops_done, "rss": rss, "fds": len(os.listdir("/proc/self/fd")),
         "threads": len(os.listdir("/proc/self/task")), "shm_maps": _shm_maps()}
    if rank == 0:  # /dev/shm is one per host: one rank looks
        entries = os.listdir("/dev/shm")
        s["shm_entries"] = sum(e.startswith("xccl_rs") for e in entries)
        s["shm_total"] = len(entries)
    return s


class GroupRunner(threading.Thread):
    """Issues one group's op sequence on this rank, checking a sample of the results."""

    def __init__(self, name, pg, rank, world, args, deadline, inject):
        super().__init__(name=f"soak-{name}", daemon=True)
        self.gname, self.pg, self.rank, self.world, self.args = name, pg, rank, world, args
        self.deadline, self.inject = deadline, inject
        self.done = self.checked = self.wrong = 0
        self.mismatches: list[str] = []
        self.counts: dict[str, int] = {}
        self.error: str | None = None
        self.leak: list = []  # --inject: what the deliberate leak keeps alive

    def run(self):
        try:
            self._run()
        except BaseException:  # reported by the rank's main thread, never swallowed
            self.error = f"group {self.gname}, op {self.done}: {traceback.format_exc()}"

    def _stop_here(self, i: int) -> bool:
        if self.args.seconds is None:
            return i >= self.args.ops_per_group
        if i % STOP_EVERY:
            return False
        # Every rank must stop after the same op: they agree (MAX) on whether anyone is past
        # the time limit. Not counted as an op of the soak.
        flag = torch.tensor([int(time.time() >= self.deadline)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pg)
        return bool(flag.item())

    def _run(self):
        seed, rank, world = self.args.seed, self.rank, self.world
        rng = random.Random(f"{seed}/{self.gname}")
        i = 0
        while not self._stop_here(i):
            spec = draw_op(rng, world, self.args.max_bytes)
            spec["world"] = world
            x = make_input(spec, seed, self.gname, i, rank)
            got = run_op(spec, x, self.pg, rank)
            self.counts[spec["op"]] = self.counts.get(spec["op"], 0) + 1
            if i % self.args.check_every == 0:
                self._check(spec, i, got)
            self._leak(i)
            i += 1
            self.done = i

    def _check(self, spec, i, got):
        xs = [make_input(spec, self.args.seed, self.gname, i, r) for r in range(self.world)]
        want = expected(spec, xs, self.rank)
        if self.inject == "wrong" and want is not None and want.numel():
            want = want.clone()
            want.view(-1)[0] += 1  # a deliberately wrong reference: the check must notice
        self.checked += 1
        if want is None:
            return
        ok = got is not None and got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        if not ok:
            self.wrong += 1
            if len(self.mismatches) < 5:
                detail = "" if got is None or got.shape != want.shape else (
                    f", first differing element {int((got != want).nonzero()[0])}")
                shown = {k: v for k, v in spec.items() if k != "splits"}
                self.mismatches.append(f"{self.gname} op {i} on rank {self.rank}: {shown}{detail}")

    def _leak(self, i):
        """--inject (the soak's own mutation checks): leak something every 50 ops."""
        if not self.inject or i % 50 != 49:
            return
        if self.inject == "fd":
            self.leak.append(open(os.devnull))
        elif self.inject == "rss":
            self.leak.append(torch.ones(256 << 10, dtype=torch.uint8))  # 256 KiB per 50 ops


def link_every_pair(pg, world: int) -> None:
    """One all-to-all of one element per rank: every pair of the group carries a message, so
    every link made on first use is made now, not counted as growth. Not an op of the soak."""
    dist.all_to_all_single(torch.empty(world), torch.zeros(world), group=pg)


def rank_main(rank: int, world: int, ports: tuple[int, int], args, out) -> None:
    try:
        _rank_main(rank, world, ports, args, out)
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        out.close()
        out.join_thread()  # the queue's feeder thread must deliver the report before _exit
        sys.stderr.flush()
        os._exit(1)  # other threads may be blocked in collectives: do not wait for them
    out.close()
    out.join_thread()  # deliver the result before _exit
    os._exit(0)


def _rank_main(rank, world, ports, args, out):
    import xccl_rs

    torch.set_num_threads(1)  # the ranks share the cores; torch's own pool would oversubscribe
    timeout = timedelta(seconds=args.timeout)
    before = sample(rank, 0)
    store = dist.TCPStore("127.0.0.1", ports[0], world, rank == 0, timeout=timeout)
    maps = {"start": _shm_maps()}
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timeout)
    dist.barrier()
    maps["shm"] = _shm_maps()
    # XCCL_RS_TRANSPORT is read when a group is created: set only around this one.
    os.environ["XCCL_RS_TRANSPORT"] = "tcp"
    try:
        tcp = dist.new_group(backend="xccl_rs", timeout=timeout)
        dist.barrier(group=tcp)
    finally:
        del os.environ["XCCL_RS_TRANSPORT"]
    maps["tcp"] = _shm_maps()
    pstore = dist.TCPStore("127.0.0.1", ports[1], world, rank == 0, timeout=timeout)
    private = xccl_rs.new_group(dist.PrefixStore("soak/", pstore), rank, world, timeout=timeout)
    dist.barrier(group=private)
    maps["private"] = _shm_maps()
    # The transports really are the ones named: shared-memory groups map segments, the TCP one
    # maps none (a group of one rank has no peers to map).
    transports = {"shm": maps["shm"] - maps["start"], "tcp": maps["tcp"] - maps["shm"],
                  "private": maps["private"] - maps["tcp"]}
    if world > 1 and not (transports["shm"] > 0 and transports["tcp"] == 0 and transports["private"] > 0):
        raise RuntimeError(f"segments mapped at each group's creation {transports}: expected shm > 0, tcp 0, private > 0")

    deadline = time.time() + (args.seconds or 0)
    inject = args.inject if rank == 0 else None  # one rank leaks: enough to fail the run
    runners = [GroupRunner(g, pg, rank, world, args, deadline, inject)
               for g, pg in zip(GROUPS, (dist.group.WORLD, tcp, private))]
    for pg in (dist.group.WORLD, tcp, private):
        link_every_pair(pg, world)
    samples = [sample(rank, 0)]
    t0 = time.time()
    for r in runners:
        r.start()
    tick = threading.Event()  # waits without spinning
    last_progress = t0
    while any(r.is_alive() for r in runners):
        tick.wait(args.interval)
        done = sum(r.done for r in runners)
        samples.append(sample(rank, done))
        for r in runners:
            if r.error:
                raise RuntimeError(r.error)
        if rank == 0 and time.time() - last_progress >= args.progress_every:
            last_progress = time.time()
            out.put(("progress", rank, {"ops": done, "seconds": last_progress - t0, "rss": samples[-1]["rss"]}))
    for r in runners:
        r.join()
        if r.error:
            raise RuntimeError(r.error)
    elapsed = time.time() - t0
    samples.append(sample(rank, sum(r.done for r in runners)))
    result = {
        "rank": rank, "seconds": elapsed, "samples": samples, "transports": transports, "before": before,
        "groups": {r.gname: {"ops": r.done, "checked": r.checked, "wrong": r.wrong, "mismatches": r.mismatches,
                             "counts": r.counts} for r in runners},
    }
    for r in runners:
        r.leak.clear()
    xccl_rs.destroy_group(private)
    dist.destroy_process_group(tcp)
    dist.destroy_process_group()
    result["after_destroy"] = sample(rank, result["samples"][-1]["ops"])
    out.put(("result", rank, result))
    # Rank 0 serves both stores: it leaves last, once every rank has said it is done.
    store.set(f"soak_exit/{rank}", "1")
    if rank == 0:
        store.wait([f"soak_exit/{r}" for r in range(world)], timeout)
    del pstore, store


# ---------------------------------------------------------------- the parent: launch, watch, judge


def fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 when xs do not vary)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 0.0 if sxx == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def slope_error(xs: list[float], ys: list[float]) -> float:
    """The standard error of ``fit(xs, ys)`` (0 with fewer than 3 points or xs that do not vary)."""
    n = len(xs)
    mx = sum(xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if n < 3 or sxx == 0:
        return 0.0
    slope, my = fit(xs, ys), sum(ys) / n
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    return math.sqrt(resid / (n - 2) / sxx)


RSS_STEADY = 0.6  # the last quarter's slope at least this fraction of the third quarter's: not slowing down
# Ops per rank after the warm-up before RSS growth can fail a run (--rss-min-ops): before that the
# allocator's floor still climbs in steps (docs/reliability.md has the measurement).
RSS_MIN_OPS = 50_000
RSS_MIN_SAMPLES = 16  # samples after warm-up, for a run to be judged on its second half
RSS_FLOOR = 2  # RSS is judged on its floor: each sample's least with this many neighbours on each side
RSS_ERRORS = 3  # growth beyond the tolerance by more than this many standard errors: not jitter


def rss_verdict(ops: list[float], rss: list[float], tol: float, min_ops: float) -> tuple[str, str, dict]:
    """The RSS verdict of one rank from its samples after the warm-up (``ops``: ops done at each
    sample, ``rss``: bytes): ``("pass" | "fail" | "inconclusive", why, figures)``.

    A leak grows RSS at a steady rate per op for as long as the run goes; the allocator settling
    (glibc's arenas and its mmap threshold finding their sizes) grows it early, then stops; and a
    sample taken while large buffers are in flight reads tens to hundreds of MiB above the rest,
    sometimes a few samples in a row. So RSS is judged on its floor: each sample replaced by the
    least of it and its RSS_FLOOR neighbours on either side (the first and last RSS_FLOOR samples
    only serve as neighbours). A leak raises the floor; buffers in flight for up to
    2 x RSS_FLOOR samples in a row do not. Telling a leak from the settling takes a run long
    enough for the settling to end: at least ``min_ops`` ops and RSS_MIN_SAMPLES samples after
    the warm-up.

    - A run that long is judged on the second half of those samples, by the fitted growth of
      their floor (the least-squares slope times the ops the half spans). Within ``tol`` it
      passes. It fails when the growth exceeds ``tol`` by more than RSS_ERRORS standard errors
      of the fit (not jitter) and is not slowing down (the slope over the last quarter of the
      samples at least RSS_STEADY of the third quarter's). Otherwise (beyond ``tol`` but within
      the jitter, or slowing down) it is inconclusive.
    - A shorter run passes if the floor did not grow beyond ``tol`` (fitted) over all its samples
      after the warm-up, and is inconclusive if it did: it cannot say whether that growth would
      stop."""
    samples, k, run_ops = len(ops), RSS_FLOOR, ops[-1] - ops[0]
    if samples >= 2 * k + 3:
        ops, rss = ops[k:samples - k], [min(rss[i - k:i + k + 1]) for i in range(k, samples - k)]
    n = len(ops)
    half, three = n // 2, (3 * n) // 4
    slope, late_slope = fit(ops, rss), fit(ops[half:], rss[half:])
    # The second half's own two halves (the sample between them in both): is its growth slowing?
    q3_slope, q4_slope = fit(ops[half:three + 1], rss[half:three + 1]), fit(ops[three:], rss[three:])
    span, late_ops = ops[-1] - ops[0], ops[-1] - ops[half]
    late_growth, late_error = late_slope * late_ops, slope_error(ops[half:], rss[half:]) * late_ops
    figures = {
        "post_warmup_ops": run_ops, "post_warmup_samples": samples, "fitted_growth": slope * span,
        "late_ops": late_ops, "late_growth": late_growth, "late_growth_error": late_error,
        "late_slope_per_1k_ops": late_slope * 1000, "q3_slope_per_1k_ops": q3_slope * 1000,
        "q4_slope_per_1k_ops": q4_slope * 1000,
        "tolerance": tol, "min_ops": min_ops,
    }
    tolerance = f"tolerance {tol / MiB:.1f} MiB"
    if run_ops < min_ops or samples < RSS_MIN_SAMPLES:
        grew = f"RSS grew {slope * span / MiB:.1f} MiB (fitted) after warm-up ({run_ops:.0f} ops), {tolerance}"
        if slope * span <= tol:
            return "pass", grew, figures
        return "inconclusive", (
            f"{grew}, in a run too short to tell a leak from the allocator settling ({run_ops:.0f} ops and {samples} samples "
            f"after warm-up; judging needs {min_ops:.0f} ops (--rss-min-ops) and {RSS_MIN_SAMPLES} samples): run longer"
        ), figures
    grew = (f"RSS grew {late_growth / MiB:.1f} ± {late_error / MiB:.1f} MiB (fitted) over the second half after "
            f"warm-up ({late_ops:.0f} ops), {tolerance}")
    if late_growth <= tol:
        return "pass", grew, figures
    if late_growth - RSS_ERRORS * late_error <= tol:
        return "inconclusive", f"{grew}: within the samples' jitter; run longer", figures
    rates = f"{q3_slope * 1000 / MiB:.2f} then {q4_slope * 1000 / MiB:.2f} MiB per 1,000 ops in its two halves"
    if q4_slope < RSS_STEADY * q3_slope:
        return "inconclusive", f"{grew}, but slowing down ({rates}): the allocator may still be settling; run longer", figures
    return "fail", f"{grew}, at a steady rate ({rates}): a leak", figures


def analyse(results: dict, args) -> dict:
    """Slopes, growth and the verdict from every rank's result."""
    report = {"ranks": {}, "failures": [], "inconclusive": []}
    for rank, res in sorted(results.items()):
        for g, gr in res["groups"].items():
            if gr["wrong"]:
                report["failures"].append(f"rank {rank}: {gr['wrong']} wrong results in group {g}: {gr['mismatches']}")
        samples = res["samples"]
        post = samples[int(len(samples) * args.warmup):]
        if len(post) < 3:
            report["inconclusive"].append(f"rank {rank}: only {len(post)} samples after warm-up: growth not judged "
                                          "(run longer or lower --interval)")
            continue
        xs = [s["ops"] for s in post]
        span = xs[-1] - xs[0]
        row = {"samples": len(samples), "post_warmup_samples": len(post), "post_warmup_ops": span}
        for m in METRICS:
            if m not in post[0]:
                continue
            ys = [s[m] for s in post]
            slope = fit(xs, ys)
            # What stayed: the least value of the last quarter of the samples, against the start.
            # A leak stays; a transient peak (a socket open during a store call, a thread of
            # torch's for a moment) does not.
            kept = min(ys[-max(1, len(ys) // 4):]) - ys[0]
            row[m] = {"start": ys[0], "end": ys[-1], "min": min(ys), "max": max(ys), "growth": ys[-1] - ys[0],
                      "kept": kept, "slope_per_1k_ops": slope * 1000, "fitted_growth": slope * span}
        for m in EXACT_METRICS:
            # Growth that stays fails; a drop does not (a group that finishes first ends its
            # threads), nor does a peak that goes away.
            if m in row and row[m]["kept"] > 0:
                report["failures"].append(f"rank {rank}: {m} went from {row[m]['start']} to {row[m]['end']} "
                                          f"(at least {row[m]['start'] + row[m]['kept']} over the last quarter) after warm-up")
        tol = max(args.rss_tol_mib * MiB, args.rss_tol_pct / 100 * row["rss"]["start"])
        rss, why, figures = rss_verdict(xs, [s["rss"] for s in post], tol, args.rss_min_ops)
        row["rss"].update(figures, verdict=rss, samples=[[s["ops"], s["rss"]] for s in post])
        if rss == "fail":
            report["failures"].append(f"rank {rank}: {why}")
        elif rss == "inconclusive":
            report["inconclusive"].append(f"rank {rank}: {why}")
        report["ranks"][rank] = row
    groups = {g: {k: sum(r["groups"][g][k] for r in results.values()) for k in ("ops", "checked", "wrong")}
              for g in GROUPS}
    report["groups"] = groups
    report["wrong"] = sum(g["wrong"] for g in groups.values())
    report["ops_per_rank"] = max((sum(r["groups"][g]["ops"] for g in GROUPS) for r in results.values()), default=0)
    report["seconds"] = max((r["seconds"] for r in results.values()), default=0.0)
    report["transports"] = {r: res["transports"] for r, res in results.items()}
    report["op_counts"] = results[0]["groups"] if 0 in results else {}
    return report


def _commit() -> str:
    """The git commit of the source this copy was built from, where that is a checkout."""
    try:
        import xccl_rs
        here = os.path.dirname(os.path.abspath(xccl_rs.__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Progress:
    """The soak's progress, as rank 0 reports it: a tqdm bar of its ops when stdout is a
    terminal and tqdm is installed (updated at every metric sample), else a plain line every
    ``--progress`` seconds (ops, seconds, ops/s, rank 0's RSS), which a log keeps readable."""

    def __init__(self, args):
        self.tqdm, self.bar = None, None
        if sys.stdout.isatty():
            try:
                from tqdm.auto import tqdm

                self.tqdm = tqdm
            except ImportError:
                pass
        self.total = None if args.seconds else args.ops_per_group * len(GROUPS)  # rank 0's ops
        # How often rank 0 reports: at every sample for a bar, every --progress seconds for lines.
        self.every = args.interval if self.tqdm is not None else args.progress

    def update(self, payload: dict) -> None:
        if self.tqdm is None:
            print(f"  {payload['ops']:>7} ops  {payload['seconds']:7.1f} s  "
                  f"{payload['ops'] / max(payload['seconds'], 1e-9):7.1f} ops/s  rank 0 RSS {payload['rss'] / MiB:.0f} MiB",
                  flush=True)
            return
        if self.bar is None:  # made at the first report, once the ranks run: its rate is theirs
            self.bar = self.tqdm(total=self.total, initial=payload["ops"], desc="soak", unit=" ops", file=sys.stdout,
                                 dynamic_ncols=True)
        self.bar.update(payload["ops"] - self.bar.n)
        self.bar.set_postfix_str(f"rank 0 RSS {payload['rss'] / MiB:.0f} MiB", refresh=True)

    def close(self, ops: int | None = None) -> None:
        """Ends the bar, at rank 0's final count of ops when it is known."""
        if self.bar is not None:
            if ops is not None:
                self.bar.update(ops - self.bar.n)
            self.bar.close()
            self.bar = None


def print_summary(report: dict) -> None:
    print(f"\n{report['ops_per_rank']} ops per rank in {report['seconds']:.1f} s; checked/wrong per group: "
          + ", ".join(f"{g} {v['checked']}/{v['wrong']}" for g, v in report["groups"].items()))
    print(f"{'rank':>4} {'metric':<12} {'start':>12} {'end':>12} {'growth':>10} {'slope/1k ops':>14}")
    for rank, row in report["ranks"].items():
        for m in METRICS:
            if m not in row:
                continue
            v = row[m]
            scale, unit = (MiB, " MiB") if m == "rss" else (1, "")
            print(f"{rank:>4} {m:<12} {v['start'] / scale:>12.1f} {v['end'] / scale:>12.1f} "
                  f"{v['growth'] / scale:>10.2f} {v['slope_per_1k_ops'] / scale:>14.4f}{unit}")
    leftovers = report.get("shm_leftovers", [])
    print(f"/dev/shm entries of the ranks left after exit: {len(leftovers)}")
    print(verdict_text(report))


def verdict(report: dict) -> str:
    """``fail`` on any failure; else ``inconclusive`` if some growth could not be judged; else ``pass``."""
    return "fail" if report["failures"] else "inconclusive" if report.get("inconclusive") else "pass"


def verdict_text(report: dict) -> str:
    """The last lines a user reads: PASS, FAIL or INCONCLUSIVE, then why."""
    lines = report["failures"] + report.get("inconclusive", [])
    return verdict(report).upper() + "".join(f"\n  {line}" for line in lines)


def main(argv=None) -> int:
    from xccl_rs.bench import HelpFormatter

    p = argparse.ArgumentParser(prog="python -m xccl_rs.soak", description=__doc__.split("\n\n")[0],
                                epilog=f"Exit status: {', '.join(f'{c} {v}' for v, c in EXIT.items())}.",
                                formatter_class=HelpFormatter)
    p.add_argument("--ops", type=int, default=20000, help="ops per rank, over the three groups")
    p.add_argument("--seconds", type=float, help="run this long instead of --ops")
    p.add_argument("--ranks", type=int, default=4, help="rank processes")
    p.add_argument("--max-bytes", type=int, default=8 * MiB, help="largest buffer of an op, bytes")
    p.add_argument("--seed", type=int, default=1, help="seed of the ops' sequence and data")
    p.add_argument("--check-every", type=int, default=20, help="check every this many ops of a group")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between metric samples")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of the samples that is warm-up")
    p.add_argument("--progress", type=float, default=5.0,
                   help="seconds between progress lines (a tqdm bar instead on a terminal, when tqdm is installed)")
    p.add_argument("--timeout", type=float, default=300.0, help="group timeout, seconds")
    p.add_argument("--deadline", type=float, help="kill the ranks after this many seconds (default: generous)")
    p.add_argument("--rss-tol-mib", type=float, default=8.0, help="RSS growth allowed after warm-up, MiB")
    p.add_argument("--rss-tol-pct", type=float, default=2.0, help="... or this percentage of the RSS, if larger")
    p.add_argument("--rss-min-ops", type=float, default=RSS_MIN_OPS,
                   help="ops per rank after warm-up that a run needs before RSS growth can fail it "
                        "(a shorter run whose RSS grows is inconclusive)")
    p.add_argument("--json", metavar="PATH", help="write the figures here")
    p.add_argument("--inject", choices=("fd", "rss", "wrong"),
                   help="testing the soak itself: rank 0 leaks an fd / 256 KiB every 50 ops, or checks against a wrong reference")
    args = p.parse_args(argv)
    args.ops_per_group = math.ceil(args.ops / len(GROUPS))
    deadline = args.deadline or (args.seconds + 300 if args.seconds else 600 + args.ops * 0.5)
    progress = Progress(args)
    args.progress_every = progress.every  # read by rank 0

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports = (free_port(), free_port())
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, ports, args, out), name=f"soak-rank{r}")
             for r in range(args.ranks)]
    start = time.time()
    for pr in procs:
        pr.start()
    print(f"soak: {args.ranks} ranks x 3 groups (shm, tcp, private), "
          + (f"{args.seconds:g} s" if args.seconds else f"{args.ops} ops per rank")
          + f", up to {args.max_bytes} B, seed {args.seed}, check every {args.check_every}", flush=True)
    results, errors = {}, []
    failed_at = None
    while len(results) < args.ranks:
        try:
            kind, rank, payload = out.get(timeout=1.0)
        except queue_mod.Empty:
            kind = None
        if kind == "progress":
            progress.update(payload)
        elif kind == "result":
            results[rank] = payload
        elif kind == "error":
            errors.append(f"rank {rank} failed:\n{payload}")
            failed_at = failed_at or time.time()
        dead = [pr for pr in procs if pr.exitcode not in (None, 0)]
        if dead and failed_at is None:
            failed_at = time.time()
            errors.append(", ".join(f"{pr.name} exited with {pr.exitcode}" for pr in dead))
        # After a failure the others get 20 s to report theirs (peers fail within an op), then go.
        if (failed_at and time.time() - failed_at > 20) or time.time() - start > deadline:
            if not failed_at:
                errors.append(f"deadline of {deadline:.0f} s passed with {len(results)} of {args.ranks} ranks done")
            break
    progress.close(sum(g["ops"] for g in results[0]["groups"].values()) if 0 in results else None)
    for pr in procs:
        pr.join(timeout=30 if not errors else 1)
        if pr.is_alive():
            pr.kill()
            pr.join()
    pids = {str(pr.pid) for pr in procs}
    leftovers = [e for e in os.listdir("/dev/shm") if e.startswith("xccl_rs-") and e.split("-")[1] in pids]

    report = analyse(results, args) if len(results) == args.ranks else {"failures": [], "ranks": {}, "groups": {}}
    report["failures"] = errors + report["failures"]
    report["shm_leftovers"] = leftovers
    if leftovers:
        report["failures"].append(f"/dev/shm entries left by the ranks: {leftovers}")
    report["config"] = {k: v for k, v in vars(args).items()}
    report["machine"] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "torch": torch.__version__, "commit": _commit()}
    report["wall_seconds"] = time.time() - start
    report["verdict"] = verdict(report)
    report["passed"] = report["verdict"] == "pass"
    if report.get("groups"):
        print_summary(report)
    else:
        print(verdict_text(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return EXIT[report["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
