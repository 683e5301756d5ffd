"""torch's fault-tolerance API on xccl_rs (torch >= 2.15): a group made with
``init_process_group(..., enable_reconfigure=True)`` connects at ``dist._reconfigure`` and can be
rebuilt over any subset of its ranks; ``abort()`` stops a blocked op on every rank; a timeout is
found with nobody waiting, fires the abort hooks and shows in ``get_error()``; a reused uuid is
refused. World sizes 2 to 5, over shared memory, TCP and in mixed groups, on CPU tensors and
on the emulated XPU. Results are checked against sums computed here from the ranks' inputs.

(torch's own suite, test/distributed/test_c10d_fault_tolerance.py, also passes with xccl_rs
added to its backend list: docs/reliability.md says how to run it.)
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import ctx, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.15 has no reconfigure API")


def _init(rank, world_size, timeout_s=30.0):
    import xccl_rs  # noqa: F401

    store = ctx().connect_store()
    dist.init_process_group(
        "xccl_rs", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=timeout_s), enable_reconfigure=True
    )
    return store


def _connected_world(rank, world_size):
    """A reconfigurable group over every rank, connected by its first reconfigure: (the store,
    the default group's CPU backend, every rank)."""
    import torch

    store = _init(rank, world_size)
    everyone = list(range(world_size))
    dist._reconfigure(1, _handles(store, "all1", everyone)).wait()
    return store, dist.get_backend_impl(dist.group.WORLD, torch.device("cpu")), everyone


def _handles(store, key, members):
    """Every member publishes its handle under `key`; returns them in the members' order."""
    me = dist._get_reconfigure_handle()
    store.set(f"{key}/{ctx().rank}", me)
    return [store.get(f"{key}/{m}").decode() for m in members]


def _barrier(store, key, members):
    store.set(f"{key}/{ctx().rank}", "1")
    for m in members:
        store.get(f"{key}/{m}")


def _check_sum(problems, what, contributors, device="cpu"):
    """all_reduce of (new rank + 1) * 10 + 0..3 on `device`: compared with the sum over the
    contributors."""
    import torch

    t = (torch.arange(4, dtype=torch.float32) + (dist.get_rank() + 1) * 10).to(device)
    dist.all_reduce(t)
    want = sum(torch.arange(4, dtype=torch.float32) + (r + 1) * 10 for r in range(contributors))
    if not torch.equal(t.cpu(), want):
        problems.append(f"{what}: all_reduce on {device} gave {t.cpu().tolist()}, expected {want.tolist()}")


def _expect(problems, what, got, want):
    if got != want:
        problems.append(f"{what}: {got!r}, expected {want!r}")


def w_shrink_late_join_reuse(rank, world_size, device="cpu"):
    problems = []
    store = _init(rank, world_size)
    everyone = list(range(world_size))
    dist._reconfigure(1, _handles(store, "all1", everyone)).wait()
    _check_sum(problems, "after the first reconfigure", world_size, device)
    # Drop rank 1 (the last one at 2 ranks, a middle one above): the others renumber.
    survivors = [r for r in everyone if r != 1]
    if rank != 1:
        dist._reconfigure(2, _handles(store, "shrink", survivors)).wait()
        _expect(problems, "size after the shrink", dist.get_world_size(), world_size - 1)
        _expect(problems, "rank after the shrink", dist.get_rank(), survivors.index(rank))
        _check_sum(problems, "after the shrink", world_size - 1, device)
    _barrier(store, "shrunk", everyone)
    # Rank 1 joins again: the group is whole.
    dist._reconfigure(3, _handles(store, "all3", everyone)).wait()
    _expect(problems, "rank after the late join", dist.get_rank(), rank)
    _check_sum(problems, "after the late join", world_size, device)
    # Every rank alone, twice with the same uuid: refused the second time, and it still works.
    dist._reconfigure(100 + rank, [dist._get_reconfigure_handle()]).wait()
    try:
        dist._reconfigure(100 + rank, [dist._get_reconfigure_handle()]).wait()
        problems.append("a reused uuid was accepted")
    except RuntimeError as e:
        if "already used" not in str(e):
            problems.append(f"a reused uuid: {e}")
    _check_sum(problems, "alone", 1, device)
    dist.destroy_process_group()
    return problems


def w_timeout_revokes(rank, world_size):
    from torch._C._distributed_c10d import ErrorType
    import torch

    problems = []
    store, backend, everyone = _connected_world(rank, world_size)
    backend.set_timeout(timedelta(seconds=2))
    revoked = threading.Event()
    backend.register_abort_hook(7, revoked.set)
    if rank != 0:  # rank 0 never joins this all_reduce, and nobody waits for it
        started = time.monotonic()
        work = dist.all_reduce(torch.ones(4), async_op=True)
        if not revoked.wait(10):
            problems.append("the abort hook did not fire within 10 s of a 2 s timeout")
        elif time.monotonic() - started > 3.0:
            problems.append(f"the abort hook fired after {time.monotonic() - started:.1f} s (timeout 2 s)")
        _expect(problems, "get_error()", backend.get_error(), ErrorType.TIMEOUT)
        try:
            dist.all_reduce(torch.ones(4), async_op=True)
            problems.append("an op on the timed-out group was accepted")
        except RuntimeError as e:
            if "timed out" not in str(e):
                problems.append(f"the next op: {e}")
        del work
    backend.unregister_abort_hook(7)
    backend.set_timeout(timedelta(seconds=30))
    _barrier(store, "observed", everyone)
    dist._reconfigure(2, _handles(store, "all2", everyone)).wait()
    _expect(problems, "get_error() after the reconfigure", backend.get_error(), ErrorType.SUCCESS)
    _check_sum(problems, "after recovering", world_size)
    dist.destroy_process_group()
    return problems


def w_abort_unblocks(rank, world_size):
    from torch._C._distributed_c10d import ErrorType
    import torch

    problems = []
    store, backend, everyone = _connected_world(rank, world_size)
    if rank == 0:
        time.sleep(0.5)
        backend.abort()  # rank 0 never joins; its abort frees the others
        _expect(problems, "get_error() after abort()", backend.get_error(), ErrorType.COMM_ERROR)
    else:
        started = time.monotonic()
        work = dist.all_reduce(torch.ones(4), async_op=True)
        try:
            work.wait()
            problems.append("the all_reduce blocked by an aborted rank succeeded")
        except RuntimeError as e:
            if "rank 0" not in str(e):
                problems.append(f"the blocked all_reduce: {e}")
        if time.monotonic() - started > 5.0:
            problems.append(f"the blocked all_reduce failed after {time.monotonic() - started:.1f} s (timeout 30 s)")
    _barrier(store, "aborted", everyone)
    dist._reconfigure(2, _handles(store, "all2", everyone)).wait()
    _check_sum(problems, "after recovering", world_size)
    dist.destroy_process_group()
    return problems


def _run(world, fn, *args, **kwargs):
    res = run_ranks(world, fn, *args, init="none", timeout_s=120, **kwargs)
    res.assert_no_problems()


# How the group's ranks reach each other: one host (shared memory), TCP between every pair, or
# two hosts (ranks 0 and 1 on one, the others on the other: mixed).
NETS = {
    "shm": {},
    "tcp": {"env": {"XCCL_RS_TRANSPORT": "tcp"}},
    "mixed": {"rank_env": lambda r: {"XCCL_RS_HOST_ID": "a" if r < 2 else "b"}},
}


@pytest.mark.parametrize(
    "world,net", [(2, "shm"), (3, "shm"), (4, "shm"), (5, "shm"), (3, "tcp"), (5, "tcp"), (4, "mixed"), (5, "mixed")]
)
def test_shrink_late_join_and_reused_uuid(world, net):
    _run(world, w_shrink_late_join_reuse, **NETS[net])


def test_shrink_late_join_and_reused_uuid_on_xpu():
    import xpu_emu

    if reason := xpu_emu.unavailable_reason():
        pytest.skip(reason)
    xpu_emu.load()
    _run(3, w_shrink_late_join_reuse, "xpu", setup=xpu_emu.ACTIVATE)


def test_timeout_revokes_the_group_without_a_waiter():
    _run(3, w_timeout_revokes)


def test_abort_unblocks_every_rank_and_the_group_recovers():
    _run(3, w_abort_unblocks)
