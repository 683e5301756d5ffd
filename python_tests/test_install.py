"""The install, as a new user meets it: the README's "Use" commands run literally in a fresh venv
(no build tools in it: pip's build isolation brings them), `pip install --no-build-isolation .`
without the build tools (a clear error, nothing installed), the checks `import xccl_rs` makes
of the torch it loads into, and the wheel that `pip wheel` makes (its torch requirement, its
platform tag, its type information).

The fresh venv costs a torch install (from pip's cache after the first) and a full build of
xccl_rs (a few minutes on 2 cores): one venv serves every test of this file, built once.
Set XCCL_RS_TEST_SKIP_INSTALL=1 to skip them in a developer loop.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from harness import IS_XCCL, free_port

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XCCL_RS_CACHE", Path.home() / ".cache" / "xccl_rs"))

pytestmark = [
    pytest.mark.skipif(not IS_XCCL, reason="the install concerns the xccl_rs package only"),
    pytest.mark.skipif(os.environ.get("XCCL_RS_TEST_SKIP_INSTALL") == "1", reason="XCCL_RS_TEST_SKIP_INSTALL=1"),
]


def readme_block(heading: str, lang: str) -> str:
    """The first ```lang block after the README heading ``heading``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1]
    return re.search(rf"```{lang}\n(.*?)```", section, re.S).group(1)


def readme_blocks(heading: str, lang: str) -> list[str]:
    """Every ```lang block of the README section ``heading``, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def readme_use_commands() -> list[str]:
    return [line.split("#", 1)[0].strip() for line in readme_block("Use", "bash").splitlines() if line.split("#", 1)[0].strip()]


def run(cmd: str, venv: Path, timeout: float, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """A shell command as a user would type it with the venv activated."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "CARGO_TARGET_DIR")}
    full_env.update(PATH=f"{venv / 'bin'}{os.pathsep}{full_env['PATH']}", VIRTUAL_ENV=str(venv), **(env or {}))
    return subprocess.run(
        cmd, shell=True, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def expect_ok(p: subprocess.CompletedProcess, what: str) -> None:
    assert p.returncode == 0, f"{what}: exit {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-6000:]}"


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    """A venv made as a user makes one, with torch from PyPI (`pip install torch`)."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv


def test_no_build_isolation_without_build_tools_fails_clearly(fresh_venv):
    # The venv's own setuptools (if any) is there, setuptools-rust is not.
    expect_ok(run("pip install -q torch", fresh_venv, 900), "pip install torch")
    assert run("python -c 'import setuptools_rust'", fresh_venv, 60).returncode != 0, "the fresh venv has setuptools-rust"
    p = run("pip install --no-build-isolation .", fresh_venv, 600)
    out = p.stdout + p.stderr
    assert p.returncode != 0, f"pip reported success without the build tools:\n{out[-4000:]}"
    assert "setuptools-rust" in out and "pip install" in out, f"the error does not say what to install:\n{out[-4000:]}"
    p = run("python -c 'import xccl_rs'", fresh_venv, 120, cwd=Path("/"))
    assert p.returncode != 0 and "No module named 'xccl_rs'" in p.stderr, f"something was installed:\n{p.stderr[-2000:]}"


def test_readme_use_commands(fresh_venv):
    """The README's "Use" commands, literally, then its Python examples on one rank (env://)."""
    commands = readme_use_commands()
    assert commands and commands[0] == "pip install torch", f"README's Use block changed: {commands}"
    # Build products go to the cache, not into the clone.
    build_env = {"CARGO_TARGET_DIR": str(CACHE / "target-fresh-venv")}
    for cmd in commands:
        expect_ok(run(cmd, fresh_venv, 1500, env=build_env), cmd)
    example = "\n".join(readme_blocks("Use", "python"))
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}
    script = example + "\nassert t.tolist() == [0.5] * 4, t\nassert bool((g == 1).all())\nprint('README example OK')\n"
    p = run(f"python - <<'EOF'\n{script}\nEOF", fresh_venv, 300, env=env, cwd=Path("/"))
    expect_ok(p, "the README's Python example")
    assert "README example OK" in p.stdout
    # The README's other way, without build isolation (cargo's target directory is warm now).
    for cmd in ["pip install setuptools-rust", "pip install --no-build-isolation ."]:
        expect_ok(run(cmd, fresh_venv, 1500, env=build_env), cmd)


def _site_packages(venv: Path) -> Path:
    p = run("python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'", venv, 60)
    expect_ok(p, "site-packages")
    return Path(p.stdout.strip())


def test_import_refuses_another_torch(fresh_venv):
    """The import checks the torch it loads into against _build_info (written by setup.py)
    before it loads the extension, and says how to rebuild. Simulated by editing the record."""
    pkg = _site_packages(fresh_venv) / "xccl_rs"
    info = pkg / "_build_info.py"
    if not info.exists():
        pytest.skip("xccl_rs is not installed in the fresh venv (test_readme_use_commands failed)")
    original = info.read_text()
    try:
        info.write_text(re.sub(r'TORCH_VERSION = "[^"]*"', 'TORCH_VERSION = "2.7"', original))
        p = run("python -c 'import xccl_rs'", fresh_venv, 120, cwd=Path("/"))
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode != 0 and last.startswith("ImportError: xccl_rs was compiled against torch 2.7"), p.stderr[-3000:]
        assert "is being loaded into torch 2." in last and "pip install --force-reinstall --no-deps ." in last, last
        assert 'pip install "xccl_rs==2.' in last, last  # the wheel for the running torch
    finally:
        info.write_text(original)
    ext = next(pkg.glob("_C*.so"))
    hidden = ext.with_name("hidden-" + ext.name)
    ext.rename(hidden)
    try:
        p = run("python -c 'import xccl_rs'", fresh_venv, 120, cwd=Path("/"))
        assert p.returncode != 0 and "has no compiled extension (_C)" in p.stderr, p.stderr[-3000:]
    finally:
        hidden.rename(ext)
    expect_ok(run("python -c 'import xccl_rs'", fresh_venv, 120, cwd=Path("/")), "import after restoring")


def test_wheel_metadata(tmp_path):
    """`pip wheel` (here without isolation, in the suite's own venv, so that it reuses the
    build): the wheel requires the torch release it was built against, carries an honest
    platform tag, and ships py.typed and the type stubs of the public API."""
    import torch

    # The environment of scripts/setup.sh's install, so that cargo finds its build fresh.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("CARGO_TARGET_DIR", str(CACHE / "target"))
    env["XCCL_RS_PYTHON"] = sys.executable
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=1500, env=env,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    (wheel,) = tmp_path.glob("xccl_rs-*.whl")
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    assert wheel.name.endswith(f"-{py}-{py}-{platform}.whl"), f"wheel tag: {wheel.name}"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist: torch")]
    assert requires == [f"Requires-Dist: torch=={release}.*"], requires
    stubs = ["py.typed", "__init__.pyi", "_C.pyi", "weight_sync/__init__.pyi", "verl_engine.pyi", "_build_info.py"]
    modules = [f"weight_sync/{m}.py" for m in ("__init__", "_common", "format", "plan", "window", "sender", "receiver")]
    for stub in stubs + modules:
        assert f"xccl_rs/{stub}" in names, f"the wheel lacks xccl_rs/{stub}"
    for gone in ["weight_sync.py", "weight_sync.pyi", "shared_window.py"]:  # now the weight_sync package
        assert f"xccl_rs/{gone}" not in names, f"the wheel still has xccl_rs/{gone} (a stale build/?)"
    assert any(re.fullmatch(r"xccl_rs/_C\..*\.so", n) for n in names), "the wheel lacks the extension"
