"""What pyproject.toml cannot say statically: the torch this build compiles against.

A c10d backend only works in the torch it was compiled against (the c10d::Backend vtable
changes every minor release), so:
- the torch is chosen once, here, by asking an interpreter for its torch's flags
  (python/xccl_rs/torch_build_flags.py), and build.rs compiles with exactly those
  (XCCL_RS_TORCH_FLAGS);
- the package requires that torch release (``torch==X.Y.*``);
- ``xccl_rs/_build_info.py`` records it, so that ``import xccl_rs`` can refuse another torch
  before it loads the extension.

The interpreter is XCCL_RS_PYTHON if set, else the one running the build. Under pip's build
isolation that interpreter's torch is hidden (and there is no torch among the build
requirements); ``-E`` looks past the isolation at the environment being installed into, which
is the torch that will import the package.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
FLAGS_SCRIPT = os.path.join(ROOT, "python", "xccl_rs", "torch_build_flags.py")
BUILD_INFO = os.path.join(ROOT, "python", "xccl_rs", "_build_info.py")


def torch_flags() -> dict[str, list[str]]:
    python = os.environ.get("XCCL_RS_PYTHON") or sys.executable
    errors = []
    for cmd in ([python], [python, "-E"]):
        out = subprocess.run([*cmd, FLAGS_SCRIPT], capture_output=True, text=True)
        if out.returncode == 0:
            rows = [line.split("\t") for line in out.stdout.splitlines() if line]
            return {row[0]: row[1:] for row in rows} | {"_text": [out.stdout]}
        errors.append(f"{' '.join(cmd)}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    sys.exit(
        "xccl_rs: no torch to build against (" + "; ".join(errors) + "). Install torch >= 2.8 into this "
        "environment first (`pip install torch`), or set XCCL_RS_PYTHON to a Python that has it."
    )


flags = torch_flags()
major, minor = flags["version_major"][0], flags["version_minor"][0]
abi = flags["cxx11_abi"][0] == "1"


def crate_version() -> str:
    """xccl_rs's own version: the crate's (Cargo.toml), which CMakeLists.txt reads too."""
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        return re.search(r'^version = "([0-9][0-9.]*)"', f.read(), re.M).group(1)


# The distribution's version leads with the torch release it is compiled against, then ours:
# xccl_rs 0.1.0 for torch 2.15 is 2.15.0.1.0. A c10d backend is built per torch minor version,
# and this way `pip install "xccl_rs==2.15.*"` gets the newest xccl_rs for torch 2.15 from an
# index that holds wheels for every torch (docs/building.md#wheels says why not the alternatives).
VERSION = f"{major}.{minor}.{crate_version()}"


def write_if_changed(path: str, text: str) -> None:
    """cargo reruns build.rs (and recompiles the C++) when the flags file's time changes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if os.path.exists(path) and open(path).read() == text:
        return
    with open(path, "w") as f:
        f.write(text)


# build.rs reads the same description (cargo runs as a child of this process). The file is
# named by its content, so builds against different torches in one tree do not undo each other.
flags_file = os.path.join(ROOT, "build", f"torch-flags-{hashlib.sha1(flags['_text'][0].encode()).hexdigest()[:12]}.txt")
write_if_changed(flags_file, flags["_text"][0])
os.environ["XCCL_RS_TORCH_FLAGS"] = flags_file

write_if_changed(
    BUILD_INFO,
    '"""Written by setup.py: the torch this copy of xccl_rs was compiled against."""\n\n'
    f'TORCH_VERSION = "{major}.{minor}"\n'
    f"TORCH_CXX11_ABI = {abi}\n"
    f'DISTRIBUTION_VERSION = "{VERSION}"\n',
)

# What the package imports at run time besides torch (python_tests/test_packaging.py checks that
# every third-party import is here or guarded). tqdm: the weight sync's progress bars (the demo's).
# numpy is not one: the package never calls .numpy() (torch does not bring numpy).
DEPENDENCIES = ["tqdm>=4.62"]

setup(version=VERSION, install_requires=[f"torch=={major}.{minor}.*", *DEPENDENCIES])
