"""A script that ends on an xccl_rs error exits as Python does (code 1 for an uncaught
exception), never by a signal, and with torch's flight recorder on (torch 2.15's default) its
trace is on disk first.

Run the way users run them: the real torchrun launcher, torch's defaults (the flight recorder
is not configured here; TORCH_FR_DUMP_TEMP_FILE only says where its dump goes). Each rank gets
an agent of its own (``torchrun --nnodes N --node-rank r``, one process per node), so that the
exit code of every rank is seen: one agent for all ranks stops the others (SIGTERM) as soon as
the first one fails, whatever the backend.

The cases: sizes that differ across ranks; a stalled rank whose peers time out (their scripts
end on the timeout, one of them after ``destroy_process_group()``, and torch's analyzer, fed
their traces, names the stalled rank). Before the fix every rank here ended with
SIGABRT ("FATAL: exception not rethrown": the dump still running on a hook thread when Python
finalized) and no trace was written.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness import free_port, torch_attaches_flight_recorder

# torch >= 2.15 attaches its FlightRecorderHook to every group by default; older torch has no
# recorder for a backend like ours, so there only the exit codes are checked.
HAS_FR_HOOK = torch_attaches_flight_recorder()

MISMATCH = """
import torch, torch.distributed as dist, xccl_rs
dist.init_process_group("xccl_rs")
dist.all_reduce(torch.ones(1000 + dist.get_rank()))   # sizes differ: the exception ends the script
"""

STALL = """
import os, time
from datetime import timedelta
import torch, torch.distributed as dist, xccl_rs
dist.init_process_group("xccl_rs", timeout=timedelta(seconds=3))
t = torch.ones(1000)
dist.all_reduce(t)
if dist.get_rank() == dist.get_world_size() - 1:     # the stalled rank: stuck in its own work
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["RELEASE_FILE"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    raise SystemExit(0)
if dist.get_rank() == 1:
    try:
        dist.all_reduce(t)
    finally:
        dist.destroy_process_group()                   # then the exception ends the script
else:
    dist.all_reduce(t)                                 # times out: the exception ends the script
"""


def torchrun_each_rank(tmp_path, source: str, world: int, wait_for: list[int], timeout_s=150):
    """Starts `source` on `world` ranks, one torchrun agent per rank; waits for the ranks in
    `wait_for`, kills the others. Returns {rank: (worker exit code, agent output)} for those
    waited for, and the trace prefix."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    prefix = str(tmp_path / "traces" / "trace_")
    os.makedirs(os.path.dirname(prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE"))}
    release = tmp_path / "release"  # ends the stalled rank of STALL
    env.update({"TORCH_FR_DUMP_TEMP_FILE": prefix, "OMP_NUM_THREADS": "1", "RELEASE_FILE": str(release)})
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    port = free_port()
    procs = {
        r: subprocess.Popen(
            torchrun + [f"--nnodes={world}", f"--node-rank={r}", "--nproc-per-node=1",
                        "--master-addr=127.0.0.1", f"--master-port={port}", str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # the agent and its worker are killed together at the end
        )
        for r in range(world)
    }
    results = {}
    deadline = time.monotonic() + timeout_s
    try:
        for r in wait_for:
            try:
                out, _ = procs[r].communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {r} did not exit within {timeout_s} s (a hang at exit?)")
            results[r] = (worker_exit_code(out), out)
    finally:
        release.touch()
        for p in procs.values():
            try:
                p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return results, prefix


def worker_exit_code(agent_output: str):
    """The worker's exit code as the torchrun agent reports it (0 when it reports no failure)."""
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", agent_output)
    return int(codes[-1]) if codes else 0


def assert_clean_exit(results, what):
    for r, (code, out) in results.items():
        assert "FATAL: exception not rethrown" not in out, f"{what}: rank {r}:\n{out[-4000:]}"
        assert code == 1, f"{what}: rank {r} exited with {code} (1 expected: Python's code for an uncaught exception):\n{out[-4000:]}"


def read_trace(prefix: str, rank: int) -> dict:
    path = f"{prefix}{rank}"
    assert os.path.exists(path), f"rank {rank} wrote no flight-recorder trace at {path}"
    with open(path, "rb") as f:
        return pickle.load(f)


def test_a_size_mismatch_ends_every_rank_with_exit_code_1_and_its_trace(tmp_path):
    results, prefix = torchrun_each_rank(tmp_path, MISMATCH, 2, wait_for=[0, 1])
    assert_clean_exit(results, "size mismatch")
    for r, (_, out) in results.items():
        assert "size mismatch" in out, out[-4000:]
        if HAS_FR_HOOK:
            trace = read_trace(prefix, r)
            names = [e["profiling_name"] for e in trace["entries"]]
            assert names == ["xccl_rs:all_reduce"], names


def test_a_stalled_rank_ends_the_others_with_exit_code_1_and_traces_naming_it(tmp_path):
    """Rank 0's script ends on the timeout; rank 1's catches it, calls destroy_process_group()
    and re-raises."""
    world, stalled = 3, 2
    results, prefix = torchrun_each_rank(tmp_path, STALL, world, wait_for=[0, 1])
    assert_clean_exit(results, "stalled rank")
    for r, (_, out) in results.items():
        assert f"ranks not heard from: [{stalled}]" in out, out[-4000:]
    if not HAS_FR_HOOK:
        return
    for r in (0, 1):
        states = [(e["collective_seq_id"], e["state"]) for e in read_trace(prefix, r)["entries"]]
        assert states == [(1, "completed"), (2, "scheduled")], f"rank {r}: {states}"
    # torch's analyzer, fed the survivors' traces (the stalled rank, busy elsewhere, wrote none).
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", os.path.dirname(prefix),
         "-p", "trace_", "--allow-incomplete-ranks"],
        capture_output=True, text=True, timeout=120,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert f"missed FR dumps from ranks ({{{stalled}}})" in report, report
