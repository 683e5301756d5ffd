"""The CMake package for C++ users (docs/cpp.md), end to end: builds and installs libxccl_rs.so
with the top-level CMakeLists.txt (cargo builds the Rust core), builds examples/cpp through
``find_package(xccl_rs)``, and runs it as separate processes, one per rank, whose AVG all_reduce
the example checks against the arithmetic.

The build directories live in the cache (XCCL_RS_CACHE, default ~/.cache/xccl_rs), one per
clone, so that a second run only rebuilds what changed; cargo reuses $CARGO_TARGET_DIR (set by
scripts/setup.sh) for the dependencies. With XCCL_RS_CORE_DIR set (a prebuilt Rust core) it
needs no Rust.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("XCCL_RS_CACHE") or os.path.expanduser("~/.cache/xccl_rs")
WORK = os.path.join(CACHE, "cpp-package-" + hashlib.sha1(ROOT.encode()).hexdigest()[:8])
BUILD_TIMEOUT_S = 1500  # a cold build of the bridge on 2 busy cores takes minutes
RUN_TIMEOUT_S = 120


def _tool(name: str) -> str | None:
    """The tool next to this interpreter (the venv's pip-installed cmake/ninja), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.access(here, os.X_OK) else shutil.which(name)


CMAKE = _tool("cmake")
NINJA = _tool("ninja")
pytestmark = pytest.mark.skipif(CMAKE is None, reason="cmake is not installed (pip install cmake ninja)")


def _run(args: list[str], what: str, **kw) -> str:
    r = subprocess.run(args, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, **kw)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{what} failed (exit {r.returncode}): {' '.join(args)}\n{out[-6000:]}"
    return out


def _configure(src: str, build: str, *defs: str) -> str:
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={NINJA}"] if NINJA else []
    return _run([CMAKE, "-S", src, "-B", build, *gen, *defs], f"cmake configure of {src}")


@pytest.fixture(scope="module")
def example() -> str:
    """Builds and installs the package, then the example against the installed package."""
    build, prefix, example_build = (os.path.join(WORK, d) for d in ("build", "install", "example"))
    # XCCL_RS_CORE_DIR: a prebuilt Rust core, on a machine without Rust (docs/cpp.md).
    core = os.environ.get("XCCL_RS_CORE_DIR")
    _configure(ROOT, build, f"-DXCCL_RS_PYTHON={sys.executable}", f"-DXCCL_RS_CORE_DIR={core or ''}")
    _run([CMAKE, "--build", build], "the library's build")
    shutil.rmtree(prefix, ignore_errors=True)  # only what this install puts there
    _run([CMAKE, "--install", build, "--prefix", prefix], "the install")
    # No XCCL_RS_PYTHON here: the package defaults to the Python it was built with.
    _configure(os.path.join(ROOT, "examples", "cpp"), example_build, f"-DCMAKE_PREFIX_PATH={prefix}")
    _run([CMAKE, "--build", example_build], "the example's build")
    return os.path.join(example_build, "allreduce_avg")


def _lines(proc: subprocess.Popen, into: queue.Queue) -> None:
    for line in proc.stdout:
        into.put(line)
    into.put(None)


def _run_ranks(exe: str, size: int) -> list[tuple[int, str]]:
    """Starts rank 0 on port 0, reads the port it picked, starts the others; (exit code, output) per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    procs = [subprocess.Popen([exe, "0", str(size), "0"], **popen)]
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(procs[0], lines), daemon=True).start()
    first = []
    try:
        line = lines.get(timeout=RUN_TIMEOUT_S)
        first.append(line or "")
        assert line and line.startswith("port "), f"rank 0 did not print its port: {line!r}"
        port = line.split()[1]
        procs += [subprocess.Popen([exe, str(r), str(size), port], **popen) for r in range(1, size)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        outs = []
        for r, p in enumerate(procs):
            if r == 0:
                p.wait(timeout=max(1, deadline - time.monotonic()))
                rest = []
                while (item := lines.get(timeout=10)) is not None:
                    rest.append(item)
                outs.append((p.returncode, "".join(first + rest)))
            else:
                out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
                outs.append((p.returncode, out))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("size", [2, 3])
def test_example_avg_allreduce(example, size):
    outs = _run_ranks(example, size)
    report = "\n".join(f"--- rank {r} (exit {rc}):\n{out}" for r, (rc, out) in enumerate(outs))
    assert all(rc == 0 for rc, _ in outs), report
    for r, (_, out) in enumerate(outs):
        assert f"rank {r}: AVG all_reduce of 1001 floats over {size} ranks is right" in out, report


def test_package_refuses_another_torch(example, tmp_path):
    """find_package names the torch mismatch (the c10d::Backend ABI changes between minors)."""
    # An "interpreter" whose torch claims another minor version.
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\n"{sys.executable}" "$@" | sed "s/^set(XCCL_RS_TORCH_VERSION .*/set(XCCL_RS_TORCH_VERSION \\"2.7.0\\")/;'
        f's/^set(XCCL_RS_TORCH_VERSION_MINOR .*/set(XCCL_RS_TORCH_VERSION_MINOR \\"7\\")/"\n'
    )
    fake.chmod(0o755)
    prefix = os.path.join(WORK, "install")
    gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={NINJA}"] if NINJA else []
    r = subprocess.run(
        [CMAKE, "-S", os.path.join(ROOT, "examples", "cpp"), "-B", str(tmp_path / "b"), *gen,
         f"-DCMAKE_PREFIX_PATH={prefix}", f"-DXCCL_RS_PYTHON={fake}"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode != 0, r.stdout + r.stderr
    said = " ".join(r.stderr.split())  # CMake wraps the message
    built = ".".join(torch.__version__.split(".")[:2])
    assert f"built against torch {built}, but {fake} has torch 2.7.0: rebuild xccl_rs" in said, r.stderr
    assert "set XCCL_RS_PYTHON to a Python with torch" in said, r.stderr
