#!/usr/bin/env bash
# The slower suites, which CI runs after the test command (scripts/test.sh), each in venvs of
# its own in the cache:
#   1. the oldest torch we support, as a user without a toolchain gets it: scripts/test_wheel.sh
#      builds the torch 2.8 wheel, installs it in a fresh venv with no compiler on PATH and runs
#      the smoke suite (pytest -m smoke), the demo and the C++ package there, and checks that
#      torch 2.15 refuses it;
#   2. the vLLM weight-transfer engine against vLLM's own classes (scripts/test_vllm.sh);
#   3. between hosts made of network namespaces, over links shaped to 1 Gbit/s: the whole
#      collectives sweep at 2x2, 4x1 and 2+1+2 hosts (python_tests/test_multihost.py with
#      XCCL_RS_TEST_MULTIHOST=1; needs root, skipped otherwise).
# All run even if one fails; the exit status says whether all passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rc=0
echo "== the torch 2.8 wheel without a toolchain (scripts/test_wheel.sh)"
XCCL_RS_WHEEL_TORCH="${XCCL_RS_WHEEL_TORCH:-2.8}" XCCL_RS_WHEEL_OTHER_TORCH="${XCCL_RS_WHEEL_OTHER_TORCH:-2.15}" \
  "$ROOT/scripts/test_wheel.sh" || rc=1
echo "== vLLM's weight-transfer API (scripts/test_vllm.sh)"
"$ROOT/scripts/test_vllm.sh" || rc=1
echo "== between hosts: network namespaces with shaped rails (python_tests/test_multihost.py)"
( . "$ROOT/scripts/setup.sh" && cd "$ROOT" &&
  XCCL_RS_TEST_MULTIHOST=1 "$PY" -X faulthandler -m pytest python_tests/test_multihost.py python_tests/test_netns.py -q -ra ) || rc=1
exit "$rc"
