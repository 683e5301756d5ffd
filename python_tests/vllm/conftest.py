"""python_tests/vllm runs only where vLLM is installed (scripts/test_vllm.sh makes such a venv).

Elsewhere its tests are not collected at all, so the main suite's counts do not change. A real
vLLM is a regular package; this directory itself would pass for a namespace package named
``vllm`` when python_tests is on sys.path, hence the check of the spec's origin.

Its tests share ``ctx``, the multiprocessing context of their vLLM workers and trainers.
"""

import importlib.util
import multiprocessing as mp
import os

import pytest


def _vllm_installed() -> bool:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin not in (None, "namespace")


if not _vllm_installed():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def ctx():
    """The workers and trainers fork from a server that imported torch, vLLM and transformers once
    (seconds each)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "vllm.config", "vllm.distributed.weight_transfer",
                              "vllm.model_executor.model_loader.reload", "transformers"])
    return c
