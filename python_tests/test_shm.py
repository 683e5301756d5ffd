"""Shared-memory hygiene: nothing of ours stays in /dev/shm after a normal exit or after a rank
is killed (segments are unlinked as soon as every rank has mapped them), and the group picks
shared memory or TCP as configured."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from harness import IS_GLOO, collect_outputs, free_port

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs shared-memory behaviour")

WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=4))
    t = torch.full((300000,), float(rank))
    dist.all_reduce(t)
    assert t[0].item() == sum(range(world))
    if mode == "cma":
        # 4 MiB all-reduces (cross-memory attach), against sums computed here from every
        # rank's inputs, which each rank regenerates from its seed.
        def inputs(r, dtype):
            g = torch.Generator().manual_seed(1000 + r)
            return torch.randint(-50, 50, (1 << 20,), generator=g).to(dtype)
        for dtype in (torch.float32, torch.bfloat16):
            for op, scale in ((dist.ReduceOp.SUM, 1), (dist.ReduceOp.AVG, world)):
                mine = inputs(rank, dtype)
                dist.all_reduce(mine, op=op)
                want = (sum(inputs(r, dtype).float() for r in range(world)) / scale).to(dtype)
                assert torch.equal(mine, want), (dtype, op, (mine != want).sum().item())
        print("CMA EXACT", flush=True)
    if mode in ("cma_root_dies", "arena_root_dies"):
        # A broadcast's root dies once it has published where its tensor lies, before rank 1
        # reads it: rank 1's broadcast raises (uncaught: the script exits 1), naming rank 0.
        # cma: with XCCL_RS_CMA=1, 4 MiB read from the root's memory by cross-memory attach.
        # arena: 40 MiB of CUDA in 4 MiB chunks, staged in the root's registered arena, which
        # the first broadcast maps in rank 1; the root dies with slots of it still to be read.
        if mode == "arena_root_dies":
            torch.cuda.set_device(0)
        device, n = ("cuda", 10 << 20) if mode == "arena_root_dies" else ("cpu", 1 << 20)
        want = torch.arange(n, dtype=torch.float32, device=device)
        x = want.clone() if rank == 0 else torch.zeros(n, device=device)
        dist.broadcast(x, src=0)
        assert torch.equal(x, want)
        print("BROADCAST EXACT", flush=True)
        if rank == 0:
            import threading
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        else:
            time.sleep(1.5)
        t0 = time.monotonic()
        try:
            dist.broadcast(x, src=0)
        finally:
            print(f"RAISED AFTER {time.monotonic() - t0:.1f} s", flush=True)
    print("SEGMENTS", sorted(f for f in os.listdir("/dev/shm") if f.startswith("xccl_rs-")), flush=True)
    if mode == "kill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill":
        try:
            dist.all_reduce(t)
            print("NO ERROR", flush=True)
        except Exception as e:
            print("ERROR", type(e).__name__, str(e).splitlines()[0], flush=True)
    dist.destroy_process_group()
    print("DONE", flush=True)
    """
)


def ours() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("xccl_rs-")}


def run_group(tmp_path, world: int, mode: str, env_extra=None):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    env = dict(os.environ, **(env_extra or {}))
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for r in range(world)
    ]
    return collect_outputs(procs)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_nothing_left_after_normal_exit(tmp_path):
    before = ours()
    outs = run_group(tmp_path, 3, "normal")
    for rc, out in outs:
        assert rc == 0 and "DONE" in out, out
        # Segments are unlinked right after set-up: none is visible while the group runs.
        assert "SEGMENTS []" in out, out
    assert ours() - before == set()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_nothing_left_after_a_rank_is_killed(tmp_path):
    before = ours()
    outs = run_group(tmp_path, 3, "kill")
    rc1, out1 = outs[1]
    assert rc1 == -9, out1
    for rank in (0, 2):
        rc, out = outs[rank]
        assert "ERROR" in out and "rank 1" in out, out
    assert ours() - before == set()


def test_all_reduce_by_cross_memory_attach_across_processes(tmp_path):
    """XCCL_RS_CMA=1: the group probes and agrees on it for every tensor (the log says
    cma="all"), and 4 MiB all-reduces over SUM and AVG in float32 and bfloat16 are exact. By
    default the group reads only staged broadcasts that way (cma="staged"); with 0, nothing."""
    outs = run_group(tmp_path, 3, "cma", {"XCCL_RS_CMA": "1", "XCCL_RS_LOG": "info"})
    for rc, out in outs:
        assert rc == 0 and "CMA EXACT" in out and "DONE" in out, out
        assert 'cma="all"' in out, out
    for env, says in (({}, 'cma="staged"'), ({"XCCL_RS_CMA": "0"}, 'cma="off"')):
        outs = run_group(tmp_path, 2, "normal", {"XCCL_RS_LOG": "info", **env})
        for rc, out in outs:
            assert rc == 0 and says in out, (env, out)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize(
    "mode, env",
    [
        ("cma_root_dies", {"XCCL_RS_CMA": "1"}),
        pytest.param("arena_root_dies", {"XCCL_RS_PIPELINE_CHUNK_BYTES": str(4 << 20)}, marks=[
            pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="the staging arena needs CUDA")]),
    ],
    ids=["cma", "arena"],
)
def test_a_broadcast_root_that_dies_before_it_is_read_ends_the_receivers_script(tmp_path, mode, env):
    outs = run_group(tmp_path, 2, mode, env)
    rc0, out0 = outs[0]
    assert rc0 == -9 and "BROADCAST EXACT" in out0, out0
    rc1, out1 = outs[1]
    assert rc1 == 1 and "BROADCAST EXACT" in out1 and "DONE" not in out1, out1
    assert "rank 0" in out1 and "Traceback" in out1, out1
    took = float(out1.split("RAISED AFTER ")[1].split(" s")[0])
    assert took < 4 + 2, out1  # within the group's timeout


def test_tcp_can_be_forced(tmp_path):
    outs = run_group(tmp_path, 2, "normal", {"XCCL_RS_TRANSPORT": "tcp", "XCCL_RS_LOG": "info"})
    for rc, out in outs:
        assert rc == 0 and "DONE" in out, out
        assert "shm=false" in out, out
    outs = run_group(tmp_path, 2, "normal", {"XCCL_RS_LOG": "info"})
    for rc, out in outs:
        assert rc == 0 and "shm=true" in out, out
