"""Backend registration and initialisation paths: env://, explicit store, device-mapped
backend strings, subgroups (with non-members), a torchrun launch, and autoload through the
"torch.distributed.backends" entry point (without `import xccl_rs`); the device types xccl_rs
registers (only those the host has: torch picks its device from them) and the error for a
device-mapped string naming a device the host lacks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness import BACKEND, IS_GLOO, IS_XCCL, Checker, backend_for, run_ranks


def _allreduce_check(rank, w, expect_backend_config=None, cpu_backend_is_gloo=None):
    import torch
    import torch.distributed as dist

    ck = Checker()
    with ck.case("init/state"):
        ck.check(dist.is_initialized(), "not initialized")
        ck.check(dist.get_rank() == rank, f"get_rank() = {dist.get_rank()}")
        ck.check(dist.get_world_size() == w, f"get_world_size() = {dist.get_world_size()}")
        if expect_backend_config is not None:
            cfg = str(dist.get_backend_config())
            ck.check(expect_backend_config in cfg, f"get_backend_config() = {cfg!r}, expected {expect_backend_config!r} in it")
        if cpu_backend_is_gloo is not None:
            be = dist.group.WORLD._get_backend(torch.device("cpu"))
            is_gloo = type(be).__name__ == "ProcessGroupGloo"
            ck.check(is_gloo == cpu_backend_is_gloo, f"CPU backend is {type(be).__name__}")
    for op in ["SUM", "MAX"]:
        with ck.case(f"all_reduce/{op}"):
            t = torch.arange(1001, dtype=torch.float32) + rank
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            base = torch.arange(1001, dtype=torch.float32)
            exp = base * w + sum(range(w)) if op == "SUM" else base + (w - 1)
            ck.equal(t, exp)
    with ck.case("all_reduce/AVG"):
        t = torch.full((17,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        ck.close(t, torch.full((17,), (w + 1) / 2, dtype=torch.float64), 1e-6)
    with ck.case("broadcast+barrier"):
        t = torch.full((5,), float(rank))
        dist.broadcast(t, src=w - 1)
        ck.equal(t, torch.full((5,), float(w - 1)))
        dist.barrier()
    return ck.summary()


def test_init_env():
    run_ranks(2, _allreduce_check, init="env", timeout_s=90)


def test_init_explicit_store():
    run_ranks(3, _allreduce_check, BACKEND, init="store", timeout_s=90)


def test_device_mapped_cpu_only():
    spec = backend_for("cpu:xccl_rs")
    run_ranks(2, _allreduce_check, spec, None if IS_GLOO else False, backend=spec, timeout_s=90)


def _accelerators_here() -> list[str]:
    """The accelerator types torch sees in this process, in xccl_rs's order of preference."""
    import torch

    return [d for d in ("xpu", "cuda") if getattr(torch, d).device_count() > 0]


def test_device_mapped_cpu_gloo_cuda_backend():
    if IS_XCCL and "cuda" not in _accelerators_here():
        pytest.skip("no CUDA device here: test_device_mapped_to_a_missing_device covers this string")
    spec = backend_for("cpu:gloo,cuda:xccl_rs")
    run_ranks(2, _allreduce_check, "cpu:gloo", True, backend=spec, timeout_s=90)


# --------------------------------------------------------------------------------------
# the device types xccl_rs registers
# --------------------------------------------------------------------------------------


def _fill_by_offset(st):
    """Every local shard of ``st`` (2-D) holds the row-major indices of its elements in the
    whole tensor, so a gathered tensor equals arange(numel)."""
    import torch

    cols = st.size(1)
    for shard in st.local_shards():
        r0, c0 = shard.metadata.shard_offsets
        rows, cs = shard.metadata.shard_sizes
        idx = (torch.arange(r0, r0 + rows)[:, None] * cols + torch.arange(c0, c0 + cs)[None, :]).float()
        shard.tensor.copy_(idx)


def w_devices_and_dcp_reshard(rank, w, expected):
    """``expected``: the device types xccl_rs must be registered for here. Checks xccl_rs.DEVICES
    and torch's BackendConfig, then the device torch's ShardedTensor picks under the default
    group, then what used to raise "Torch not compiled with XPU enabled" on a host without XPU:
    ShardedTensor.gather, and a distributed checkpoint saved in one sharding and loaded into
    another (torch's DCP test_load_rowwise_to_colwise)."""
    import os

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    import xccl_rs
    from harness import ctx

    ck = Checker()
    with ck.case("registration/devices"):
        ck.check(xccl_rs.DEVICES == expected, f"xccl_rs.DEVICES = {xccl_rs.DEVICES}, expected {expected}")
        cfg = dist.BackendConfig("xccl_rs").get_device_backend_map()
        ck.check(list(cfg) == expected, f"BackendConfig('xccl_rs') = {cfg}, expected devices {expected}")
        ck.check(all(b == "xccl_rs" for b in cfg.values()), f"BackendConfig('xccl_rs') = {cfg}")
    placements = [f"rank:{r}" for r in range(w)]
    rows = sharded_tensor.zeros(ChunkShardingSpec(dim=0, placements=placements), 10, 6)
    with ck.case("sharded_tensor/preferred_device"):
        want = torch.device("cpu")
        if dist.get_backend() == "xccl_rs" and len(expected) > 1:
            want = torch.device(expected[1], getattr(torch, expected[1]).current_device())
        got = rows._get_preferred_device()
        ck.check(got == want, f"ShardedTensor._get_preferred_device() = {got}, expected {want}")
    with ck.case("sharded_tensor/gather"):
        _fill_by_offset(rows)
        out = torch.zeros(10, 6) if rank == 0 else None
        rows.gather(dst=0, out=out)
        if rank == 0:
            ck.equal(out, torch.arange(60, dtype=torch.float32).reshape(10, 6))
    with ck.case("dcp/rowwise_to_colwise"):
        path = os.path.join(ctx().tmpdir, "dcp")
        dcp.save({"t": rows}, checkpoint_id=path)
        cols = sharded_tensor.zeros(ChunkShardingSpec(dim=1, placements=placements), 10, 6)
        state = {"t": cols}
        dcp.load(state, checkpoint_id=path)
        out = torch.zeros(10, 6) if rank == 0 else None
        state["t"].gather(dst=0, out=out)
        if rank == 0:
            ck.equal(out, torch.arange(60, dtype=torch.float32).reshape(10, 6), "loaded column-wise, gathered")
    return ck.summary()


def test_registered_devices_are_the_hosts():
    # Fails without the fix on a host without XPU: xccl_rs was registered for cpu, xpu and cuda
    # everywhere, so torch picked xpu and called torch.xpu.current_device().
    run_ranks(2, w_devices_and_dcp_reshard, ["cpu"] + _accelerators_here(), timeout_s=120)


def test_registered_devices_with_an_xpu_put_xpu_first():
    # The emulated XPU (python_tests/xpu_emu) is activated before `import xccl_rs` (run_ranks'
    # setup), as a real XPU is there before it: xpu is registered, ahead of cuda where both are.
    import xpu_emu

    if reason := xpu_emu.unavailable_reason():
        pytest.skip(reason)
    xpu_emu.load()  # build once here, not in every rank at once
    expected = ["cpu", "xpu"] + [d for d in _accelerators_here() if d == "cuda"]
    run_ranks(2, w_devices_and_dcp_reshard, expected, setup=xpu_emu.ACTIVATE, timeout_s=180)


def w_init_with_missing_device(rank, w, spec):
    """init_process_group(spec) on a host that lacks one of spec's devices: the error each rank
    got (or "no error")."""
    import time as _time

    import torch.distributed as dist

    from harness import ctx

    c = ctx()
    t0 = _time.monotonic()
    try:
        dist.init_process_group(spec, store=c.connect_store(), rank=rank, world_size=w, timeout=c.timeout())
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": _time.monotonic() - t0}
    return {"error": None, "seconds": _time.monotonic() - t0}


@pytest.mark.skipif(not IS_XCCL, reason="the error is xccl_rs's")
@pytest.mark.parametrize("spec", ["cpu:gloo,cuda:xccl_rs", "cpu:xccl_rs,cuda:xccl_rs", "cpu:gloo,xpu:xccl_rs"])
def test_device_mapped_to_a_missing_device(spec):
    device = spec.split(",")[1].split(":")[0]
    if device in _accelerators_here():
        pytest.skip(f"this host has a {device} device")
    # A short group timeout: a rank left waiting for a peer would show as a timeout, not hang.
    res = run_ranks(2, w_init_with_missing_device, spec, init="none", pg_timeout_s=20, timeout_s=90)
    for r in range(2):
        out = res.value(r)
        err = out["error"]
        assert err is not None, f"rank {r}: init_process_group({spec!r}) succeeded on a host without {device}"
        assert err.startswith("RuntimeError: xccl_rs:") and spec in err, f"rank {r}: {err}"
        assert f"no {device} device" in err and f"'{device}:xccl_rs'" in err, f"rank {r}: {err}"
        assert out["seconds"] < 15, f"rank {r} took {out['seconds']:.1f} s to fail: {err}"


NEW_GROUP_ON_MISSING_DEVICE = textwrap.dedent(
    """
    import torch.distributed as dist, xccl_rs
    for device in {devices!r}:
        try:
            xccl_rs.new_group(dist.HashStore(), 0, 1, device=device)
        except ValueError as e:
            print("ValueError:", e)
        else:
            print("no error")
    """
)


def test_private_group_on_a_missing_device():
    missing = [d for d in ("xpu", "cuda") if d not in _accelerators_here()]
    if not missing:
        pytest.skip("this host has both xpu and cuda devices")
    devices = missing + ["mps"]
    proc = subprocess.run(
        [sys.executable, "-c", NEW_GROUP_ON_MISSING_DEVICE.format(devices=devices)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(devices), proc.stdout + proc.stderr
    for device, line in zip(missing, lines):
        assert line.startswith("ValueError: xccl_rs.new_group:") and f"no {device} device" in line, line
    assert "not one of ['cpu', 'xpu', 'cuda']" in lines[-1], lines[-1]


# --------------------------------------------------------------------------------------
# subgroups
# --------------------------------------------------------------------------------------


def subgroups_worker(rank, w):
    import torch
    import torch.distributed as dist

    ck = Checker()
    backend = backend_for("xccl_rs")
    A, B = [0, 2], [1, 2, 3]
    ga = dist.new_group(ranks=A, backend=backend)
    gb = dist.new_group(ranks=B, backend=backend)
    NON = dist.GroupMember.NON_GROUP_MEMBER
    with ck.case("subgroups/membership"):
        for ranks, g in [(A, ga), (B, gb)]:
            if rank in ranks:
                ck.check(g is not NON, f"member got NON_GROUP_MEMBER for {ranks}")
                ck.check(dist.get_rank(g) == ranks.index(rank), f"get_rank(group {ranks}) = {dist.get_rank(g)}")
                ck.check(dist.get_world_size(g) == len(ranks), f"get_world_size(group {ranks}) = {dist.get_world_size(g)}")
                ck.check(dist.get_process_group_ranks(g) == ranks, f"ranks {dist.get_process_group_ranks(g)}")
            else:
                ck.check(g is NON, f"non-member of {ranks} got {g!r}, expected NON_GROUP_MEMBER")

    def val(r, k):
        return float(10 * r + k)

    for it in range(3):
        with ck.case(f"subgroups/interleaved_sync/{it}"):
            t_w = torch.full((1001,), val(rank, it))
            dist.all_reduce(t_w)
            ck.equal(t_w, torch.full((1001,), float(sum(val(r, it) for r in range(w)))), "world all_reduce")
            if rank in A:
                t_a = torch.full((33,), val(rank, it + 1))
                dist.all_reduce(t_a, op=dist.ReduceOp.MAX, group=ga)
                ck.equal(t_a, torch.full((33,), max(val(r, it + 1) for r in A)), "group A all_reduce MAX")
            if rank in B:
                t_b = torch.full((65,), val(rank, it + 2))
                dist.all_reduce(t_b, group=gb)
                ck.equal(t_b, torch.full((65,), float(sum(val(r, it + 2) for r in B))), "group B all_reduce")
        with ck.case(f"subgroups/non_member_noop/{it}"):
            for ranks, g in [(A, ga), (B, gb)]:
                if rank in ranks:
                    continue
                t = torch.full((7,), -1.0)
                t0 = time.monotonic()
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    ret = dist.all_reduce(t, group=g)
                ck.check(time.monotonic() - t0 < 2.0, "non-member all_reduce blocked")
                ck.check(ret is None, f"non-member all_reduce returned {ret!r}")
                ck.equal(t, torch.full((7,), -1.0), "non-member tensor changed")
    with ck.case("subgroups/interleaved_async"):
        works, checks = [], []
        if rank in A:
            t_a = torch.full((1001,), val(rank, 5))
            works.append(dist.all_reduce(t_a, group=ga, async_op=True))
            checks.append((t_a, float(sum(val(r, 5) for r in A)), "A"))
        if rank in B:
            t_b = torch.full((1001,), val(rank, 6))
            works.append(dist.all_reduce(t_b, group=gb, async_op=True))
            checks.append((t_b, float(sum(val(r, 6) for r in B)), "B"))
        t_w = torch.full((1001,), val(rank, 7))
        works.append(dist.all_reduce(t_w, async_op=True))
        checks.append((t_w, float(sum(val(r, 7) for r in range(w))), "world"))
        for wk in reversed(works):
            wk.wait()
        for t, exp, name in checks:
            ck.equal(t, torch.full_like(t, exp), f"{name} all_reduce")
    with ck.case("subgroups/broadcast_src_translation"):
        if rank in B:
            t = torch.full((9,), val(rank, 8))
            dist.broadcast(t, src=3, group=gb)  # global rank 3 = group rank 2
            ck.equal(t, torch.full((9,), val(3, 8)), "broadcast src=3 (global)")
            t = torch.full((9,), val(rank, 9))
            dist.broadcast(t, group_src=0, group=gb)  # group rank 0 = global rank 1
            ck.equal(t, torch.full((9,), val(1, 9)), "broadcast group_src=0")
    with ck.case("subgroups/all_gather_order"):
        if rank in B:
            out = torch.empty(3 * 4)
            dist.all_gather_into_tensor(out, torch.full((4,), float(rank)), group=gb)
            ck.equal(out, torch.tensor([1.0] * 4 + [2.0] * 4 + [3.0] * 4), "group B all_gather order")
        if rank in A:
            outs = [torch.empty(2) for _ in A]
            dist.all_gather(outs, torch.full((2,), float(rank)), group=ga)
            ck.equal(torch.stack(outs), torch.tensor([[0.0, 0.0], [2.0, 2.0]]), "group A all_gather order")
    with ck.case("subgroups/world_after"):
        t = torch.ones(3)
        dist.all_reduce(t)
        ck.equal(t, torch.full((3,), float(w)))
    return ck.summary()


def test_subgroups_with_non_members():
    run_ranks(4, subgroups_worker, timeout_s=120)


# --------------------------------------------------------------------------------------
# torchrun
# --------------------------------------------------------------------------------------

TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import datetime, os
    import torch
    import torch.distributed as dist

    backend = os.environ.get("XCCL_RS_TEST_BACKEND", "xccl_rs")
    if backend == "xccl_rs":
        import xccl_rs  # noqa: F401
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((1001,), float(r + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    expected = (w + 1) / 2
    assert torch.allclose(t, torch.full_like(t, expected)), (t[:4], expected)
    dist.destroy_process_group()
    print(f"OK rank {r} of {w}", flush=True)
    """
)


def test_torchrun_launch(tmp_path):
    script = tmp_path / "torchrun_avg.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ)
    env["XCCL_RS_TEST_BACKEND"] = BACKEND
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, cwd=str(tmp_path),
    )
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within 150s; output:\n{out[-6000:]}")
    assert proc.returncode == 0, f"torchrun exit code {proc.returncode}; output:\n{out[-6000:]}"
    for r in range(2):
        assert f"OK rank {r} of 2" in out, f"missing 'OK rank {r}'; output:\n{out[-6000:]}"


# --------------------------------------------------------------------------------------
# autoload
# --------------------------------------------------------------------------------------


def _has_entry_point() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name.lower() == "xccl_rs" for ep in entry_points(group="torch.distributed.backends"))


def autoload_worker(rank, w):
    import torch
    import torch.distributed as dist

    from harness import ctx

    ck = Checker()
    with ck.case("autoload/init_without_import"):
        ck.check("xccl_rs" not in sys.modules, "xccl_rs was imported before init_process_group")
        store = ctx().connect_store()
        dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=w, timeout=ctx().timeout())
        ck.check("xccl_rs" in sys.modules, "xccl_rs not in sys.modules after autoload")
        t = torch.full((11,), float(rank + 1))
        dist.all_reduce(t)
        ck.equal(t, torch.full((11,), float(w * (w + 1) // 2)))
    return ck.summary()


@pytest.mark.skipif(not IS_XCCL, reason="autoload concerns the xccl_rs backend only")
def test_autoload_without_import():
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 14):
        pytest.skip("backend autoload needs torch >= 2.14")
    if not _has_entry_point():
        pytest.skip('no "xccl_rs" entry point in group torch.distributed.backends (package not installed)')
    run_ranks(2, autoload_worker, init="none", import_backend=False, timeout_s=90)
