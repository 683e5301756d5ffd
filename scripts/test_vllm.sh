#!/usr/bin/env bash
# The vLLM weight-transfer engine's tests (python_tests/vllm): vLLM 0.33.0 pins torch 2.14.0, and a
# c10d backend must be compiled against the torch that loads it, so they run in a venv of their
# own, $XCCL_RS_CACHE/vllm (default ~/.cache/xccl_rs/vllm), made here idempotently: torch 2.14.0,
# xccl_rs built against it (scripts/setup.sh), then vLLM. Extra arguments go to pytest.
#
#   XCCL_RS_CACHE   the cache scripts/setup.sh uses; this venv lives in its vllm/ directory
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
VCACHE="$CACHE/vllm"
VLLM_VERSION=0.33.0
TORCH_REQ="torch==2.14.0"  # vLLM 0.33.0's Requires-Dist
PY="$VCACHE/venv/bin/python"
LOGS="$VCACHE/logs"
mkdir -p "$LOGS"
t0=$SECONDS

setup() {
  (cd "$ROOT" && XCCL_RS_CACHE="$VCACHE" XCCL_RS_TORCH="$TORCH_REQ" bash -c '. scripts/setup.sh')
}

echo "== xccl_rs against $TORCH_REQ in $VCACHE/venv (log: $LOGS/setup.log)"
setup >"$LOGS/setup.log" 2>&1 \
  || { tail -60 "$LOGS/setup.log" >&2; echo "building xccl_rs against $TORCH_REQ failed (log: $LOGS/setup.log)" >&2; exit 1; }
echo "   $((SECONDS - t0)) s"

if [ "$("$PY" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null)" != "$VLLM_VERSION" ]; then
  echo "== installing vllm==$VLLM_VERSION (log: $LOGS/vllm.log)"
  "$PY" -m pip install -q "vllm==$VLLM_VERSION" "$TORCH_REQ" >"$LOGS/vllm.log" 2>&1 \
    || { tail -40 "$LOGS/vllm.log" >&2; echo "installing vLLM failed" >&2; exit 1; }
  echo "   $((SECONDS - t0)) s"
fi
"$PY" -c "import torch, xccl_rs; assert torch.__version__.startswith('2.14.0'), torch.__version__" \
  || { echo "the vLLM venv's torch is not 2.14.0, or xccl_rs does not import in it" >&2; exit 1; }

echo "== pytest python_tests/vllm"
set +e
(cd "$ROOT" && "$PY" -X faulthandler -m pytest python_tests/vllm -q -ra "$@")
rc=$?
set -e
echo "   $((SECONDS - t0)) s in all"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (is vLLM importable in $PY?): that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
