"""What XCCL_RS_LOG shows (docs/debugging.md): at `info`, one line per group at set-up with its
rank, size and fabric; at `debug`, also the algorithm and the path the selection table chose, once
per (op, path, size class) the group runs."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import torch, torch.distributed as dist, xccl_rs
dist.init_process_group("xccl_rs", store=dist.HashStore(), rank=0, world_size=1)
for n in (4, 5, 1 << 20, 1 << 20):   # 16 and 20 bytes share a size class; 4 MiB twice
    dist.all_reduce(torch.ones(n))
dist.broadcast(torch.ones(3), 0)
"""


def run_with_log(level: str) -> str:
    env = dict(os.environ, XCCL_RS_LOG=level)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_info_prints_the_group_at_set_up_and_no_paths():
    log = run_with_log("info")
    setup = [line for line in log.splitlines() if "communicator connected" in line]
    assert len(setup) == 1, log
    for field in ("rank=0", "size=1", "shape=Mesh", "tls=false", "shm=false"):
        assert field in setup[0], setup[0]
    assert "first use of a path" not in log, log


def test_debug_names_each_path_once_per_op_and_size_class():
    paths = [line for line in run_with_log("debug").splitlines() if "first use of a path" in line]
    assert len(paths) == 3, "\n".join(paths)
    assert "op=AllReduce" in paths[0] and "algorithm=AllReduceDirect" in paths[0] and "size=< 32 B" in paths[0]
    # The concrete path the table chose; a TCP all-reduce has one.
    assert "path=AllReduceDirect" in paths[0], paths[0]
    assert "op=AllReduce" in paths[1] and "size=< 8388608 B" in paths[1]
    assert "op=Broadcast" in paths[2] and "algorithm=BroadcastDirect" in paths[2]
