"""Between hosts, on one machine: every collective and dtype on ranks spread over network
namespaces with one rail (veth) per local rank (multihost.py, netns.py), and the faults of a
cluster: a link cut mid-operation and a rank killed on another host.

Layouts (ranks per host): 2x2 ``(2, 2)``, 4x1 ``(1, 1, 1, 1)`` and three hosts of unequal size
``(2, 1, 2)``; inter-host transports ``tcp`` and ``ofi`` (the latter skipped, saying why, where
this build has no OFI transport).

- Collectives: all_reduce (SUM, AVG, PREMUL_SUM, MAX), broadcast, reduce, all_gather (list and
  tensor), reduce_scatter, gather, scatter, all_to_all_single, barrier and send/recv, in
  float32, bfloat16, float16, int32 and int64 (AVG and PREMUL_SUM in the float types), at a
  small odd size and one of about 1 MiB, against torch ops on every rank's inputs (regenerated
  here from their seeds, never through a backend). The whole collectives sweep of
  test_collectives.py (every collective x dtype x op x size x completion mode) runs on the same
  layouts when XCCL_RS_TEST_MULTIHOST=1 (scripts/test_extra.sh), over links shaped to 1 Gbit/s.
- Faults, over links shaped to 1 Gbit/s so that an all_reduce of 16 MiB lasts long enough for the
  fault to fall inside it (a link cut, a rank killed on another host): every rank raises within
  the timeout plus 2 s, its error naming a rank on the other side of the fault, shuts down
  without hanging, and no file of theirs is left in /dev/shm. With XCCL_RS_TEST_MULTIHOST=1 the
  same with every rank a script of its own, which must also exit non-zero. A wrong FI_PROVIDER,
  and hosts asking for different transports: every rank raises at set-up, naming the setting.

Skipped, saying why, where namespaces cannot be made (they need root).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pytest

import multihost
import netns
from harness import collect_outputs, ctx, run_ranks

_WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces here: {_WHY_NOT}")

LAYOUTS = {"2x2": (2, 2), "4x1": (1, 1, 1, 1), "2+1+2": (2, 1, 2)}
TRANSPORTS = ["tcp", "ofi"]
DTYPES = ["float32", "bfloat16", "float16", "int32", "int64"]
SIZES = [1001, 262147]  # elements per rank: small and odd; about 1 MiB of float32 (many chunks)
TIMEOUT_S = 3.0
SLOW = os.environ.get("XCCL_RS_TEST_MULTIHOST") == "1"


def _skip_unless_transport(transport: str) -> None:
    if transport == "ofi":
        why = multihost.ofi_unavailable()
        if why is not None:
            pytest.skip(why)


# ------------------------------------------------------------------------------ collectives


def _inputs(dtype_name: str, n: int, case: str, rank: int, world: int):
    """This rank's input of `case`: small integers, a multiple of `world` (so that a sum, its
    average and its half are exact in every dtype), seeded by (case, rank)."""
    import torch

    from harness import seed_of

    g = torch.Generator().manual_seed(seed_of(case, rank))
    return (torch.randint(-3, 4, (n,), generator=g, dtype=torch.int64) * world).to(getattr(torch, dtype_name))


def w_collectives(rank, world, layout):
    """Every collective in every dtype; returns the failures seen on this rank."""
    import torch
    import torch.distributed as dist

    multihost.init_in_namespace(rank, world, timeout=timedelta(seconds=60))
    ReduceOp = dist.ReduceOp
    bad = []

    def check(case, got, want):
        if got.dtype != want.dtype or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs()
            bad.append(f"{case}: {int((diff > 0).sum())} of {want.numel()} elements differ, max {diff.max().item()}")

    for dtype in DTYPES:
        floating = dtype not in ("int32", "int64")
        for n in SIZES:
            key = f"{dtype}/{n}"
            x = lambda what, r: _inputs(dtype, n, f"{key}/{what}", r, world)  # noqa: E731
            xs = lambda what: [x(what, r) for r in range(world)]  # noqa: E731
            total = lambda what: torch.stack(xs(what)).double().sum(0)  # noqa: E731
            cast = lambda t: t.to(getattr(torch, dtype))  # noqa: E731
            ops = [("sum", ReduceOp.SUM, lambda s: s), ("max", ReduceOp.MAX, None)]
            if floating:
                ops += [("avg", ReduceOp.AVG, lambda s: s / world),
                        ("premul", dist._make_nccl_premul_sum(0.5), lambda s: s * 0.5)]
            for name, op, post in ops:
                t = x(f"ar-{name}", rank)
                dist.all_reduce(t, op=op)
                want = torch.stack(xs(f"ar-{name}")).max(0).values if post is None else cast(post(total(f"ar-{name}")))
                check(f"all_reduce {name} {key}", t, want)
            root = world - 1
            t = x("bc", rank)
            dist.broadcast(t, src=root)
            check(f"broadcast {key}", t, x("bc", root))
            t = x("red", rank)
            dist.reduce(t, dst=1)
            if rank == 1:
                check(f"reduce {key}", t, cast(total("red")))
            out = torch.empty(n * world, dtype=getattr(torch, dtype))
            dist.all_gather_into_tensor(out, x("ag", rank))
            check(f"all_gather_into_tensor {key}", out, torch.cat(xs("ag")))
            outs = [torch.empty(n, dtype=out.dtype) for _ in range(world)]
            dist.all_gather(outs, x("agl", rank))
            check(f"all_gather {key}", torch.cat(outs), torch.cat(xs("agl")))
            out = torch.empty(n, dtype=out.dtype)
            dist.reduce_scatter_tensor(out, _rs_input(x, rank, n, world))
            want = torch.stack([_rs_input(x, r, n, world) for r in range(world)]).double().sum(0)
            check(f"reduce_scatter {key}", out, cast(want).chunk(world)[rank])
            got = [torch.empty(n, dtype=out.dtype) for _ in range(world)] if rank == 0 else None
            dist.gather(x("ga", rank), got, dst=0)
            if rank == 0:
                check(f"gather {key}", torch.cat(got), torch.cat(xs("ga")))
            src = world - 1
            out = torch.empty(n, dtype=out.dtype)
            dist.scatter(out, [x(f"sc{r}", src) for r in range(world)] if rank == src else None, src=src)
            check(f"scatter {key}", out, x(f"sc{rank}", src))
            out = torch.empty(n * world, dtype=out.dtype)
            dist.all_to_all_single(out, _rs_input(x, rank, n, world, "a2a"))
            want = torch.cat([_rs_input(x, r, n, world, "a2a").chunk(world)[rank] for r in range(world)])
            check(f"all_to_all_single {key}", out, want)
            got = torch.empty(n, dtype=out.dtype)
            ring = [dist.P2POp(dist.isend, x("p2p", rank), (rank + 1) % world),
                    dist.P2POp(dist.irecv, got, (rank - 1) % world)]
            for w in dist.batch_isend_irecv(ring):
                w.wait()
            check(f"send/recv ring {key}", got, x("p2p", (rank - 1) % world))
            if rank in (0, world - 1):  # first host to last host, blocking send/recv
                if rank == 0:
                    dist.send(x("sr", 0), dst=world - 1)
                else:
                    got = torch.empty(n, dtype=out.dtype)
                    dist.recv(got, src=0)
                    check(f"send/recv first->last {key}", got, x("sr", 0))
    dist.barrier()
    return bad


def _rs_input(x, rank, n, world, what="rs"):
    """A rank's input of n * world elements (reduce_scatter's, all_to_all's): world pieces."""
    import torch

    return torch.cat([x(f"{what}{j}", rank) for j in range(world)])


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_between_hosts(layout, transport):
    _skip_unless_transport(transport)
    hosts_of = LAYOUTS[layout]
    world = sum(hosts_of)
    with netns.NamespaceHosts(len(hosts_of), rails=max(hosts_of)) as hosts:
        res = run_ranks(world, w_collectives, hosts_of, init="none", timeout_s=240,
                        rank_env=multihost.rank_env(hosts, hosts_of, transport))
    res.assert_no_problems(f"{layout} {transport}: ")


def _rail_bytes_sent(rails: int) -> list[int]:
    """Bytes each rail of this rank's host has sent: its namespace's interfaces rail0, rail1, ...
    (/proc/self/net/dev is the namespace's view; /sys is the one it was mounted in)."""
    sent = {}
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, counters = line.split(":", 1)
            sent[name.strip()] = int(counters.split()[8])  # receive: 8 columns, then bytes sent
    return [sent[f"rail{i}"] for i in range(rails)]


def w_rails(rank, world, rails):
    """Every local rank on the wire: while the group runs large all_reduces, each rail of the
    host carries a fair part of what the host sends (a rank of local index i sends on rail i).
    Every rank returns its host's counters; the test reads one rank per host."""
    import torch
    import torch.distributed as dist

    multihost.init_in_namespace(rank, world, timeout=timedelta(seconds=60))
    big = torch.ones(4 << 20)
    dist.all_reduce(big)  # every connection made
    dist.barrier()
    before = _rail_bytes_sent(rails)
    for _ in range(3):
        dist.all_reduce(big)
    dist.barrier()
    sent = [after - b for after, b in zip(_rail_bytes_sent(rails), before)]
    dist.barrier()
    return sent


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_local_rank_sends_on_its_own_rail(transport):
    _skip_unless_transport(transport)
    layout = LAYOUTS["2x2"]
    world = sum(layout)
    with netns.NamespaceHosts(len(layout), rails=max(layout)) as hosts:
        res = run_ranks(world, w_rails, max(layout), init="none", timeout_s=120,
                        rank_env=multihost.rank_env(hosts, layout, transport))
    for rank in (0, layout[0]):  # the first rank of each host
        sent = res.value(rank)
        assert min(sent) >= 0.3 * sum(sent), f"{transport}: the rails of rank {rank}'s host sent {sent} bytes"


def w_sweep(rank, world):
    """test_collectives.py's whole sweep, on this rank's host."""
    from test_collectives import THEMES, collectives_sweep

    multihost.init_in_namespace(rank, world, timeout=timedelta(seconds=120))
    return collectives_sweep(rank, world, THEMES)


@pytest.mark.skipif(not SLOW, reason="the whole sweep between hosts: set XCCL_RS_TEST_MULTIHOST=1 (scripts/test_extra.sh)")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_whole_sweep_between_shaped_hosts(layout, transport):
    from test_collectives import THEMES

    _skip_unless_transport(transport)
    hosts_of = LAYOUTS[layout]
    world = sum(hosts_of)
    with netns.NamespaceHosts(len(hosts_of), rails=max(hosts_of), rate="1gbit") as hosts:
        res = run_ranks(world, w_sweep, init="none", timeout_s=1500, check=False,
                        rank_env=multihost.rank_env(hosts, hosts_of, transport))
    res.check()
    for r in range(world):
        ran = res.value(r)["themes"]
        assert all(ran[t][0] > 0 for t in THEMES), f"rank {r} skipped a theme: {ran}"


# ------------------------------------------------------------------------------ faults

FAULT_LAYOUT = (2, 2)
BIG = 4 << 20  # float32 elements: 16 MiB, over 100 ms on a 1 Gbit/s rail

# A rank as a user's script: all_reduces of 16 MiB until one raises, which it reports (with the
# time) and lets propagate, so that the process exits as the user's would. The fault ("cut": the
# test takes host 1's links down; "kill": the victim SIGKILLs itself) strikes during one.
FAULT_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from datetime import timedelta
    sys.path.insert(0, {tests!r})
    import netns
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port, fault, victim, signal_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    store.add("started", 1)  # the group's short timeout starts once every rank has imported torch
    while int(store.add("started", 0)) < world:
        time.sleep(0.01)
    netns.enter(os.environ["XCCL_RS_TEST_NETNS"])
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds={timeout}))
    big = torch.ones({big})
    for _ in range(2):  # every connection made, every step warm
        dist.all_reduce(big)
    dist.barrier()

    def die_soon():
        time.sleep(0.05)  # inside the first all_reduce after the barrier
        with open(os.path.join(signal_dir, "fault-at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    if rank == victim:
        if fault == "cut":
            open(os.path.join(signal_dir, "cut-now"), "w").close()
        else:
            threading.Thread(target=die_soon, daemon=True).start()
    try:
        for _ in range(100):
            dist.all_reduce(big)
    except RuntimeError as e:
        print(f"RAISED-AT {{time.time()!r}}", file=sys.stderr, flush=True)
        raise
    print("NO ERROR", flush=True)
    """
)


def _names_rank(text: str, rank: int) -> bool:
    """Whether an error names `rank`: "rank 3", or in a list of ranks, "ranks not heard from: [2, 3]"."""
    return re.search(rf"\brank {rank}\b|\branks\b[^\[\]]*\[[\d, ]*\b{rank}\b[\d, ]*\]", text) is not None


def _cut_when_asked(hosts, host, signal_dir, stop):
    flag = os.path.join(signal_dir, "cut-now")
    while not stop.is_set():
        if os.path.exists(flag):
            time.sleep(0.05)  # the all_reduce every rank has just started is under way
            hosts.cut(host)
            with open(os.path.join(signal_dir, "fault-at"), "w") as f:
                f.write(repr(time.time()))
            return
        time.sleep(0.002)


def w_fault(rank, world, fault, victims, signal_dir):
    """Runs all_reduces of 16 MiB until one raises; `fault` ("cut" or "kill") strikes during one.
    Reports (error text, when it was raised) as a partial result, then re-raises as a script would."""
    import torch
    import torch.distributed as dist

    ctx().put_result("pid", os.getpid())
    multihost.init_in_namespace(rank, world, timeout=timedelta(seconds=TIMEOUT_S))
    big = torch.ones(BIG)
    for _ in range(2):  # every connection made, every step warm
        dist.all_reduce(big)
    dist.barrier()
    if rank == victims[0]:
        if fault == "cut":
            open(os.path.join(signal_dir, "cut-now"), "w").close()  # the test cuts this host's links
        else:
            threading.Thread(target=_die_soon, args=(signal_dir,), daemon=True).start()
    try:
        for _ in range(100):
            dist.all_reduce(big)
    except RuntimeError as e:
        ctx().put_result("error", (str(e), time.time()))
        raise
    ctx().put_result("error", (None, time.time()))
    return "no error"


def _die_soon(signal_dir):
    time.sleep(0.05)  # inside the first all_reduce after the barrier
    with open(os.path.join(signal_dir, "fault-at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_fault_between_hosts(fault, transport, tmp_path):
    """cut: host 1's links go down mid-all_reduce; every rank (both hosts) must raise naming a
    rank of the other host. kill: rank 3 (host 1) is killed mid-all_reduce; every other rank,
    its host-mate included, must raise naming rank 3."""
    _skip_unless_transport(transport)
    where = multihost.placement(FAULT_LAYOUT)
    world = len(where)
    victims = [r for r in range(world) if where[r][0] == 1] if fault == "cut" else [world - 1]
    stop = threading.Event()
    with netns.NamespaceHosts(len(FAULT_LAYOUT), rails=max(FAULT_LAYOUT), rate="1gbit") as hosts:
        cutter = threading.Thread(target=_cut_when_asked, args=(hosts, 1, str(tmp_path), stop), daemon=True)
        if fault == "cut":
            cutter.start()
        try:
            res = run_ranks(world, w_fault, fault, victims, str(tmp_path), init="none", check=False,
                            rank_env=multihost.rank_env(hosts, FAULT_LAYOUT, transport, TORCH_FR_BUFFER_SIZE="0"),
                            expect_fail_ranks=tuple(range(world)), timeout_s=120)
        finally:
            stop.set()
            if cutter.is_alive():
                cutter.join()
    assert (tmp_path / "fault-at").exists(), "the fault never happened"
    fault_at = float((tmp_path / "fault-at").read_text())
    problems = []
    for r in range(world):
        if fault == "kill" and r in victims:
            continue
        got = res.partials.get(r, {}).get("error")
        if got is None:
            problems.append(f"rank {r} reported nothing: {res.errors.get(r) or res.missing.get(r)}")
            continue
        text, at = got
        if text is None:
            problems.append(f"rank {r}: 100 all_reduces after the fault succeeded")
            continue
        if at - fault_at > TIMEOUT_S + 2.0:
            problems.append(f"rank {r} raised {at - fault_at:.1f} s after the fault (timeout {TIMEOUT_S} s)")
        other_side = victims if r not in victims else [v for v in range(world) if v not in victims]
        if not any(_names_rank(text, v) for v in other_side):
            problems.append(f"rank {r}'s error names none of ranks {other_side}: {text[:400]}")
        if r not in res.errors:
            problems.append(f"rank {r} did not raise out of its function")
    problems += [f"rank {r}: {why}" for r, why in sorted(res.shutdown_problems.items())]  # a hang on the way out
    pids = [res.partials[r]["pid"] for r in range(world) if "pid" in res.partials.get(r, {})]
    left = multihost.shm_files_of(pids)
    if left:
        problems.append(f"left in /dev/shm: {left}")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(not SLOW, reason="a fresh interpreter per rank: set XCCL_RS_TEST_MULTIHOST=1 (scripts/test_extra.sh)")
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", ["cut", "kill"])
def test_fault_between_hosts_as_scripts(fault, transport, tmp_path):
    """The faults above with every rank a script of its own (a fresh interpreter, as a user
    runs it): each raises in time, naming a rank on the other side, and exits non-zero."""
    import torch.distributed as dist

    _skip_unless_transport(transport)
    where = multihost.placement(FAULT_LAYOUT)
    world = len(where)
    victims = [r for r in range(world) if where[r][0] == 1] if fault == "cut" else [world - 1]
    script = FAULT_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), timeout=TIMEOUT_S, big=BIG)
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    stop = threading.Event()
    with netns.NamespaceHosts(len(FAULT_LAYOUT), rails=max(FAULT_LAYOUT), rate="1gbit") as hosts:
        cutter = threading.Thread(target=_cut_when_asked, args=(hosts, 1, str(tmp_path), stop), daemon=True)
        if fault == "cut":
            cutter.start()
        env_of = multihost.rank_env(hosts, FAULT_LAYOUT, transport, TORCH_FR_BUFFER_SIZE="0", OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script, str(r), str(world), str(store.port), fault, str(victims[0]), str(tmp_path)],
                env={**os.environ, **env_of(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(world)
        ]
        try:
            outs = collect_outputs(procs, timeout_s=120)
        finally:
            stop.set()
            if cutter.is_alive():
                cutter.join()
    assert (tmp_path / "fault-at").exists(), "the fault never happened:\n" + "\n".join(o for _, o in outs)
    fault_at = float((tmp_path / "fault-at").read_text())
    problems = []
    for r, (rc, out) in enumerate(outs):
        if fault == "kill" and r in victims:
            continue
        raised = re.search(r"RAISED-AT (\S+)", out)
        if rc == 0 or raised is None:
            problems.append(f"rank {r} exited with {rc} without raising:\n{out[-2000:]}")
            continue
        late = float(raised.group(1)) - fault_at
        if late > TIMEOUT_S + 2.0:
            problems.append(f"rank {r} raised {late:.1f} s after the fault (timeout {TIMEOUT_S} s)")
        other_side = victims if r not in victims else [v for v in range(world) if v not in victims]
        error = out[raised.end():]
        if not any(_names_rank(error, v) for v in other_side):
            problems.append(f"rank {r}'s error names none of ranks {other_side}: {error[-1500:]}")
    left = multihost.shm_files_of([p.pid for p in procs])
    if left:
        problems.append(f"left in /dev/shm: {left}")
    assert not problems, "\n".join(problems)


def w_setup(rank, world):
    """Creates the group and runs one all_reduce; returns (error text or None, seconds taken)."""
    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    try:
        multihost.init_in_namespace(rank, world, timeout=timedelta(seconds=TIMEOUT_S))
        dist.all_reduce(torch.ones(8))
    except Exception as e:  # noqa: BLE001 - the test looks at what every rank got
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


SETUP_FAULTS = {
    # every rank asks for a provider libfabric does not have
    "wrong-provider": (lambda h: {"FI_PROVIDER": "no_such_provider"}, "FI_PROVIDER"),
    # host 0 over OFI, host 1 over TCP (named: the base environment asks every rank for OFI)
    "mixed-transports": (lambda h: {} if h == 0 else {"XCCL_RS_TRANSPORT": "tcp"}, "XCCL_RS_TRANSPORT"),
}


@pytest.mark.parametrize("fault", list(SETUP_FAULTS))
def test_setup_error_between_hosts(fault):
    """A wrong FI_PROVIDER, or hosts that ask for different transports: every rank raises at
    set-up, within the timeout plus 2 s, naming the setting."""
    _skip_unless_transport("ofi")
    env_of_host, setting = SETUP_FAULTS[fault]
    where = multihost.placement(FAULT_LAYOUT)
    world = len(where)
    with netns.NamespaceHosts(len(FAULT_LAYOUT), rails=max(FAULT_LAYOUT)) as hosts:
        base = multihost.rank_env(hosts, FAULT_LAYOUT, "ofi")
        res = run_ranks(world, w_setup, init="none", timeout_s=90,
                        rank_env=lambda r: {**base(r), **env_of_host(where[r][0])})
    problems = []
    for r in range(world):
        text, seconds = res.value(r)
        if text is None:
            problems.append(f"rank {r}: no error")
        elif setting not in text:
            problems.append(f"rank {r}'s error does not name {setting}: {text[:400]}")
        if seconds > TIMEOUT_S + 2.0 + 5.0:  # + the group's set-up on a busy 2-core machine
            problems.append(f"rank {r} took {seconds:.1f} s")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ the test bed


def test_namespaces_and_links_are_removed():
    """close() leaves no namespace behind, and rails route across hosts (also between rails)."""
    with netns.NamespaceHosts(2, rails=2, rate="1gbit") as hosts:
        made = [hosts.hub, *hosts.names]
        assert hosts.leftovers() == sorted(made)
        for rail in range(2):  # host 0 reaches both of host 1's rails
            assert _connects(hosts.names[0], hosts.names[1], hosts.address(1, rail)), f"rail {rail}"
    assert hosts.leftovers() == []


def _connects(src_ns, dst_ns, addr) -> bool:
    """Whether a TCP connection from namespace src_ns to `addr` in dst_ns carries a byte."""
    import socket

    result = {}

    def serve():
        netns.enter(dst_ns)
        with socket.socket() as s:
            s.bind((addr, 0))
            s.listen(1)
            result["port"] = s.getsockname()[1]
            ready.set()
            s.settimeout(10)
            conn, _ = s.accept()
            result["got"] = conn.recv(1)
            conn.close()

    def connect():
        netns.enter(src_ns)
        with socket.create_connection((addr, result["port"]), timeout=10) as c:
            c.sendall(b"x")

    ready = threading.Event()
    server = threading.Thread(target=serve)
    server.start()
    ready.wait(10)
    client = threading.Thread(target=connect)
    client.start()
    client.join(15)
    server.join(15)
    return result.get("got") == b"x"
