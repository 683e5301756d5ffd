#!/usr/bin/env bash
# On the GPU machine, in one call: the weight sync of CUDA tensors against the link's copy floor,
# each run into its own log in $OUT:
#   floor-d2h.log, floor-h2d.log  gpu_copy_floor.py alone: one rank's copy of the demo's bytes to
#                                 pinned host memory, then two ranks' copies back at once
#   demo-cuda-bf16.log            the demo as it runs by default (buckets on the device), with gloo
#   demo-cuda-window-bf16.log     the buckets on the host instead (--bucket-device cpu: the shared
#                                 window, registered with the CUDA runtime)
#   demo-cuda-window-fp32.log     the same in fp32 (FP32=0 skips it)
# Each demo prints every sync against its copy floor measured in the same run.
# From the development machine: scripts/gpu/prepare.sh, then the device tool's run with carry
# [".gpu"] and the command `scripts/gpu/weight_sync_cuda.sh` (docs/gpu.md).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export OUT="${OUT:-$ROOT/.gpu/out}"
mkdir -p "$OUT"
cd "$ROOT"
ROUNDS="${ROUNDS:-5}"
step() {  # step NAME SECONDS COMMAND...: one bounded run, its time and exit code on one line
  local name="$1" limit="$2" t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >/dev/null 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
[ -n "${XCCL_RS_SKIP_BUILD:-}" ] || scripts/gpu/build.sh >"$OUT/build.log" 2>&1 || { tail -n 20 "$OUT/build.log"; exit 1; }
export XCCL_RS_SKIP_BUILD=1
BYTES=988065536  # the demo's bf16 sync: Qwen2.5-0.5B's 494M parameters
step floor-d2h 120 bash -c "python3 scripts/gpu/gpu_copy_floor.py 1 $BYTES 7 >'$OUT/floor-d2h.log' 2>&1"
step floor-h2d 120 bash -c "python3 scripts/gpu/gpu_copy_floor.py 2 $BYTES 7 >'$OUT/floor-h2d.log' 2>&1"
XCCL_RS_RUN_TAG=demo-cuda-bf16 step demo-cuda-bf16 150 scripts/gpu/run.sh demo --device cuda --rounds "$ROUNDS" --no-progress
XCCL_RS_RUN_TAG=demo-cuda-window-bf16 step demo-cuda-window-bf16 120 scripts/gpu/run.sh demo --device cuda \
  --rounds "$ROUNDS" --no-progress --no-gloo --bucket-device cpu
[ "${FP32:-1}" = 1 ] && XCCL_RS_RUN_TAG=demo-cuda-window-fp32 step demo-cuda-window-fp32 120 scripts/gpu/run.sh demo \
  --device cuda --rounds "$ROUNDS" --no-progress --no-gloo --bucket-device cpu --dtype fp32
grep -h "floor 1 ranks.*d2h \|floor 2 ranks.*h2d " "$OUT"/floor-*.log
tail -n 6 "$OUT"/demo-*.log
