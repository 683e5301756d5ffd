"""Zero-copy collectives on tensors from the ranks' shared-memory heaps (xccl_rs.empty and
torch's Backend.allocate_tensor): all_reduce results against torch references computed from
every rank's input, the fallback when some rank's tensor is an ordinary one, the allocator API's
errors, and the groups that have no heap."""

from __future__ import annotations

import pytest

from harness import IS_GLOO, Checker, run_ranks

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs's shared-memory heap")


def zero_copy_sweep(rank, w):
    import torch
    import torch.distributed as dist

    import xccl_rs
    from refs import BF16, F16, F32, F64, dname, gen, make_op, reduce_ref

    ck = Checker()
    expected_ops = 0
    for dtype in [F32, BF16, F16, F64, torch.int32]:
        ops = ["SUM", "AVG", "MAX", "PREMUL_SUM"] if dtype.is_floating_point else ["SUM", "MIN"]
        item = torch.empty(0, dtype=dtype).element_size()
        for n in [(1 << 20) // item, (3 << 20) // item + 7]:
            for op in ops:
                # "all": every rank's tensor in its heap; "view": a view at an odd element
                # offset inside a heap tensor; "mixed": rank 0's is an ordinary tensor.
                for placement in ["all", "view", "mixed"]:
                    case = f"all_reduce/{dname(dtype)}/{op}/n{n}/{placement}"
                    with ck.case(case):
                        redop, factor = make_op(op, dtype)
                        xs = [gen(dtype, n, case, r) for r in range(w)]
                        if placement == "mixed" and rank == 0:
                            t = xs[rank].clone()
                        elif placement == "view":
                            t = xccl_rs.empty(n + 3, dtype=dtype)[3:]
                            t.copy_(xs[rank])
                        else:
                            t = xccl_rs.empty(n, dtype=dtype)
                            t.copy_(xs[rank])
                        before = xccl_rs.zero_copy_ops()
                        dist.all_reduce(t, op=redop)
                        reduce_ref(xs, op, factor).check(ck, t)
                        ran = xccl_rs.zero_copy_ops() - before
                        want = 0 if placement == "mixed" else 1
                        ck.check(ran == want, f"{ran} zero-copy ops ran, expected {want}")
                        expected_ops += want
    ck.check(xccl_rs.zero_copy_ops() == expected_ops, f"{xccl_rs.zero_copy_ops()} zero-copy ops in all, expected {expected_ops}")
    return ck.summary()


@pytest.mark.parametrize("w", [2, 3])
def test_zero_copy_all_reduce(w):
    res = run_ranks(w, zero_copy_sweep, timeout_s=400)
    for r in range(w):
        assert res.value(r)["cases"] > 100, res.value(r)


def allocator_api(rank, w):
    import os

    import torch
    import torch.distributed as dist

    import xccl_rs

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    cpu = torch.device("cpu")
    assert backend.supports_tensor_alloc(cpu)
    t = backend.allocate_tensor(1000, dtype=torch.bfloat16, device=cpu)
    assert t.shape == (1000,) and t.dtype == torch.bfloat16 and t.device == cpu, t
    try:
        backend.allocate_tensor(10, dtype=torch.float32, device=torch.device("cuda", 0))
        raise AssertionError("a CUDA tensor was allocated from the heap")
    except ValueError as e:
        assert "CPU tensors" in str(e), e
    try:
        xccl_rs.empty(1 << 50, dtype=torch.float32)
        raise AssertionError("an allocation beyond the heap succeeded")
    except RuntimeError as e:
        assert "XCCL_RS_SHM_HEAP_BYTES" in str(e), e
    z = xccl_rs.zeros(3, 5, dtype=torch.float64)
    assert z.shape == (3, 5) and bool((z == 0).all())
    with pytest.raises(RuntimeError):
        z.resize_(1 << 20)  # the storage has no allocator: it cannot grow out of the heap
    # The heap's file is unlinked at set-up, like the segments: nothing shows in /dev/shm.
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("xccl_rs-heap")]
    # A heap tensor stays valid after its group is gone.
    keep = xccl_rs.empty(1 << 18, dtype=torch.float32)
    keep.fill_(rank)
    dist.all_reduce(keep)
    dist.destroy_process_group()
    keep += 1
    assert bool((keep == sum(range(w)) + 1).all())
    return True


def test_allocator_api():
    run_ranks(2, allocator_api, destroy=False)


def no_heap(rank, w):
    import torch
    import torch.distributed as dist

    import xccl_rs

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert not backend.supports_tensor_alloc(torch.device("cpu"))
    t = xccl_rs.empty(1 << 19, dtype=torch.float32)  # an ordinary tensor then
    t.fill_(rank + 1)
    dist.all_reduce(t)
    assert bool((t == w * (w + 1) / 2).all())
    assert xccl_rs.zero_copy_ops() == 0
    return True


@pytest.mark.parametrize("env", [{"XCCL_RS_TRANSPORT": "tcp"}, {"XCCL_RS_SHM_HEAP_BYTES": "0"}])
def test_groups_without_a_heap_fall_back_to_ordinary_tensors(env):
    run_ranks(2, no_heap, env=env)
