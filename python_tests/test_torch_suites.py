"""torch's own distributed tests with xccl_rs as the CPU backend: a subset of the files that
scripts/torch_suites.py runs (docs/testing.md has the whole files, side by side with gloo), small
enough for the test command. Every test listed here passes with gloo on torch 2.15 (measured;
docs/testing.md); each must pass with xccl_rs too, and xccl_rs must have created backends.

torch's test files are not in its wheel and this repository does not copy them: the runner reads
them from ``$XCCL_RS_CACHE/torch-tests/<torch major.minor>/``. Where they are not there, or where
torch's harness cannot be imported (it needs ``expecttest``), these tests skip and say why.
``XCCL_RS_TORCH_SUITES_SIDE_BY_SIDE=1`` also runs gloo and compares the two per test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from harness import IS_XCCL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "scripts", "torch_suites.py")

CHECKPOINT = "test/distributed/checkpoint/test_file_system_checkpoint_cpu.py"
OBJECTS = "test/distributed/test_c10d_object_collectives.py"
DTENSOR = "test/distributed/tensor/test_dtensor.py"

# file -> the tests of it that run here; each passes with gloo (torch 2.15.0). The resharding
# loads are what raised "Torch not compiled with XPU enabled" before xccl_rs registered only the
# devices the host has (ShardedTensor.gather asks the backend's first non-cpu device).
SUBSET = {
    CHECKPOINT: [
        "TestDistributedReshardOnLoad::test_load_rowwise_to_colwise_thread_count_1",
        "TestDistributedReshardOnLoad::test_load_with_different_shard_plan_thread_count_1",
        "TestDistributedReshardOnLoad::test_switch_between_sharded_tensor_to_tensor_thread_count_1",
        "TestDistributedReshardOnLoad::test_save_load_bytes_thread_count_1",
    ],
    OBJECTS: ["TestObjectCollectivesCPU::test_subpg_all_gather_object_cpu"],
    DTENSOR: ["DTensorTest::test_to_local_grad_hint"],
}


def _tests_dir() -> str:
    import torch

    cache = os.environ.get("XCCL_RS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "xccl_rs")
    return os.path.join(cache, "torch-tests", ".".join(torch.__version__.split("+")[0].split(".")[:2]))


def _run(backend: str, tmp_path) -> dict:
    out = tmp_path / f"{backend}.json"
    node_ids = [f"{f}::{t}" for f, tests in SUBSET.items() for t in tests]
    proc = subprocess.run(
        [sys.executable, RUNNER, "--backend", backend, "--json", str(out), "--timeout", "600", *node_ids],
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
    )
    assert out.exists(), f"the runner wrote no results (exit {proc.returncode}):\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    return json.loads(out.read_text())["results"][backend]


@pytest.mark.skipif(not IS_XCCL, reason="runs torch's tests with xccl_rs; gloo is what they are measured against")
def test_torch_suites_subset(tmp_path):
    missing = [f for f in SUBSET if not os.path.exists(os.path.join(_tests_dir(), f))]
    if missing:
        pytest.skip(f"torch's test files are not under {_tests_dir()} ({', '.join(missing)}): docs/testing.md")
    if importlib.util.find_spec("expecttest") is None:
        pytest.skip("torch.testing._internal needs expecttest (pip install expecttest)")
    results = _run("xccl_rs", tmp_path)
    gloo = _run("gloo", tmp_path) if os.environ.get("XCCL_RS_TORCH_SUITES_SIDE_BY_SIDE") == "1" else None
    problems = []
    for f, tests in SUBSET.items():
        r = results[f]
        mine = []
        if r["collected"] == 0:
            mine.append(f"{f}: nothing collected")
        elif r["xccl_rs_backends"] == 0:
            mine.append(f"{f}: torch created no xccl_rs backend: the tests did not run with xccl_rs")
        mine += [f"{f}::{t}: {r['outcomes'].get(t, 'not collected')} with xccl_rs"
                 for t in tests if r["outcomes"].get(t) != "passed"]
        if gloo is not None:
            worse = [t for t, o in gloo[f]["outcomes"].items() if o == "passed" and r["outcomes"].get(t) != "passed"]
            mine += [f"{f}::{t}: passes with gloo, not with xccl_rs" for t in worse]
        if mine:
            problems += mine + [f"{f}: output (tail):\n{r['output_tail'][-3000:]}"]
    assert not problems, "\n".join(problems)
