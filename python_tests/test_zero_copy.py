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
        # 96 KiB and a few elements: past the one-shot limit (64 KiB of peers' reads) at every
        # group size here, so zero-copy through the first block's answers, not a pre-sync.
        for n in [(96 << 10) // item + 5, (1 << 20) // item, (3 << 20) // item + 7]:
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


def zero_copy_moves(rank, w):
    """broadcast, all_gather_into_tensor (also in place), all_gather (a list of outputs) and
    reduce_scatter_tensor on heap tensors, against torch references of every rank's input."""
    import torch
    import torch.distributed as dist

    import xccl_rs
    from refs import BF16, F32, dname, gen, make_op, reduce_ref

    ck = Checker()

    def place(t, heap):
        if not heap:
            return t.clone()
        z = xccl_rs.empty(t.shape, dtype=t.dtype)
        return z.copy_(t)

    for dtype in [F32, BF16]:
        item = torch.empty(0, dtype=dtype).element_size()
        n = (1 << 20) // item + 5 * w  # the op's bytes at least 1 MiB, elements divisible by w
        n -= n % w
        for placement in ["all", "mixed"]:
            heap = not (placement == "mixed" and rank == 1)
            want = 1 if placement == "all" else 0
            for root in range(w):
                case = f"broadcast/{dname(dtype)}/n{n}/root{root}/{placement}"
                with ck.case(case):
                    xs = [gen(dtype, n, case, r) for r in range(w)]
                    t = place(xs[rank], heap)
                    before = xccl_rs.zero_copy_ops()
                    dist.broadcast(t, src=root)
                    ck.equal(t, xs[root])
                    # Only the root's tensor matters for a broadcast.
                    ran = xccl_rs.zero_copy_ops() - before
                    expect = 0 if (placement == "mixed" and root == 1) else 1
                    ck.check(ran == expect, f"{ran} zero-copy ops ran, expected {expect}")
            m = n // w
            for inplace in [False, True]:
                case = f"all_gather_into_tensor/{dname(dtype)}/m{m}/{placement}/inplace{inplace}"
                with ck.case(case):
                    xs = [gen(dtype, m, case, r) for r in range(w)]
                    if inplace:
                        out = place(torch.zeros(m * w, dtype=dtype), heap)
                        inp = out[rank * m:(rank + 1) * m]
                        inp.copy_(xs[rank])
                    else:
                        out = torch.full((m * w,), -7, dtype=dtype)
                        inp = place(xs[rank], heap)
                    before = xccl_rs.zero_copy_ops()
                    dist.all_gather_into_tensor(out, inp)
                    ck.equal(out, torch.cat(xs))
                    ran = xccl_rs.zero_copy_ops() - before
                    ck.check(ran == want, f"{ran} zero-copy ops ran, expected {want}")
            case = f"all_gather/{dname(dtype)}/m{m}/{placement}"
            with ck.case(case):
                xs = [gen(dtype, m, case, r) for r in range(w)]
                outs = [torch.full((m,), -7, dtype=dtype) for _ in range(w)]
                before = xccl_rs.zero_copy_ops()
                dist.all_gather(outs, place(xs[rank], heap))
                for r in range(w):
                    ck.equal(outs[r], xs[r], f"output {r}")
                ran = xccl_rs.zero_copy_ops() - before
                ck.check(ran == want, f"{ran} zero-copy ops ran, expected {want}")
            for op in ["SUM", "AVG", "PREMUL_SUM"]:
                case = f"reduce_scatter_tensor/{dname(dtype)}/{op}/m{m}/{placement}"
                with ck.case(case):
                    redop, factor = make_op(op, dtype)
                    ins = [[gen(dtype, m, case, r, c) for c in range(w)] for r in range(w)]
                    inp = place(torch.cat(ins[rank]), heap)
                    out = torch.full((m,), -7, dtype=dtype)
                    before = xccl_rs.zero_copy_ops()
                    dist.reduce_scatter_tensor(out, inp, op=redop)
                    reduce_ref([ins[r][rank] for r in range(w)], op, factor).check(ck, out)
                    ran = xccl_rs.zero_copy_ops() - before
                    ck.check(ran == want, f"{ran} zero-copy ops ran, expected {want}")
    return ck.summary()


@pytest.mark.parametrize("w", [2, 3])
def test_zero_copy_moves(w):
    res = run_ranks(w, zero_copy_moves, timeout_s=300)
    for r in range(w):
        assert res.value(r)["cases"] >= 20, res.value(r)


# The second case cuts every tensor into blocks of 64 KiB (so the 96 KiB, 1 MiB and 3 MiB tensors
# take 2, 16 and 49 blocks, the last one short), writes the copies with streaming stores and splits every
# step over two threads (pieces of at least 4 KiB).
SMALL_BLOCKS = {"XCCL_RS_SHM_CHUNK_BYTES": "65536", "XCCL_RS_STREAMING_STORE_BYTES": "0", "XCCL_RS_THREADS": "2", "XCCL_RS_THREAD_MIN_BYTES": "4096"}


@pytest.mark.parametrize("w,env", [(2, None), (3, None), (3, SMALL_BLOCKS)], ids=["w2", "w3", "w3-small-blocks"])
def test_zero_copy_all_reduce(w, env):
    res = run_ranks(w, zero_copy_sweep, timeout_s=400, env=env)
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
    # The heap's file is unlinked at set-up, like the segments: nothing of this rank's shows in
    # /dev/shm (other jobs on the machine may have theirs there while they set up).
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"xccl_rs-heap-{os.getpid()}-")]
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


def test_a_group_spanning_hosts_has_no_heap():
    # Four ranks posing as two hosts: a mixed group, whose collectives never read in place.
    run_ranks(4, no_heap, rank_env=lambda r: {"XCCL_RS_HOST_ID": f"zero-copy-host-{r // 2}"})


def one_count_per_op(rank, w):
    """An op of several pipeline chunks (XCCL_RS_PIPELINE_CHUNK_BYTES below its size) counts
    once in zero_copy_ops, whatever the number of chunks that ran zero-copy."""
    import torch
    import torch.distributed as dist

    import xccl_rs

    problems = []
    n = (3 << 20) // 4 + 17  # three and a bit 1 MiB chunks of float32
    t = xccl_rs.empty(n, dtype=torch.float32).fill_(rank + 1)
    out = xccl_rs.empty(n * w, dtype=torch.float32)
    rs = xccl_rs.empty(n, dtype=torch.float32)
    ops = {
        "all_reduce": lambda: dist.all_reduce(t),
        "broadcast": lambda: dist.broadcast(t, src=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, t),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(rs, out),
    }
    for name, run in ops.items():
        before = xccl_rs.zero_copy_ops()
        run()
        ran = xccl_rs.zero_copy_ops() - before
        if ran != 1:
            problems.append(f"{name} of {n * 4} bytes in 1 MiB pipeline chunks counted {ran} zero-copy ops, not 1")
    return problems


def test_an_op_of_several_pipeline_chunks_counts_once():
    res = run_ranks(2, one_count_per_op, env={"XCCL_RS_PIPELINE_CHUNK_BYTES": str(1 << 20)})
    res.assert_no_problems()
