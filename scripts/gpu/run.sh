#!/usr/bin/env bash
# On the GPU machine: builds the bridge (build.sh), then runs what is asked and writes logs and
# JSON into $OUT (the device tool brings that folder back):
#   scripts/gpu/run.sh tests ARGS...  # the python_tests marked gpu (ARGS go to pytest)
#   scripts/gpu/run.sh bench ARGS...  # python -m xccl_rs.bench ARGS (JSON in $OUT/bench.json)
#   scripts/gpu/run.sh demo ARGS...   # python -m xccl_rs.demo ARGS
# From the development machine: scripts/gpu/prepare.sh, then the device tool's run with
# carry [".gpu"] and the command `scripts/gpu/run.sh tests` (see docs/gpu.md).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.gpu/out}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT/python:$ROOT/python_tests" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
if [ -z "${XCCL_RS_SKIP_BUILD:-}" ]; then  # set it for a second run in the same call
  "$ROOT/scripts/gpu/build.sh" 2>&1 | tee "$OUT/build.log" | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/machine.txt"
echo "$(nproc --all) cores, $(python3 -c 'import torch; print("torch", torch.__version__)')" | tee -a "$OUT/machine.txt"
what="${1:-tests}"
shift || true
LOG="$OUT/${XCCL_RS_RUN_TAG:-$what}.log"  # XCCL_RS_RUN_TAG: name this run's log (several per call)
case "$what" in
  tests) python3 -m pytest python_tests -q -ra -m gpu -p no:cacheprovider "$@" 2>&1 | tee "$LOG" ;;
  bench) case " $* " in *" --peer deepspeed "*) source "$ROOT/scripts/gpu/peer_deepspeed.sh" ;; esac
    python3 -m xccl_rs.bench --json "${LOG%.log}.json" "$@" 2>&1 | tee "$LOG" ;;
  demo) python3 -m xccl_rs.demo "$@" 2>&1 | tee "$LOG" ;;
  *) echo "unknown: $what (tests | bench | demo)" >&2; exit 2 ;;
esac
exit "${PIPESTATUS[0]}"
