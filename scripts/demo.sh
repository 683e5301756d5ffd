#!/usr/bin/env bash
# The main demo (README): sets everything up, then runs `python -m xccl_rs.demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/setup.sh"
cd /tmp
exec "$PY" -m xccl_rs.demo "$@"
