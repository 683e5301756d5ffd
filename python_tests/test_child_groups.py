"""Child groups that torch routes to the backend (torch >= 2.15): ``dist.split_group`` (the
backend's split), ``dist.shrink_group`` (shrink, also after a rank died, with SHRINK_ABORT) and
``ProcessGroup.merge_remote_group`` (merge). Results are compared with sums and values computed
here from the ranks' inputs; the ranks' order in each child is the one torch promises.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import ctx, run_ranks

pytestmark = pytest.mark.skipif(not hasattr(dist, "shrink_group"), reason="torch < 2.15 routes no child groups to the backend")


def _init(rank, world_size, timeout_s=30.0):
    import xccl_rs  # noqa: F401

    store = ctx().connect_store()
    dist.init_process_group("xccl_rs", rank=rank, world_size=world_size, store=store, timeout=timedelta(seconds=timeout_s))
    return store


def _sum_of(contributors):
    return float(sum(c + 1 for c in contributors))


def w_split(rank, world_size):
    import torch

    _init(rank, world_size)
    problems = []
    splits = [[0, 1], [3, 2]]  # the order in a split is the child's rank order
    sub = dist.split_group(split_ranks=splits)
    mine = next(s for s in splits if rank in s)
    if sub.rank() != mine.index(rank) or sub.size() != len(mine):
        problems.append(f"child rank {sub.rank()} of {sub.size()}, expected {mine.index(rank)} of {len(mine)}")
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    if t.tolist() != [_sum_of(mine)] * 1000:
        problems.append(f"all_reduce in the child gave {t[0].item()}, expected {_sum_of(mine)}")
    t = torch.full((10,), float(rank + 1))
    dist.broadcast(t, group=sub, group_src=0)
    if t.tolist() != [float(mine[0] + 1)] * 10:
        problems.append(f"broadcast from the child's rank 0 (rank {mine[0]}) gave {t[0].item()}")
    t = torch.full((10,), float(rank + 1))
    dist.all_reduce(t)  # the parent goes on working beside its child
    if t.tolist() != [_sum_of(range(world_size))] * 10:
        problems.append(f"all_reduce in the parent after the split gave {t[0].item()}")
    dist.destroy_process_group(sub)
    return problems


def test_split_group():
    res = run_ranks(4, w_split, init="none", timeout_s=90)
    res.assert_no_problems()


def w_shrink(rank, world_size, excluded, how):
    import torch

    store = _init(rank, world_size, timeout_s=3.0)
    survivors = [r for r in range(world_size) if r not in excluded]
    t = torch.ones(10)
    dist.all_reduce(t)  # the group works before
    if rank in excluded:
        if how == "dies":
            os._exit(0)
        store.wait(["shrunk"])  # stays alive, takes no part
        return []
    from torch.distributed.distributed_c10d import SHRINK_ABORT, SHRINK_DEFAULT

    flags = SHRINK_DEFAULT
    if how == "dies":
        try:
            for _ in range(50):
                dist.all_reduce(t)
        except RuntimeError:
            pass  # the failure shrink_group recovers from
        flags = SHRINK_ABORT
    new = dist.shrink_group(sorted(excluded), shrink_flags=flags)
    problems = []
    if new.rank() != survivors.index(rank) or new.size() != len(survivors):
        problems.append(f"shrunk rank {new.rank()} of {new.size()}, expected {survivors.index(rank)} of {len(survivors)}")
    if dist.get_rank() != survivors.index(rank):
        problems.append(f"the new default group gives rank {dist.get_rank()}")
    t = torch.full((1000,), float(new.rank() + 1))
    dist.all_reduce(t)
    if t.tolist() != [_sum_of(range(len(survivors)))] * 1000:
        problems.append(f"all_reduce after the shrink gave {t[0].item()}, expected {_sum_of(range(len(survivors)))}")
    if new.rank() == 0:
        store.set("shrunk", "1")
    return problems


@pytest.mark.parametrize(
    "excluded,how", [([3], "leaves"), ([1], "leaves"), ([1, 2], "leaves"), ([2], "dies")], ids=["last", "middle", "two", "after-a-death"]
)
def test_shrink_group(excluded, how):
    res = run_ranks(4, w_shrink, excluded, how, init="none", timeout_s=90, expect_fail_ranks=tuple(excluded) if how == "dies" else ())
    problems = [f"rank {r}: {p}" for r in range(4) if r not in excluded or how != "dies" for p in (res.value(r) or [])]
    assert all(res.value(r) is not None for r in range(4) if r not in excluded), res.report()
    assert not problems, "\n".join(problems)


def w_merge(rank, world_size):
    import torch

    import xccl_rs  # noqa: F401

    shared = ctx().connect_store()
    # Each process is a world of its own; they merge into one group through a shared store.
    dist.init_process_group("xccl_rs", rank=0, world_size=1, store=dist.PrefixStore(f"own{rank}/", shared))
    merged = dist.group.WORLD.merge_remote_group(dist.PrefixStore("merged/", shared), world_size, timedelta(seconds=30))
    problems = []
    if merged.size() != world_size:
        problems.append(f"merged size {merged.size()}")
    t = torch.full((1000,), float(rank + 1))
    torch.distributed.all_reduce(t, group=merged)
    if t.tolist() != [_sum_of(range(world_size))] * 1000:
        problems.append(f"all_reduce in the merged group gave {t[0].item()}")
    shared.set(f"merged_rank/{rank}", str(merged.rank()))
    ranks = sorted(int(shared.get(f"merged_rank/{r}")) for r in range(world_size))
    if ranks != list(range(world_size)):
        problems.append(f"merged ranks {ranks}")
    return problems


def test_merge_remote_group():
    res = run_ranks(3, w_merge, init="none", timeout_s=90)
    res.assert_no_problems()
