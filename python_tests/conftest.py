"""pytest configuration of the xccl_rs suite.

XCCL_RS_TEST_BACKEND selects the backend under test (default "xccl_rs"; "gloo" validates
the harness and the references). Hangs are prevented by harness deadlines (no
pytest-timeout).
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def _has_accelerator() -> bool:
    try:
        import torch
    except ImportError:
        return False
    if torch.cuda.is_available():
        return True
    return hasattr(torch, "xpu") and torch.xpu.is_available()


# The smoke suite (`pytest -m smoke`), run on every torch of the version matrix
# (scripts/torch_matrix.sh): registration, every collective at 2 ranks, AVG and PREMUL_SUM, size
# and dtype mismatches, a private group, the backend's name, a weight-sync round trip and the exit
# of a script that ends on an error.
# Node-id prefixes.
SMOKE = [
    "test_registration.py::test_init_env",
    "test_registration.py::test_init_explicit_store",
    "test_collectives.py::test_collective[w2-",
    "test_avg_premul.py::test_avg_premul[w2]",
    "test_errors.py::test_size_mismatch_raises_everywhere",
    "test_errors.py::test_dtype_mismatch_raises_everywhere",
    "test_private_group.py::test_private_group_without_default_world",
    "test_private_group.py::test_torch_sees_our_name",  # _whole_group reads torch's helper's frame
    "test_weight_sync.py::test_round_trips",
    "test_script_exit.py::",  # a script ending on our error exits with code 1 under torchrun
]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or XPU device (skipped otherwise)")
    config.addinivalue_line("markers", "smoke: the per-torch-version smoke suite (conftest.SMOKE)")


def pytest_report_header(config):
    return f"xccl_rs suite: backend under test = {harness.BACKEND!r} (XCCL_RS_TEST_BACKEND)"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.nodeid.split("/")[-1].startswith(prefix) for prefix in SMOKE):
            item.add_marker(pytest.mark.smoke)
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="no CUDA/XPU device available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
