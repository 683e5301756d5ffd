#!/usr/bin/env bash
# The test command (README, CI): sets everything up, then runs the Rust core tests and the
# Python suite. Extra arguments go to pytest (e.g. -k allreduce).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup.sh"
cd "$ROOT"

echo "== cargo test (Rust core: ranks as threads over loopback TCP)"
cargo test --release --quiet

echo "== pytest (ranks as processes)"
set +e
"$PY" -m pytest python_tests -q -ra "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure, not a pass" >&2
  exit 1
fi
exit "$rc"
