#!/usr/bin/env bash
# The test command (README, CI): sets everything up, then runs the Rust core tests and the
# Python suite. Extra arguments go to pytest (e.g. -k allreduce). The slower suites (the oldest
# torch through its wheel, vLLM's engine) are scripts/test_extra.sh, which CI runs after this.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
LOGS="$CACHE/test-logs"
mkdir -p "$LOGS"

. "$ROOT/scripts/setup.sh"
cd "$ROOT"

# verl (for python_tests/test_verl.py: the adapter against the real package), without letting
# it change the torch the extension was built against; in the background during cargo test,
# which does not use the venv.
verl_pid=
if ! "$PY" -c "import verl.checkpoint_engine" 2>/dev/null; then
  echo "== installing verl 0.9.1 and its checkpoint-engine dependencies in the background (log: $LOGS/verl.log)"
  TORCH_RELEASE="$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')"
  "$PY" -m pip install -q "verl==0.9.1" uvicorn fastapi pyzmq msgspec cachetools "torch==$TORCH_RELEASE" \
    >"$LOGS/verl.log" 2>&1 &
  verl_pid=$!
fi

echo "== cargo test (Rust core: ranks as threads over loopback TCP)"
cargo test --release --quiet
if [ -n "$verl_pid" ] && ! wait "$verl_pid"; then
  cat "$LOGS/verl.log" >&2
  echo "installing verl failed (log above)" >&2
  exit 1
fi

echo "== pytest (ranks as processes)"
set +e
"$PY" -X faulthandler -m pytest python_tests -q -ra "$@"  # a crash prints its stack
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
