"""Mixed groups: 4 ranks posing as 2 hosts through a per-rank XCCL_RS_HOST_ID, so that ranks of
one "host" share memory and the hosts talk over TCP (hierarchical all-reduce, broadcast, reduce,
all-gather and barrier; the other collectives direct over TCP). The whole collectives sweep of
test_collectives.py runs on such a group — every collective x dtype x op x size x completion
mode against torch references — for three layouts: hosts {0, 1} + {2, 3}, interleaved
{0, 2} + {1, 3}, and uneven {0, 1, 2} + {3}. Small shared-memory slots make the large cases run
in many blocks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import harness
from harness import IS_GLOO, free_port
from test_collectives import THEMES, check_theme, sweep_once

pytestmark = pytest.mark.skipif(IS_GLOO, reason="xccl_rs host topology")

LAYOUTS = {
    "blocks": ["a", "a", "b", "b"],
    "interleaved": ["a", "b", "a", "b"],
    "uneven": ["a", "a", "a", "b"],
}
ENV = {"XCCL_RS_SHM_CHUNK_BYTES": "65536", "XCCL_RS_SHM_ONESHOT_BYTES": "4096"}


@pytest.mark.parametrize("theme", THEMES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collective_on_mixed_group(layout, theme):
    hosts = LAYOUTS[layout]
    res = sweep_once(
        f"mixed {layout}",
        len(hosts),
        timeout_s=600,
        env=ENV,
        rank_env=lambda r: {"XCCL_RS_HOST_ID": hosts[r]},
    )
    check_theme(res, len(hosts), theme)


WORKER = textwrap.dedent(
    """
    import sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import xccl_rs
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("xccl_rs", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=10))
    t = torch.full((300000,), float(rank))
    dist.all_reduce(t)
    assert t[0].item() == sum(range(world))
    dist.destroy_process_group()
    print("DONE", flush=True)
    """
)


def test_mixed_group_reports_its_hosts(tmp_path):
    """The log line of a mixed group names 2 hosts and 2 local ranks per host, and shared memory."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    hosts = LAYOUTS["interleaved"]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(len(hosts)), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, XCCL_RS_HOST_ID=hosts[r], XCCL_RS_LOG="info"),
        )
        for r in range(len(hosts))
    ]
    for rc, out in harness.collect_outputs(procs):
        assert rc == 0 and "DONE" in out, out
        assert "shm=true" in out and "hosts=2" in out and "local_ranks=2" in out, out
