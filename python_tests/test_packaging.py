"""What the installed package needs at run time, and nothing more (issue 32).

`pip install torch && pip install .` gives a venv without numpy (torch does not bring it), where
torch's ``Tensor.numpy()`` raises "Numpy is not available". These tests make such a venv's
interpreter out of the suite's own: a ``sitecustomize.py`` on PYTHONPATH sets
``sys.modules["numpy"] = None``, so ``import numpy`` fails in every process, the demo's spawned
ranks included (the module is imported at start-up, before anything else). Then the demo's short
form must succeed and every module of the package must import. Separately, every third-party
module the package imports (found by parsing its sources) must be a declared dependency of the
package (setup.py's ``install_requires``) or be imported under a guard that catches ImportError.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import IS_XCCL

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "xccl_rs"

# Exceptions a handler may name and still catch ImportError.
CATCHES_IMPORT_ERROR = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
# A distribution whose import name differs from its own (none yet).
IMPORT_NAMES: dict[str, str] = {}


@pytest.fixture(scope="module")
def no_numpy_env(tmp_path_factory) -> dict:
    """The environment of a Python where numpy cannot be imported (checked)."""
    site = tmp_path_factory.mktemp("no_numpy")
    (site / "sitecustomize.py").write_text(
        "import sys\nsys.modules['numpy'] = None  # as in a venv that has no numpy\n"
    )
    env = dict(os.environ, XCCL_RS_LOG="off")
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    probe = subprocess.run(
        [sys.executable, "-c", "import torch\ntry:\n    torch.zeros(1).numpy()\nexcept RuntimeError as e:\n    print(e)"],
        capture_output=True, text=True, timeout=120, env=env, cwd="/tmp",
    )
    assert "Numpy is not available" in probe.stdout, f"numpy is not blocked:\n{probe.stdout}\n{probe.stderr[-2000:]}"
    return env


def test_every_module_imports_without_numpy(no_numpy_env):
    """Every module of the installed package (as pkgutil finds them), imported where numpy is not."""
    script = (
        "import importlib, pkgutil, xccl_rs\n"
        "names = [m.name for m in pkgutil.walk_packages(xccl_rs.__path__, 'xccl_rs.')]\n"
        "for name in names:\n    importlib.import_module(name)\n"
        "print('imported', ' '.join(names))\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env=no_numpy_env, cwd="/tmp")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    imported = p.stdout.split("imported", 1)[1].split()
    for name in ("xccl_rs.demo", "xccl_rs.bench", "xccl_rs.soak", "xccl_rs.weight_sync.receiver", "xccl_rs.weight_sync.window"):
        assert name in imported, f"{name} was not found: {imported}"


@pytest.mark.skipif(not IS_XCCL, reason="the demo runs xccl_rs groups")
def test_demo_runs_without_numpy(no_numpy_env):
    """The README's demo, short: both backends, two rounds, so that the rounds after the first
    (the shared window's reuse offer) run too; the progress bar on, as a user gets it."""
    p = subprocess.run(
        [sys.executable, "-m", "xccl_rs.demo", "--rounds", "2", "--layers", "1", "--bucket-mb", "64", "--timeout", "120"],
        capture_output=True, text=True, timeout=600, env=no_numpy_env, cwd="/tmp",
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "all received tensors verified bit for bit" in p.stdout, out[-6000:]
    assert "Numpy is not available" not in out


# ---------------------------------------------------------------- declared dependencies


def _requirement_name(req: str) -> str:
    return re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req.strip()).group(0).lower().replace("-", "_").replace(".", "_")


def declared_dependencies() -> set[str]:
    """Import names of the package's run-time requirements: pyproject's static ``dependencies``
    (if any) and setup.py's ``install_requires`` (string literals, f-strings by their leading
    text, and ``*NAME`` of a module-level list literal)."""
    names = set()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names |= {_requirement_name(r) for r in project.get("dependencies", [])}
    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
    assert len(calls) == 1, "setup.py: expected one setup(...) call"
    (requires,) = [kw.value for kw in calls[0].keywords if kw.arg == "install_requires"]
    for elt in requires.elts:
        if isinstance(elt, ast.Starred):
            names |= {_requirement_name(r) for r in ast.literal_eval(lists[elt.value.id])}
        elif isinstance(elt, ast.JoinedStr):
            names.add(_requirement_name(elt.values[0].value))
        else:
            names.add(_requirement_name(ast.literal_eval(elt)))
    return {IMPORT_NAMES.get(n, n) for n in names}


def _guarded(chain: list[ast.AST]) -> bool:
    """Whether an import whose ancestors are ``chain`` (outermost first) sits in the body of a
    ``try`` that catches ImportError, or under ``if TYPE_CHECKING:``."""
    for parent, child in zip(chain, chain[1:]):
        if isinstance(parent, ast.Try) and child in parent.body:
            for h in parent.handlers:
                caught = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
                if h.type is None or any(getattr(c, "id", None) in CATCHES_IMPORT_ERROR for c in caught):
                    return True
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test) and child in parent.body:
            return True
    return False


def imports_in(tree: ast.AST) -> list[tuple[ast.AST, str, bool]]:
    """(node, module, guarded) of every absolute import in ``tree``."""
    found = []

    def visit(node, chain):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found.extend((node, mod, _guarded(chain + [node])) for mod in mods)
        for child in ast.iter_child_nodes(node):
            visit(child, chain + [node])

    visit(tree, [])
    return found


def third_party_imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, top-level module, guarded) of every absolute import of a module that is
    neither the standard library nor xccl_rs."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node, mod, guarded in imports_in(ast.parse(path.read_text(), str(path))):
            top = mod.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("xccl_rs", "__future__"):
                found.append((str(path.relative_to(ROOT)), node.lineno, top, guarded))
    return found


def test_third_party_imports_are_declared_or_guarded():
    declared = declared_dependencies()
    assert "torch" in declared, declared
    imports = third_party_imports()
    assert any(top == "torch" for _, _, top, _ in imports), "the scan found no import of torch"
    bad = [f"{f}:{line}: import of {top}" for f, line, top, guarded in imports if top not in declared and not guarded]
    assert not bad, f"not in setup.py's install_requires ({sorted(declared)}) and not guarded by except ImportError:\n" + "\n".join(bad)


def test_the_scan_sees_an_unguarded_import():
    """The scan's own check: an unguarded import is found as such, a guarded one as guarded."""
    tree = ast.parse("import foo_mod\ntry:\n    import bar_mod\nexcept ImportError:\n    pass\n"
                     "try:\n    pass\nexcept ImportError:\n    import baz_mod\n"
                     "try:\n    import qux_mod\nexcept ValueError:\n    pass\n")
    seen = {mod: guarded for _, mod, guarded in imports_in(tree)}
    assert seen == {"foo_mod": False, "bar_mod": True, "baz_mod": False, "qux_mod": False}
