"""torch's flight recorder shows xccl_rs ops (torch >= 2.15: its FlightRecorderHook records
backends without a recorder of their own, and xccl_rs pushes each op's completion to it).
A job where one rank stalls: the others time out, their abort hooks write the trace to disk
(TORCH_FR_DUMP_TEMP_FILE), every rank's trace shows the two all_reduces everyone finished as
completed and the third as scheduled on the ranks that entered it, and torch's analyzer
(python -m torch.distributed.flight_recorder.fr_trace), fed all ranks' dumps, names the
stalled rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from harness import ctx, run_ranks, torch_attaches_flight_recorder

pytestmark = pytest.mark.skipif(not torch_attaches_flight_recorder(), reason="torch < 2.15 attaches no FlightRecorderHook")

STALLED = 2


def w_one_rank_stalls(rank, world_size):
    import torch
    from torch._C import _distributed_c10d as c10d

    import xccl_rs

    problems = []
    t = torch.ones(1000)
    dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    backend = dist.get_backend_impl(dist.group.WORLD, torch.device("cpu"))
    backend.set_timeout(timedelta(seconds=2))
    if rank != STALLED:
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait()
            problems.append("the all_reduce without the stalled rank succeeded")
        except RuntimeError:
            pass
        # The abort hooks ran when the group failed: torch's hook writes the trace to disk on
        # their thread (symbolizing stacks takes seconds on a loaded machine; not what is tested).
        deadline = time.monotonic() + 30
        path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(path):
            problems.append(f"no trace dumped on the timeout at {path}")
    else:
        time.sleep(3.5)  # stalled past the others' timeout
    entries = xccl_rs.dump()
    states = [(e["profiling_name"], e["state"], e["collective_seq_id"]) for e in entries]
    want = [("xccl_rs:all_reduce", "completed", 1), ("xccl_rs:all_reduce", "completed", 2)]
    if rank != STALLED:
        want.append(("xccl_rs:all_reduce", "scheduled", 3))
    if states != want:
        problems.append(f"entries {states}, expected {want}")
    if rank != STALLED and entries and entries[0].get("input_sizes") != [[1000]]:
        problems.append(f"input sizes {entries[0].get('input_sizes')}")
    if not all(e.get("duration_ms") is not None for e in entries[:2]):
        problems.append(f"durations {[e.get('duration_ms') for e in entries[:2]]}")
    trace = c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=False, backend="xccl_rs")
    return problems, trace


def test_a_stalled_rank_is_named_by_torchs_analyzer(tmp_path):
    world = 3
    prefix = str(tmp_path / "auto_")
    env = {"TORCH_FR_BUFFER_SIZE": "200", "TORCH_FR_DUMP_TEMP_FILE": prefix}
    res = run_ranks(world, w_one_rank_stalls, pg_timeout_s=30, timeout_s=120, env=env)
    problems = [f"rank {r}: {p}" for r in range(world) for p in res.value(r)[0]]
    assert not problems, "\n".join(problems)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for r in range(world):
        (dumps / f"rank_{r}").write_bytes(res.value(r)[1])
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(dumps), "-p", "rank_"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    # e.g. "Not all ranks joining collective, sequence number: 3 ... collective: xccl_rs:all_reduce
    # missing ranks: {2} ... collective state: scheduled"
    assert "Not all ranks joining collective, sequence number: 3" in report, report
    assert f"missing ranks: {{{STALLED}}}" in report, report
    assert "collective: xccl_rs:all_reduce" in report, report
