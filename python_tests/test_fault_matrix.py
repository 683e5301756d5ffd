"""One rank dies (SIGKILL) or stops (SIGSTOP) in the middle of a run of collectives: every
survivor raises within the timeout plus 2 s of it, naming that rank; the survivors reconfigure
to a group without it (torch >= 2.15) and their next all_reduce is right; and nothing is left
behind: no xccl_rs entry in /dev/shm, and the survivors' open file descriptors and threads are
back to their count from before the group.

CI runs a subset (every case at 3 ranks over shared memory; all_reduce over TCP and in a mixed
group; a stop in a rooted op over TCP and in a mixed group; one case at 4 ranks); XCCL_RS_FAULT_MATRIX=full runs every collective kind, both
signals, world sizes 2 to 4 and the three transports.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import ctx, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.15 has no reconfigure API")

TIMEOUT_S = 3.0
KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"]


def _fds():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor
    return sorted(out)


def _census():
    """Open fds (what they point at), threads, and xccl_rs's /dev/shm entries of this process."""
    shm = sorted(n for n in os.listdir("/dev/shm") if "xccl" in n) if os.path.isdir("/dev/shm") else []
    return _fds(), len(os.listdir("/proc/self/task")), shm


def _collective(kind, rank, size):
    import torch

    t = torch.full((4096,), float(rank + 1))
    n = 4096 // size * size  # divisible among the ranks
    if kind == "all_reduce":
        dist.all_reduce(t)
    elif kind == "broadcast":
        dist.broadcast(t, src=0)
    elif kind == "reduce":
        dist.reduce(t, dst=0)
    elif kind == "all_gather":
        dist.all_gather_into_tensor(torch.empty(4096 * size), t)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(torch.empty(n // size), t[:n])
    elif kind == "all_to_all":
        dist.all_to_all_single(torch.empty(n), t[:n])
    elif kind == "barrier":
        dist.barrier()


def w_one_rank_fails(rank, world_size, kind, how, victim):
    import torch

    import xccl_rs  # noqa: F401

    problems = []
    store = ctx().connect_store()
    before = _census()
    dist.init_process_group(
        "xccl_rs", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=TIMEOUT_S), enable_reconfigure=True
    )
    store.set(f"h1/{rank}", dist._get_reconfigure_handle())
    dist._reconfigure(1, [store.get(f"h1/{r}").decode() for r in range(world_size)]).wait()
    if rank == victim:
        store.set("victim_pid", str(os.getpid()))
    for _ in range(3):  # a few good ones first
        _collective(kind, rank, world_size)
    if rank == victim:
        store.set("victim_gone_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        time.sleep(60)  # (a stopped rank never gets here before the survivors kill it)
    error = None
    for _ in range(20):  # the survivors go on until their group tells them
        try:
            _collective(kind, rank, world_size)
        except RuntimeError as e:
            error = e
            break
    gone_at = float(store.get("victim_gone_at"))
    if error is None:
        problems.append(f"{kind}: 20 ops after rank {victim} was {how}ed succeeded")
    else:
        late = time.time() - gone_at
        if late > TIMEOUT_S + 2.0:
            problems.append(f"{kind}: raised {late:.1f} s after rank {victim} was {how}ed (timeout {TIMEOUT_S} s)")
        if f"rank {victim}" not in str(error) and f"[{victim}]" not in str(error):
            problems.append(f"{kind}: the error does not name rank {victim}: {error}")
    survivors = [r for r in range(world_size) if r != victim]
    store.set(f"h2/{rank}", dist._get_reconfigure_handle())
    dist._reconfigure(2, [store.get(f"h2/{r}").decode() for r in survivors]).wait()
    t = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    want = float(sum(range(1, len(survivors) + 1)))
    if t.tolist() != [want] * 8:
        problems.append(f"{kind}: all_reduce among the survivors gave {t.tolist()[:2]}..., expected {want}")
    if rank == survivors[0] and how == "stop":
        os.kill(int(store.get("victim_pid")), signal.SIGKILL)
    dist.destroy_process_group()
    # Threads end and descriptors close just after: the failure's hook thread may still be
    # finishing (it is short without torch's flight recorder, which this run turns off).
    deadline = time.monotonic() + 5
    while (after := _census()) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    for name, b, a in zip(("open fds", "threads", "/dev/shm entries"), before, after):
        if b != a:
            problems.append(f"{kind}: {name} {b} before the group, {a} after it")
    return problems


def _cases():
    full = os.environ.get("XCCL_RS_FAULT_MATRIX") == "full"
    if full:
        return [
            (net, world, kind, how)
            for net in ("shm", "tcp", "mixed")
            for world in (2, 3, 4)
            for kind in KINDS
            for how in ("kill", "stop")
            if not (net == "mixed" and world == 2)
        ]
    return (
        [("shm", 3, kind, how) for kind in ("all_reduce", "broadcast", "all_to_all") for how in ("kill", "stop")]
        + [(net, 3, "all_reduce", how) for net in ("tcp", "mixed") for how in ("kill", "stop")]
        # a rank stopped in a rooted op: the ranks waiting for the root must still name it
        + [("tcp", 4, "broadcast", "stop"), ("mixed", 3, "reduce", "stop")]
        + [("shm", 4, "reduce_scatter", "kill")]
    )


@pytest.mark.parametrize("net,world,kind,how", _cases())
def test_a_rank_dies_or_stops(net, world, kind, how):
    victim = world - 1
    # (torch's flight recorder would write its trace on the failure: tested in test_flight_recorder.py.)
    env = {"TORCH_FR_BUFFER_SIZE": "0", **({"XCCL_RS_TRANSPORT": "tcp"} if net == "tcp" else {})}
    # mixed: the victim's host is its own, the others share one.
    rank_env = (lambda r: {"XCCL_RS_HOST_ID": "b" if r == victim else "a"}) if net == "mixed" else None
    res = run_ranks(
        world,
        w_one_rank_fails,
        kind,
        how,
        victim,
        init="none",
        env=env,
        rank_env=rank_env,
        expect_fail_ranks=(victim,),
        timeout_s=90,
    )
    results = {r: res.value(r) for r in range(world) if r != victim}
    problems = [f"rank {r}: {p}" for r, got in results.items() for p in (["no result"] if got is None else got)]
    assert not problems, "\n".join(problems)
