"""xccl_rs.new_group: private groups on any c10d Store, with public APIs only.

* no default process group at all: a TCPStore master on port 0 publishes its real port, the
  group is built over a PrefixStore on it, and its ProcessGroup methods and the
  torch.distributed functions that accept ``group=`` / ``group_src=`` give the results torch
  computes from the gathered inputs;
* two private groups alive at once beside a default gloo world, which keeps working;
* a group rebuilt five times under the same name on new store prefixes, each generation
  carrying a weight sync checked bit for bit (verl's ``rebuild_group``).
"""

from __future__ import annotations

import pytest

from harness import IS_XCCL, ctx, run_ranks, seed_of
from test_weight_sync import compare, make_tensors


def _master_store(rank: int, key: str):
    """rank 0 serves a TCPStore on port 0 and publishes the port it got through the harness's
    store (the way an RL controller passes an address); the others connect to it."""
    import torch.distributed as dist

    c = ctx()
    side = c.connect_store()
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, c.world_size, True, timeout=c.timeout(), wait_for_workers=False)
        side.set(key, str(store.port))
    else:
        side.wait([key], c.timeout())
        store = dist.TCPStore("127.0.0.1", int(side.get(key)), c.world_size, False, timeout=c.timeout())
    return store


def w_no_default_world(rank, world_size):
    import torch
    import torch.distributed as dist

    import xccl_rs

    problems = []
    assert not dist.is_initialized()
    store = _master_store(rank, "port")
    pg = xccl_rs.new_group(dist.PrefixStore("sync/0/", store), rank, world_size, timeout=ctx().timeout())
    if (pg.rank(), pg.size()) != (rank, world_size):
        problems.append(f"pg.rank()/size() = {pg.rank()}/{pg.size()}")
    inputs = [
        torch.randn(1001, generator=torch.Generator().manual_seed(seed_of("private", r))) for r in range(world_size)
    ]
    mine = inputs[rank]

    # the ProcessGroup's own methods
    t = mine.clone()
    pg.allreduce([t]).wait()
    if not torch.allclose(t, torch.stack(inputs).sum(0), rtol=1e-5, atol=1e-5):
        problems.append("pg.allreduce")
    opts = dist.BroadcastOptions()
    opts.rootRank = world_size - 1
    t = mine.clone()
    pg.broadcast([t], opts).wait()
    if not torch.equal(t, inputs[-1]):
        problems.append("pg.broadcast")
    outs = [[torch.empty_like(mine) for _ in range(world_size)]]
    pg.allgather(outs, [mine]).wait()
    if not all(torch.equal(a, b) for a, b in zip(outs[0], inputs)):
        problems.append("pg.allgather")
    pg.barrier().wait()

    # torch.distributed functions with group= (group_src=, not src=: src is a global rank and
    # needs a group registered in the default world)
    t = mine.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    if not torch.allclose(t, torch.stack(inputs).mean(0), rtol=1e-5, atol=1e-6):
        problems.append("dist.all_reduce AVG")
    t = mine.clone()
    dist.broadcast(t, group_src=1 % world_size, group=pg)
    if not torch.equal(t, inputs[1 % world_size]):
        problems.append("dist.broadcast(group_src=)")
    out = torch.empty(world_size * mine.numel())
    dist.all_gather_into_tensor(out, mine, group=pg)
    if not torch.equal(out, torch.cat(inputs)):
        problems.append("dist.all_gather_into_tensor")
    objs = [{"rank": rank}]
    dist.broadcast_object_list(objs, group_src=0, group=pg)
    if objs != [{"rank": 0}]:
        problems.append(f"dist.broadcast_object_list gave {objs}")
    dist.barrier(group=pg)
    if dist.is_initialized():
        problems.append("new_group initialised a default world")
    xccl_rs.destroy_group(pg)
    try:
        pg.allreduce([mine.clone()]).wait()
        problems.append("an op on a destroyed group did not raise")
    except Exception:  # noqa: BLE001 - any error is right; a hang or a result is not
        pass
    return problems


def w_beside_world(rank, world_size):
    """Default world (gloo, the harness's) + two private xccl_rs groups alive at once."""
    import torch
    import torch.distributed as dist

    import xccl_rs

    c = ctx()
    base = c.connect_store()
    a = xccl_rs.new_group(dist.PrefixStore("A/", base), rank, world_size, timeout=c.timeout(), name="A")
    b = xccl_rs.new_group(dist.PrefixStore("B/", base), world_size - 1 - rank, world_size, timeout=c.timeout(),
                          name="B")  # the same processes, ranks reversed
    problems = []
    ta, tb, tw = torch.full((5,), float(rank)), torch.full((5,), float(rank + 10)), torch.ones(5)
    wa = a.allreduce([ta])
    wb = b.allreduce([tb])
    dist.all_reduce(tw)  # the default world, while both private groups have work in flight
    wa.wait()
    wb.wait()
    n = world_size
    if ta.tolist() != [float(n * (n - 1) // 2)] * 5:
        problems.append(f"group A gave {ta.tolist()}")
    if tb.tolist() != [float(n * (n - 1) // 2 + 10 * n)] * 5:
        problems.append(f"group B gave {tb.tolist()}")
    if tw.tolist() != [float(n)] * 5:
        problems.append(f"default world gave {tw.tolist()}")
    xccl_rs.destroy_group(a)
    # B outlives A
    tb = torch.full((3,), 1.0)
    b.allreduce([tb]).wait()
    if tb.tolist() != [float(n)] * 3:
        problems.append(f"group B after A's destruction gave {tb.tolist()}")
    xccl_rs.destroy_group(b)
    return problems


def w_rebuild(rank, world_size):
    """Five generations of one group name (verl's rebuild_group), a weight sync in each."""
    import torch.distributed as dist

    import xccl_rs
    from xccl_rs.weight_sync import WeightReceiver, WeightSender

    store = _master_store(rank, "port")
    problems = []
    for gen in range(5):
        pg = xccl_rs.new_group(dist.PrefixStore(f"sync/gen{gen}/", store), rank, world_size,
                               timeout=ctx().timeout(), name="weight_sync")
        expected = make_tensors(f"rebuild{gen}")[:6]
        if rank == 0:
            WeightSender(pg, src=0, bucket_bytes=64 << 10).send(expected)
        else:
            problems += [f"gen {gen}: {p}" for p in compare(list(WeightReceiver(pg, src=0).receive()), expected)]
        xccl_rs.destroy_group(pg)
    return problems


def test_private_group_without_default_world():
    for world in (1, 3):
        res = run_ranks(world, w_no_default_world, init="none", timeout_s=90)
        res.assert_no_problems(f"w{world} ")


def test_private_groups_beside_default_world():
    res = run_ranks(3, w_beside_world, backend="gloo", timeout_s=90)
    res.assert_no_problems()


def test_rebuild_five_times():
    res = run_ranks(3, w_rebuild, init="none", timeout_s=120)
    res.assert_no_problems()


def w_device_argument(rank, world_size):
    import torch
    import torch.distributed as dist

    import xccl_rs

    problems = []
    store = dist.PrefixStore("dev/", ctx().connect_store())
    pg = xccl_rs.new_group(store, rank, world_size, timeout=ctx().timeout(), device="cpu")
    t = torch.ones(7)
    pg.allreduce([t]).wait()
    if t.tolist() != [float(world_size)] * 7:
        problems.append(f"device='cpu' group gave {t.tolist()}")
    xccl_rs.destroy_group(pg)
    try:
        xccl_rs.new_group(dist.PrefixStore("dev2/", store), rank, world_size, device="meta")
        problems.append("device='meta' did not raise")
    except ValueError as e:
        if "meta" not in str(e):
            problems.append(f"device='meta' raised {e!r}")
    return problems


def test_device_argument():
    res = run_ranks(2, w_device_argument, init="none", timeout_s=90)
    res.assert_no_problems()


def w_names(rank, world_size):
    """Where torch asks for the backend's name, the answer is xccl_rs: the backend, a private
    group (ProcessGroup.name(), DDP's logging data), and the default world and a dist.new_group
    (ProcessGroup.name(), DDP's logging data, dist.get_backend)."""
    import torch
    import torch.distributed as dist

    import xccl_rs

    c = ctx()
    problems = []
    dist.init_process_group("xccl_rs", store=dist.PrefixStore("world/", c.connect_store()), rank=rank,
                            world_size=world_size, timeout=c.timeout())
    pg = xccl_rs.new_group(dist.PrefixStore("private/", c.connect_store()), rank, world_size, timeout=c.timeout())
    names = {
        "dist.get_backend()": dist.get_backend(),
        "the world": dist.group.WORLD.name(),
        "the world's CPU backend": dist.group.WORLD._get_backend(torch.device("cpu")).name(),
        "a dist.new_group": dist.new_group([0, 1]).name(),
        "the private group": pg.name(),
        "the private group's CPU backend": pg._get_backend(torch.device("cpu")).name(),
    }
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2), process_group=pg)
    names["DDP's logging data on the private group"] = model._get_ddp_logging_data().get("backend_name")
    world_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    names["DDP's logging data on the world"] = world_model._get_ddp_logging_data().get("backend_name")
    # The world still runs (the group torch uses is ours, with our backend on every device).
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if t.tolist() != [1.5] * 3:
        problems.append(f"AVG all_reduce on the world gave {t.tolist()}")
    problems += [f"{what} says {name!r}" for what, name in names.items() if name != "xccl_rs"]
    xccl_rs.destroy_group(pg)
    return problems


@pytest.mark.skipif(not IS_XCCL, reason="concerns xccl_rs's name")
def test_torch_sees_our_name():
    res = run_ranks(2, w_names, init="none", timeout_s=90)
    res.assert_no_problems()


def w_detail_wrapper(rank, world_size):
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL the world (our ProcessGroup, see _whole_group) still
    has torch's checking wrapper: a shape mismatch is reported by torch's wrapper itself."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4 if rank == 0 else 5)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return str(e)
    return "no error"


@pytest.mark.skipif(not IS_XCCL, reason="concerns the group xccl_rs returns to torch")
def test_detail_debug_wraps_the_world():
    res = run_ranks(2, w_detail_wrapper, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout_s=90)
    for r in range(2):
        assert "Detected mismatch between collectives" in res.value(r), f"rank {r}: {res.value(r)}"
