"""Several hosts without more machines: ranks in separate network namespaces (python_tests/netns.py),
so that TCP crosses real interfaces and a bridge and shared memory is not chosen between them.

- One rank per namespace: every collective is right, each rank holds TCP connections from its own
  namespace's address to every other rank's, and maps no shared memory.
- Two namespaces of two ranks: a mixed group (shared memory inside each, TCP between them).
- A link cut mid-collective (the host's bridge port taken down): every survivor raises within
  the timeout plus 2 s, naming the cut host's rank, as for a dead peer; the survivors reconfigure
  without that host (torch >= 2.15) and their next all_reduce is right.

Results are checked against values computed here from every rank's inputs.
Skipped, saying why, where namespaces cannot be made (they need root).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import netns
from harness import ctx, run_ranks

_WHY_NOT = netns.unavailable()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no network namespaces here: {_WHY_NOT}")

TIMEOUT_S = 3.0


def _problems(res, rank):
    got = res.value(rank)
    return ["no result"] if got is None else got


def _rank_env(hosts: netns.NamespaceHosts, host_of_rank: list[int]):
    """Each rank's namespace, the address it advertises there, and a host id per namespace."""

    def env(rank):
        h = host_of_rank[rank]
        return {"XCCL_RS_TEST_NETNS": hosts.names[h], "XCCL_RS_SOCKET_HOST": hosts.addresses[h], "XCCL_RS_HOST_ID": f"netns-{h}"}

    return env


def _init_in_namespace(rank, world_size, **kw):
    """Connects to the test's store (on the machine's loopback), then enters this rank's
    namespace and creates the group there."""
    import xccl_rs  # noqa: F401

    store = ctx().connect_store()
    netns.enter(os.environ["XCCL_RS_TEST_NETNS"])
    dist.init_process_group("xccl_rs", rank=rank, world_size=world_size, store=store, **kw)
    return store


def _collectives_are_right(rank, world_size):
    """all_reduce, broadcast, all_gather, reduce_scatter, all_to_all and a send/recv ring, each
    compared with what every rank's inputs give."""
    import torch

    problems = []
    n = 1000 * world_size
    mine = lambda r: torch.arange(n, dtype=torch.float32) * (r + 1) + r  # noqa: E731
    t = mine(rank)
    dist.all_reduce(t)
    if not torch.equal(t, sum(mine(r) for r in range(world_size))):
        problems.append("all_reduce")
    t = mine(rank)
    dist.broadcast(t, src=world_size - 1)
    if not torch.equal(t, mine(world_size - 1)):
        problems.append("broadcast")
    out = torch.empty(n * world_size)
    dist.all_gather_into_tensor(out, mine(rank))
    if not torch.equal(out, torch.cat([mine(r) for r in range(world_size)])):
        problems.append("all_gather")
    out = torch.empty(n // world_size)
    dist.reduce_scatter_tensor(out, mine(rank))
    if not torch.equal(out, sum(mine(r) for r in range(world_size)).chunk(world_size)[rank]):
        problems.append("reduce_scatter")
    out = torch.empty(n)
    dist.all_to_all_single(out, mine(rank))
    if not torch.equal(out, torch.cat([mine(r).chunk(world_size)[rank] for r in range(world_size)])):
        problems.append("all_to_all")
    got = torch.empty(n)
    ops = [dist.P2POp(dist.isend, mine(rank), (rank + 1) % world_size), dist.P2POp(dist.irecv, got, (rank - 1) % world_size)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if not torch.equal(got, mine((rank - 1) % world_size)):
        problems.append("send/recv")
    return problems


def w_collectives(rank, world_size, addresses, host_of_rank):
    _init_in_namespace(rank, world_size, timeout=timedelta(seconds=30))
    problems = [f"{what} is wrong" for what in _collectives_are_right(rank, world_size)]
    me = host_of_rank[rank]
    links = netns.tcp_peers_of_this_process()
    for other in sorted({h for h in host_of_rank if h != me}):
        if not any(local == addresses[me] and remote == addresses[other] for local, remote in links):
            problems.append(f"no TCP connection from {addresses[me]} to host {other} at {addresses[other]}: {links}")
    shares = host_of_rank.count(me) > 1
    if netns.maps_shared_memory() != shares:
        problems.append(f"maps shared memory: {not shares}, expected {shares} ({host_of_rank.count(me)} ranks in this namespace)")
    dist.barrier()  # nobody closes its connections before every rank has looked at its own
    return problems


@pytest.mark.parametrize("host_of_rank", [[0, 1, 2], [0, 0, 1, 1]], ids=["tcp-3-hosts", "mixed-2x2"])
def test_collectives_across_namespaces(host_of_rank):
    world = len(host_of_rank)
    with netns.NamespaceHosts(max(host_of_rank) + 1) as hosts:
        res = run_ranks(
            world, w_collectives, hosts.addresses, host_of_rank, init="none", rank_env=_rank_env(hosts, host_of_rank), timeout_s=90
        )
    problems = [f"rank {r}: {p}" for r in range(world) for p in _problems(res, r)]
    assert not problems, "\n".join(problems)


def w_link_cut(rank, world_size, host_of_rank, signal_dir):
    import torch

    store = _init_in_namespace(rank, world_size, timeout=timedelta(seconds=TIMEOUT_S), enable_reconfigure=True)
    handles = lambda key, members: [store.get(f"{key}/{m}").decode() for m in members]  # noqa: E731
    store.set(f"h1/{rank}", dist._get_reconfigure_handle())
    dist._reconfigure(1, handles("h1", range(world_size))).wait()
    cut_host = max(host_of_rank)
    victims = [r for r in range(world_size) if host_of_rank[r] == cut_host]
    survivors = [r for r in range(world_size) if r not in victims]
    big = torch.ones(1 << 20)  # 4 MiB: long enough over the bridge that the cut falls inside one
    for _ in range(3):
        dist.all_reduce(big.clone())
    if rank == victims[0]:
        open(os.path.join(signal_dir, "cut-now"), "w").close()  # the test cuts this host's link
    error = None
    for _ in range(200):
        try:
            dist.all_reduce(big.clone())
        except RuntimeError as e:
            error = e
            break
    if rank in victims:
        return []
    cut_at = float(open(os.path.join(signal_dir, "cut-at")).read())
    problems = []
    if error is None:
        return [f"200 all_reduces after the cut succeeded"]
    late = time.time() - cut_at
    if late > TIMEOUT_S + 2.0:
        problems.append(f"raised {late:.1f} s after the cut (timeout {TIMEOUT_S} s)")
    if not any(f"rank {v}" in str(error) or f"[{v}]" in str(error) for v in victims):
        problems.append(f"the error names none of the cut host's ranks {victims}: {error}")
    store.set(f"h2/{rank}", dist._get_reconfigure_handle())
    dist._reconfigure(2, handles("h2", survivors)).wait()
    t = torch.full((1000,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    want = float(sum(range(1, len(survivors) + 1)))
    if t.tolist() != [want] * 1000:
        problems.append(f"all_reduce among the survivors gave {t[:2].tolist()}..., expected {want}")
    return problems


def _cut_when_asked(hosts, host, signal_dir, stop):
    """The test's side of the cut: waits for the victim's word, takes its link down, notes when."""
    flag = os.path.join(signal_dir, "cut-now")
    while not stop.is_set():
        if os.path.exists(flag):
            time.sleep(0.02)  # the all_reduce the victim has just started is under way
            hosts.cut(host)
            with open(os.path.join(signal_dir, "cut-at"), "w") as f:
                f.write(repr(time.time()))
            return
        time.sleep(0.002)


@pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.15 has no reconfigure API")
@pytest.mark.parametrize("host_of_rank", [[0, 1, 2], [0, 0, 1, 2]], ids=["tcp-3-hosts", "mixed-3-hosts"])
def test_link_cut_mid_collective(host_of_rank, tmp_path):
    world = len(host_of_rank)
    stop = threading.Event()
    with netns.NamespaceHosts(max(host_of_rank) + 1) as hosts:
        cutter = threading.Thread(target=_cut_when_asked, args=(hosts, max(host_of_rank), str(tmp_path), stop), daemon=True)
        cutter.start()
        try:
            victims = tuple(r for r in range(world) if host_of_rank[r] == max(host_of_rank))
            res = run_ranks(
                world,
                w_link_cut,
                host_of_rank,
                str(tmp_path),
                init="none",
                rank_env=_rank_env(hosts, host_of_rank),
                env={"TORCH_FR_BUFFER_SIZE": "0"},
                expect_fail_ranks=victims,
                timeout_s=90,
            )
        finally:
            stop.set()
            cutter.join()
    assert (tmp_path / "cut-at").exists(), "the link was never cut"
    problems = [f"rank {r}: {p}" for r in range(world) if r not in victims for p in _problems(res, r)]
    assert not problems, "\n".join(problems)
