"""Placeholder for accelerator tests (none yet).

Tests here must be marked ``@pytest.mark.gpu``; conftest.py skips them when neither
CUDA nor XPU is available.
"""

import pytest

pytestmark = pytest.mark.gpu
