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


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or XPU device (skipped otherwise)")


def pytest_report_header(config):
    return f"xccl_rs suite: backend under test = {harness.BACKEND!r} (XCCL_RS_TEST_BACKEND)"


def pytest_collection_modifyitems(config, items):
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="no CUDA/XPU device available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
