"""The accelerator tests on an emulated XPU (python_tests/xpu_emu, docs/testing.md), so that
DeviceType::XPU itself runs in CI: the rank functions of test_gpu.py (and of the weight sync and
verl tests) with ``device_type="xpu"``, plus what only matters for XPU: the backend string
"cpu:gloo,xpu:xccl_rs", init_process_group(device_id=xpu:0), a tensor on the wrong XPU, and the
pinned host memory taken from the XPU host allocator.

The emulated streams are worker threads; XCCL_RS_XPU_EMU_POOL_DELAY_US slows every stream but
the default one, so that a copy back the caller's stream does not wait for is read stale.
Results are compared with references computed by torch on the CPU.
"""

from __future__ import annotations

import pytest

import test_gpu
import test_weight_sync
import xpu_emu
from harness import run_ranks

CHUNKED = test_gpu.CHUNKED
# Each task of the backend's copy streams waits 3 ms before it runs: far longer than the
# caller's next kernel takes to start.
DELAYED = {"XCCL_RS_XPU_EMU_POOL_DELAY_US": "3000"}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    reason = xpu_emu.unavailable_reason()
    if reason:
        pytest.skip(reason)
    xpu_emu.load()  # build once here, not in every rank at once


def run_xpu(world_size, fn, *args, env=None, **kwargs):
    return run_ranks(world_size, fn, *args, setup=xpu_emu.ACTIVATE, env=env, **kwargs)


def _check(res, world_size):
    test_gpu._check(res, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_on_xpu(world_size):
    _check(run_xpu(world_size, test_gpu.w_every_collective, device_type="xpu", timeout_s=300), world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_collective_on_xpu_in_chunks(world_size):
    res = run_xpu(world_size, test_gpu.w_every_collective, 3 * (16 << 10) + 37, device_type="xpu",
                  timeout_s=300, env=CHUNKED)
    _check(res, world_size)


def test_every_collective_on_xpu_in_many_chunks():
    # 10 float32 chunks, copy streams delayed: every window set is reused three times while
    # the copies lag behind the host.
    res = run_xpu(3, test_gpu.w_every_collective, 10 * (16 << 10) + 37, device_type="xpu",
                  timeout_s=300, env={**CHUNKED, "XCCL_RS_XPU_EMU_POOL_DELAY_US": "500"})
    _check(res, 3)


def test_pinned_memory_is_a_window_on_xpu():
    # 64 MiB in 1 MiB chunks; the staging must take its pinned memory from the XPU host allocator
    env = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(1 << 20)}
    _check(run_xpu(2, test_gpu.w_pinned_window, device_type="xpu", n=16 << 20, timeout_s=240, env=env), 2)


def w_broadcast_from_every_root(rank, world_size, n):
    """Broadcasts of ``n`` float32 from every root, each into tensors holding other values:
    every rank ends with the root's. In 1 MiB chunks by default the receivers read each chunk
    from the root's pinned staging buffer by cross-memory attach (tests/pipeline.rs counts it)."""
    import torch
    import torch.distributed as dist

    from accel import use

    dev = use("xpu")
    probs = []
    for root in range(world_size):
        want = torch.arange(n, dtype=torch.float32) * (root + 2)
        t = want.to(dev) if rank == root else torch.full((n,), -1.0, device=dev)
        dist.broadcast(t, src=root)
        got = t.cpu()
        if not torch.equal(got, want):
            probs.append(f"root {root}: {(got != want).sum().item()} of {n} elements differ")
    return probs


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_broadcast_from_every_root_on_xpu(world_size):
    # 3 chunks and a short one, the copy streams delayed: a receiver that read the root's pinned
    # buffer before its copy off the device, or a root that refilled it before the receivers
    # were done, would show other values.
    env = {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(1 << 20), "XCCL_RS_XPU_EMU_POOL_DELAY_US": "2000"}
    res = run_xpu(world_size, w_broadcast_from_every_root, (3 << 18) + 37, timeout_s=240, env=env)
    _check(res, world_size)


def test_xpu_stream_order():
    _check(run_xpu(2, test_gpu.w_stream_order, device_type="xpu", timeout_s=120, env=DELAYED), 2)


def test_xpu_stream_order_in_chunks():
    _check(run_xpu(2, test_gpu.w_stream_order, device_type="xpu", timeout_s=120, env={**CHUNKED, **DELAYED}), 2)


def test_xpu_async_futures():
    _check(run_xpu(3, test_gpu.w_futures, device_type="xpu", timeout_s=120, env=DELAYED), 3)


def test_mixed_cpu_xpu_group():
    _check(run_xpu(3, test_gpu.w_mixed, device_type="xpu", timeout_s=120), 3)


def test_mixed_cpu_xpu_group_in_chunks():
    _check(run_xpu(3, test_gpu.w_mixed, 3 * (16 << 10) + 37, device_type="xpu", timeout_s=120, env=CHUNKED), 3)


def test_size_mismatch_on_xpu_raises_everywhere():
    res = run_xpu(2, test_gpu.w_size_mismatch, device_type="xpu", timeout_s=120, pg_timeout_s=20, check=False)
    for r in range(2):
        msg = res.value(r)
        assert msg and "mismatch" in msg, f"rank {r}: {msg!r}\n{res.report()}"


def test_private_group_on_xpu():
    _check(run_xpu(2, test_gpu.w_private_group_on_cuda, device_type="xpu", timeout_s=120), 2)


def w_gloo_and_xccl(rank, world_size):
    """One group, "cpu:gloo,xpu:xccl_rs": host tensors go to gloo, XPU tensors to xccl_rs."""
    import torch
    import torch.distributed as dist

    probs = []
    pg = dist.group.WORLD
    names = {dt: pg._get_backend(torch.device(dt)).name() for dt in ("cpu", "xpu")}
    if names["cpu"].lower() != "gloo" or "xccl" not in names["xpu"].lower():
        probs.append(f"backends: {names}")
    want = float(world_size * (world_size + 1) // 2)
    for dev in ("cpu", "xpu"):
        t = torch.full((1031,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        if t.device.type != dev or not torch.equal(t.cpu(), torch.full((1031,), want)):
            probs.append(f"all_reduce on {dev}: {t.cpu()[:3].tolist()} on {t.device}")
    t = torch.arange(17, dtype=torch.float32, device="xpu") * (rank == 0)
    dist.broadcast(t, src=0)
    if not torch.equal(t.cpu(), torch.arange(17, dtype=torch.float32)):
        probs.append("broadcast on xpu")
    return probs


def test_gloo_for_cpu_xccl_rs_for_xpu():
    _check(run_xpu(2, w_gloo_and_xccl, backend="cpu:gloo,xpu:xccl_rs", timeout_s=120), 2)


def w_device_id(rank, world_size, wrong_rank=None):
    """init_process_group(device_id=xpu:0) binds every rank to xpu:0 (eager init): XPU tensors
    work; with ``wrong_rank``, that rank's tensor is on xpu:1 and every rank must get an error
    (the wrong one names the devices; its peers are aborted, not left to time out)."""
    import torch
    import torch.distributed as dist

    from harness import ctx

    c = ctx()
    dist.init_process_group("xccl_rs", store=c.connect_store(), rank=rank, world_size=world_size,
                            timeout=c.timeout(), device_id=torch.device("xpu", 0))
    t = torch.full((513,), float(rank + 1), device="xpu:0")
    dist.all_reduce(t)
    want = float(world_size * (world_size + 1) // 2)
    if not torch.equal(t.cpu(), torch.full((513,), want)):
        return [f"all_reduce after device_id: {t.cpu()[:3].tolist()}"]
    if wrong_rank is None:
        return []
    t = torch.ones(513, device="xpu:1" if rank == wrong_rank else "xpu:0")
    try:
        dist.all_reduce(t)
        torch.xpu.synchronize()
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_xpu_device_id():
    _check(run_xpu(3, w_device_id, init="none", timeout_s=120), 3)


def test_tensor_on_the_wrong_xpu_raises_everywhere():
    env = {"XCCL_RS_XPU_EMU_DEVICES": "2"}
    res = run_xpu(3, w_device_id, 1, init="none", timeout_s=120, pg_timeout_s=20, check=False, env=env)
    assert not res.rank_problems(), res.report()
    msgs = {r: res.value(r) for r in range(3)}
    assert "xpu:1" in msgs[1] and "xpu:0" in msgs[1], msgs
    for r in (0, 2):
        assert isinstance(msgs[r], str) and msgs[r] != "no error", msgs


def test_weight_sync_with_xpu_tensors_and_buckets():
    res = run_xpu(2, test_weight_sync.w_gpu, device_type="xpu", timeout_s=180)
    probs = res.value(0) + res.value(1)
    assert not probs, "\n".join(probs)


def test_verl_engine_on_xpu():
    pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (scripts/setup.sh installs it)")
    import test_verl

    n = test_verl.ACTOR_WS + test_verl.ROLLOUT_WS
    res = run_xpu(n, test_verl.w_verl_engine, device="xpu", bucket_device="xpu", timeout_s=180)
    problems = [f"rank {r}: {p}" for r in range(n) for p in res.value(r)["problems"]]
    assert not problems, "\n".join(problems)
