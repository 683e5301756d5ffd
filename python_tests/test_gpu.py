"""Accelerator tensors (CUDA here, the stand-in for XPU): every collective on device tensors at
world sizes 1 to 4, stream ordering, async ops with futures, a mixed CPU/CUDA group, and the
error cases. All ranks share the one GPU of the test machine (cuda:0). Results are compared
with references computed by torch on the CPU from every rank's inputs (regenerated from seeds).

Marked ``gpu``: skipped where there is no accelerator (CI); run on the GPU machine with
``scripts/gpu/run.sh tests``.
"""

from __future__ import annotations

import pytest

from harness import run_ranks, seed_of

pytestmark = pytest.mark.gpu

N = 1000 + 37  # odd, and not a multiple of the world size


def _inputs(case, world_size, n=N, dtype="float32"):
    import torch

    dt = getattr(torch, dtype)
    out = []
    for r in range(world_size):
        g = torch.Generator().manual_seed(seed_of(case, r))
        out.append(torch.randn(n, generator=g).to(dt))
    return out


def _close(got, want, what, probs, exact=False):
    import torch

    got = got.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        probs.append(f"{what}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}")
        return
    ok = torch.equal(got, want) if exact else torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if not ok:
        probs.append(f"{what}: max error {(got.float() - want.float()).abs().max().item()}")


def w_every_collective(rank, world_size, N=N, device_type="cuda"):  # noqa: N803 (the element count, as above)
    import torch
    import torch.distributed as dist

    from accel import use

    dev = use(device_type)
    n = world_size
    probs = []
    for dtype in ("float32", "bfloat16"):
        xs = _inputs(f"gpu-{dtype}", n, n=N, dtype=dtype)
        mine = xs[rank].to(dev)
        stack = torch.stack([x.float() for x in xs])
        for op, ref in (
            (dist.ReduceOp.SUM, stack.sum(0)),
            (dist.ReduceOp.AVG, stack.mean(0)),
            (dist.ReduceOp.MAX, stack.max(0).values),
            (dist._make_nccl_premul_sum(0.5), stack.sum(0) * 0.5),
        ):
            t = mine.clone()
            dist.all_reduce(t, op=op)
            _close(t, ref.to(t.dtype), f"all_reduce {op} {dtype}", probs)
        # non-contiguous device tensor, in place
        t = torch.stack([mine, mine], dim=1)[:, 0]  # stride 2
        assert not t.is_contiguous()
        dist.all_reduce(t)
        _close(t, stack.sum(0).to(t.dtype), f"all_reduce non-contiguous {dtype}", probs)

        root = n - 1
        t = mine.clone()
        dist.broadcast(t, src=root)
        _close(t, xs[root], f"broadcast {dtype}", probs, exact=True)

        t = mine.clone()
        dist.reduce(t, dst=0)
        _close(t, stack.sum(0).to(t.dtype) if rank == 0 else xs[rank], f"reduce {dtype}", probs)

        outs = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(outs, mine)
        for r in range(n):
            _close(outs[r], xs[r], f"all_gather[{r}] {dtype}", probs, exact=True)
        out = torch.empty(n * N, dtype=mine.dtype, device=dev)
        dist.all_gather_into_tensor(out, mine)
        _close(out, torch.cat(xs), f"all_gather_into_tensor {dtype}", probs, exact=True)

        # in place: the input is this rank's block of the output
        out = torch.zeros(n * N, dtype=mine.dtype, device=dev)
        out[rank * N : (rank + 1) * N].copy_(mine)
        dist.all_gather_into_tensor(out, out[rank * N : (rank + 1) * N])
        _close(out, torch.cat(xs), f"all_gather_into_tensor in place {dtype}", probs, exact=True)

        per = [torch.stack([x.float() for x in _inputs(f"rs-{dtype}-{r}", n, n=N, dtype=dtype)]) for r in range(n)]
        rs_in = torch.cat([per[rank][j].to(mine.dtype) for j in range(n)]).to(dev)
        rs_out = torch.empty(N, dtype=mine.dtype, device=dev)
        dist.reduce_scatter_tensor(rs_out, rs_in)
        want = sum(per[r][rank] for r in range(n)).to(mine.dtype)
        _close(rs_out, want, f"reduce_scatter_tensor {dtype}", probs)
        rs_list = [per[rank][j].to(mine.dtype).to(dev) for j in range(n)]
        rs_out2 = torch.empty(N, dtype=mine.dtype, device=dev)
        dist.reduce_scatter(rs_out2, rs_list)
        _close(rs_out2, want, f"reduce_scatter {dtype}", probs)

        # all-to-all with unequal splits: rank r sends (j + 1) * (r + 1) elements to rank j
        send_counts = [(j + 1) * (rank + 1) for j in range(n)]
        recv_counts = [(rank + 1) * (r + 1) for r in range(n)]
        payload = torch.cat([torch.full((c,), float(rank * 100 + j)) for j, c in enumerate(send_counts)]).to(mine.dtype)
        got = torch.empty(sum(recv_counts), dtype=mine.dtype, device=dev)
        dist.all_to_all_single(got, payload.to(dev), recv_counts, send_counts)
        want = torch.cat([torch.full((c,), float(r * 100 + rank)) for r, c in enumerate(recv_counts)]).to(mine.dtype)
        _close(got, want, f"all_to_all_single {dtype}", probs, exact=True)

        gl = [torch.empty_like(mine) for _ in range(n)] if rank == 0 else None
        dist.gather(mine, gl, dst=0)
        if rank == 0:
            for r in range(n):
                _close(gl[r], xs[r], f"gather[{r}] {dtype}", probs, exact=True)
        t = torch.empty_like(mine)
        dist.scatter(t, [x.to(dev) for x in xs] if rank == 0 else None, src=0)
        _close(t, xs[rank], f"scatter {dtype}", probs, exact=True)
    if n > 1:
        t = torch.full((N,), float(rank), device=dev)
        if rank == 0:
            dist.send(t, dst=1)
        elif rank == 1:
            dist.recv(t, src=0)
            _close(t, torch.zeros(N), "send/recv", probs, exact=True)
    dist.barrier()
    return probs


def w_stream_order(rank, world_size, device_type="cuda"):
    """A kernel queued behind a long sleep writes the tensor just before the collective; a
    kernel reads it just after wait(). Both must see the collective in stream order."""
    import torch
    import torch.distributed as dist

    from accel import current_stream, side_stream, sleep, use

    dev = use(device_type)
    probs = []
    for async_op in (False, True):
        t = torch.zeros(1 << 20, device=dev)
        sleep(device_type, 100)  # ~0.1 s of device time: the fill runs long after the call
        t.fill_(rank + 1.0)
        work = dist.all_reduce(t, async_op=async_op)
        if async_op:
            work.wait()
        y = t * 2  # enqueued after wait(): must read the reduced values
        want = float(world_size * (world_size + 1))  # 2 * sum(1..n)
        if not torch.equal(y.cpu(), torch.full_like(y.cpu(), want)):
            probs.append(f"async_op={async_op}: read {y[0].item()} after wait, expected {want}")
    # a side stream: the collective follows the work queued on the stream current at the call
    side, on_side = side_stream(device_type)
    with on_side:
        t = torch.empty(4096, device=dev)
        sleep(device_type, 50)
        t.fill_(1.0)
        dist.all_reduce(t)
        z = t + 0
    current_stream(device_type).wait_stream(side)
    if z[0].item() != world_size:
        probs.append(f"side stream: {z[0].item()}, expected {world_size}")
    return probs


def w_futures(rank, world_size, device_type="cuda"):
    import torch
    import torch.distributed as dist

    from accel import use

    dev = use(device_type)
    probs = []
    ts = [torch.full((1 << 18,), float(rank + i), device=dev) for i in range(8)]
    futs = [dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).get_future() for t in ts]
    for i, f in enumerate(futs):
        val = f.wait()
        if not isinstance(val, list) or val[0].device != dev:
            probs.append(f"future {i}: value {type(val)} on {getattr(val[0], 'device', None)}")
            continue
        want = (world_size - 1) / 2 + i
        got = (val[0] * 1).mean().item()  # a kernel on the current stream, after fut.wait()
        if abs(got - want) > 1e-5:
            probs.append(f"future {i}: {got}, expected {want}")
    # then(): DDP's comm-hook pattern
    t = torch.ones(16, device=dev)
    chained = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
    got = chained.wait()
    if got[0].item() != 3 * world_size:
        probs.append(f"then(): {got[0].item()}, expected {3 * world_size}")
    return probs


def w_mixed(rank, world_size, n=5000, device_type="cuda"):
    """Rank 0 on the CPU, the others on the accelerator: one group, one collective."""
    import torch
    import torch.distributed as dist

    from accel import use

    dev = torch.device("cpu") if rank == 0 else use(device_type)
    probs = []
    t = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    if t.device != dev or t.cpu().tolist() != [float(world_size * (world_size + 1) // 2)] * n:
        probs.append(f"all_reduce: {t[0].item()} on {t.device}")
    b = torch.arange(n + 7, dtype=torch.float32, device=dev) if rank == 1 else torch.zeros(n + 7, device=dev)
    dist.broadcast(b, src=1)
    if not torch.equal(b.cpu(), torch.arange(n + 7, dtype=torch.float32)):
        probs.append(f"broadcast from a {device_type} rank to a CPU rank")
    out = torch.empty(world_size * 3, device=dev)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), device=dev))
    want = torch.arange(world_size, dtype=torch.float32).repeat_interleave(3)
    if not torch.equal(out.cpu(), want):
        probs.append(f"all_gather_into_tensor: {out.cpu().tolist()}")
    return probs


def w_size_mismatch(rank, world_size, device_type="cuda"):
    import torch
    import torch.distributed as dist

    from accel import synchronize, use

    t = torch.ones(100 + (rank == 1), device=use(device_type))
    try:
        dist.all_reduce(t)
        synchronize(device_type)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


def _check(res, world_size):
    probs = [f"rank {r}: {p}" for r in range(world_size) for p in (res.value(r) or [])]
    assert not probs, "\n".join(probs)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_on_cuda(world_size):
    _check(run_ranks(world_size, w_every_collective, timeout_s=240), world_size)


# Chunks of 64 KiB (the smallest allowed): float32 tensors of 4 chunks, bfloat16 of 2, so that
# every collective runs its chunk pipeline (src/pipeline.rs, csrc/device.cc) on device tensors.
CHUNKED = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(64 << 10)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_on_cuda_in_chunks(world_size):
    res = run_ranks(world_size, w_every_collective, 3 * (16 << 10) + 37, timeout_s=240, env=CHUNKED)
    _check(res, world_size)


def test_every_collective_on_cuda_in_many_chunks():
    # 10 float32 chunks: every window set (csrc/device.cc) is reused three times.
    res = run_ranks(3, w_every_collective, 10 * (16 << 10) + 37, timeout_s=240, env=CHUNKED)
    _check(res, 3)


def w_pinned_window(rank, world_size, device_type="cuda", n=64 << 20):
    """A 256 MiB broadcast and all-reduce in 4 MiB chunks: right results, and the pinned host
    memory in use stays near the window (three sets of one 4 MiB slot, rounded up to a power of
    two by the caching host allocator), far below the tensor's size."""
    import torch
    import torch.distributed as dist

    from accel import synchronize, use

    dev = use(device_type)
    # n: float32 elements (256 MiB by default)
    probs = []
    t = torch.arange(n, dtype=torch.float32, device=dev) if rank == 0 else torch.zeros(n, device=dev)
    dist.broadcast(t, src=0)
    if not torch.equal(t, torch.arange(n, dtype=torch.float32, device=dev)):
        probs.append("broadcast: wrong values")
    t = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((n,), float(world_size * (world_size + 1) // 2), device=dev)):
        probs.append("all_reduce: wrong values")
    synchronize(device_type)
    return probs + _pinned_peak_problems(device_type, n * 4)


def _pinned_peak_problems(device_type, tensor_bytes):
    """The pinned host memory in use peaked far below the tensor's size (a quarter), and came
    from the host allocator of ``device_type``."""
    import torch

    if device_type == "cuda":
        peak = torch.cuda.host_memory_stats()["active_bytes.peak"]
    else:
        import xpu_emu

        stats = xpu_emu.load().host_memory_stats()
        if stats["allocations"] == 0:
            return ["no pinned host memory came from the xpu host allocator"]
        peak = stats["peak_bytes"]
    if peak > tensor_bytes // 4:
        return [f"pinned host memory in use peaked at {peak >> 20} MiB for a {tensor_bytes >> 20} MiB tensor"]
    return []


def w_broadcast_from_every_root(rank, world_size, n, through_arena):
    """Broadcasts of ``n`` float32 elements from every root, twice each: every rank ends with the
    root's values. With a heap the root stages each one in its arena of registered shared memory,
    and the receivers copy from there onto their device (src/staging/shared.rs): the broadcast
    runs zero-copy; without one it does not."""
    import torch
    import torch.distributed as dist

    import xccl_rs
    from accel import use

    dev = use("cuda")
    probs = []
    for root in range(world_size):
        for round_ in range(2):  # the second reuses the arena and the receivers' registrations
            want = torch.arange(n, dtype=torch.float32, device=dev) * (root + 1) + round_
            t = want.clone() if rank == root else torch.full((n,), -1.0, device=dev)
            before = xccl_rs.zero_copy_ops()
            dist.broadcast(t, src=root)
            what = f"broadcast from {root}, round {round_}"
            if not torch.equal(t, want):
                probs.append(f"{what}: {(t != want).sum().item()} of {n} elements wrong")
            if (xccl_rs.zero_copy_ops() > before) != through_arena:
                probs.append(f"{what}: ran zero-copy: {xccl_rs.zero_copy_ops() > before}, expected {through_arena}")
    return probs


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("through_arena", [True, False], ids=["arena", "no-heap"])
def test_large_broadcast_from_every_root(world_size, through_arena):
    # Ten 4 MiB chunks and a short one: the window's three sets are each reused three times.
    env = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(4 << 20)}
    if not through_arena:
        env["XCCL_RS_SHM_HEAP_BYTES"] = "0"
    _check(run_ranks(world_size, w_broadcast_from_every_root, 10 * (1 << 20) + 37, through_arena, timeout_s=240, env=env), world_size)


def w_broadcast_in_a_new_group_every_round(rank, world_size, n, rounds):
    """A sync that builds a new group every round (verl's rebuild): each round's group
    broadcasts ``n`` float32 elements from rank 0 and is destroyed. Arenas outlive their groups
    (src/staging/shared.rs), so over every round the root registers its arena once and each
    receiver the root's arena once; the debug log (XCCL_RS_LOG=debug, this rank's stderr sent
    to a file) names each registration."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist

    from accel import use

    dev = use("cuda")
    log = tempfile.NamedTemporaryFile(prefix=f"xccl_rs_log_{rank}_", delete=False)
    os.dup2(log.fileno(), 2)
    probs = []
    for round_ in range(rounds):
        group = dist.new_group(list(range(world_size)), backend="xccl_rs")
        want = torch.arange(n, dtype=torch.float32, device=dev) + round_
        t = want.clone() if rank == 0 else torch.full((n,), -1.0, device=dev)
        dist.broadcast(t, src=0, group=group)
        if not torch.equal(t, want):
            probs.append(f"round {round_}: {(t != want).sum().item()} of {n} elements wrong")
        dist.destroy_process_group(group)
    text = open(log.name).read()
    own, peers = text.count("registered the staging arena"), text.count("registered a peer's staging arena")
    want = (1, 0) if rank == 0 else (0, 1)
    if (own, peers) != want:
        probs.append(f"{rounds} groups registered {own} arenas of this rank and {peers} of peers, expected {want}")
    return probs


def test_arenas_are_registered_once_across_groups():
    env = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(4 << 20), "XCCL_RS_LOG": "debug"}
    _check(run_ranks(3, w_broadcast_in_a_new_group_every_round, 10 * (1 << 20) + 37, 3, timeout_s=240, env=env), 3)


def test_pinned_memory_is_a_window():
    import torch

    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    env = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(4 << 20)}
    _check(run_ranks(2, w_pinned_window, timeout_s=180, env=env), 2)


def test_mixed_cpu_cuda_group_in_chunks():
    _check(run_ranks(3, w_mixed, 3 * (16 << 10) + 37, timeout_s=120, env=CHUNKED), 3)


def test_stream_order():
    _check(run_ranks(2, w_stream_order, timeout_s=120), 2)


def test_stream_order_in_chunks():
    _check(run_ranks(2, w_stream_order, timeout_s=120, env=CHUNKED), 2)


def test_async_futures():
    _check(run_ranks(3, w_futures, timeout_s=120), 3)


def test_mixed_cpu_cuda_group():
    _check(run_ranks(3, w_mixed, timeout_s=120), 3)


def test_size_mismatch_on_cuda_raises_everywhere():
    res = run_ranks(2, w_size_mismatch, timeout_s=120, pg_timeout_s=20, check=False)
    for r in range(2):
        msg = res.value(r)
        assert msg and "mismatch" in msg, f"rank {r}: {msg!r}\n{res.report()}"


def w_private_group_on_cuda(rank, world_size, device_type="cuda"):
    """xccl_rs.new_group(device="cuda"): bound to the current CUDA device; CUDA tensors work
    through the group's own methods and dist.*(group=)."""
    import torch
    import torch.distributed as dist

    import xccl_rs
    from accel import use
    from harness import ctx

    use(device_type)
    probs = []
    store = dist.PrefixStore(f"private_{device_type}/", ctx().connect_store())
    pg = xccl_rs.new_group(store, rank, world_size, timeout=ctx().timeout(), device=device_type)
    t = torch.full((4097,), float(rank + 1), device=device_type)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
    want = (world_size + 1) / 2
    if not torch.allclose(t.cpu(), torch.full((4097,), want)):
        probs.append(f"AVG over the private group: {t[0].item()}, expected {want}")
    b = torch.arange(100, dtype=torch.float32, device=device_type) * (rank == 0)
    dist.broadcast(b, group_src=0, group=pg)
    if not torch.equal(b.cpu(), torch.arange(100, dtype=torch.float32)):
        probs.append("broadcast over the private group")
    xccl_rs.destroy_group(pg)
    return probs


def test_private_group_on_cuda():
    _check(run_ranks(2, w_private_group_on_cuda, timeout_s=120), 2)
