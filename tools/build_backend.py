"""pip's build backend for xccl_rs: setuptools' own (``setuptools.build_meta``), behind a check
that the build tools are there.

With ``--no-build-isolation`` pip does not install ``build-system.requires``, and setuptools
without setuptools-rust silently skips the Rust extension: pip reported success for a package
that could not be imported. Failing here, with the command that fixes it, makes that
impossible. (With build isolation pip installs the tools itself, and this check passes.)
"""

from __future__ import annotations

import importlib.util

# The import names of pyproject.toml's build-system.requires.
_TOOLS = {"setuptools": "setuptools>=68", "setuptools_rust": "setuptools-rust>=1.9"}

_missing = [req for name, req in _TOOLS.items() if importlib.util.find_spec(name) is None]
if _missing:
    raise ImportError(
        "xccl_rs: building needs " + " and ".join(f"'{r}'" for r in _missing) + ", which this Python "
        "lacks (pip does not install build tools under --no-build-isolation): run "
        f"`pip install {' '.join(repr(r) for r in _missing)}` and then the same pip command again"
    )

from setuptools.build_meta import *  # noqa: E402,F401,F403  (the PEP 517 hooks)
