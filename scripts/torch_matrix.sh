#!/usr/bin/env bash
# The torch version matrix: for each torch minor (default 2.8 to 2.15), a venv with that torch
# from PyPI, xccl_rs built against it (scripts/setup.sh), and the smoke suite (pytest -m smoke:
# python_tests/conftest.py says what it holds). Prints one table row per version and appends
# it to $XCCL_RS_CACHE/matrix/results.md (docs/building.md has the table).
#
#   scripts/torch_matrix.sh            every version
#   scripts/torch_matrix.sh 2.8 2.15   some
#   scripts/torch_matrix.sh --prefetch 2.8   only make the venv and install torch (scripts/test.sh
#                                            runs this in the background while it builds)
#
# Each version lives in $XCCL_RS_CACHE/matrix/torch-X.Y (a venv of about 5 GB and a cargo
# target directory); it is deleted after its run unless XCCL_RS_MATRIX_KEEP=1.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
PREFETCH=0
if [ "${1:-}" = --prefetch ]; then
  PREFETCH=1
  shift
fi
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.8 2.9 2.10 2.11 2.12 2.13 2.14 2.15)
RESULTS="$CACHE/matrix/results.md"
mkdir -p "$CACHE/matrix"

if [ "$PREFETCH" = 1 ]; then
  for v in "${VERSIONS[@]}"; do
    (export XCCL_RS_CACHE="$CACHE/matrix/torch-$v" XCCL_RS_TORCH="torch==$v.*" XCCL_RS_SETUP_TORCH_ONLY=1
     . "$ROOT/scripts/setup.sh") || exit 1
  done
  exit 0
fi

failed=0
for v in "${VERSIONS[@]}"; do
  dir="$CACHE/matrix/torch-$v"
  log="$CACHE/matrix/torch-$v.log"
  echo "== torch $v (log: $log)"
  t0=$SECONDS
  (
    export XCCL_RS_CACHE="$dir" XCCL_RS_TORCH="torch==$v.*"
    . "$ROOT/scripts/setup.sh"
    echo "TORCH $("$PY" -c 'import torch; print(torch.__version__)')"
    echo "BUILT $((SECONDS - t0)) s"
    cd "$ROOT" && "$PY" -m pytest python_tests -m smoke -q -p no:cacheprovider
  ) >"$log" 2>&1
  rc=$?
  torch_full=$(sed -n 's/^TORCH //p' "$log" | tail -1)
  built=$(sed -n 's/^BUILT //p' "$log" | tail -1)
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^=+ .*(passed|failed|error).* =+$' "$log" | tail -1 | tr -d '=' | xargs)
  if [ "$rc" -eq 0 ]; then result="pass"; else result="FAIL (rc $rc)"; failed=1; tail -n 60 "$log"; fi
  row="| $v | ${torch_full:-not installed} | build ${built:-failed}, smoke: ${summary:-none (see log)} | $result | $(date -u +%F) |"
  echo "$row" | tee -a "$RESULTS"
  [ "${XCCL_RS_MATRIX_KEEP:-0}" = 1 ] || rm -rf "$dir"
done
exit $failed
