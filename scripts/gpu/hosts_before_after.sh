#!/usr/bin/env bash
# On the GPU machine's 16 cores (the GPU hidden): CPU collectives across fake hosts
# (XCCL_RS_HOST_ID through `python -m xccl_rs.bench --fake-hosts`), xccl_rs before and after a
# change beside gloo, the two builds alternating per layout in one call. Carry `.gpu` (after) and
# `.before-gpu` (before: scripts/gpu/prepare.sh run at the older commit, its .gpu renamed); the
# C++ bridge must be the same at both commits. Results: $OUT/hosts-<layout>-<build>.log.
#   scripts/gpu/hosts_before_after.sh "2x2 2x4 4x2 8x1" "1M 16M 64M"
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/.gpu/out}"
mkdir -p "$OUT"
cd "$ROOT"
layouts="${1:-2x2 2x4 4x2 8x1}"
sizes="${2:-1M 16M 64M}"
build_into() {  # $1: the .gpu folder to link, $2: where the package goes
  rm -rf .gpu/obj && mkdir -p "$2"
  if [ "$1" != .gpu ]; then mv .gpu .gpu-kept && cp -r "$1" .gpu; fi
  scripts/gpu/build.sh >"$OUT/build-$(basename "$2").log" 2>&1 || { echo "build failed: $2"; tail "$OUT/build-$(basename "$2").log"; }
  cp -r python/xccl_rs "$2/"
  if [ "$1" != .gpu ]; then rm -rf .gpu && mv .gpu-kept .gpu; fi
}
build_into .gpu /tmp/build-after
build_into .before-gpu /tmp/build-before
nproc --all >"$OUT/machine.txt"
export CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
for layout in $layouts; do
  hosts="${layout%x*}"; per="${layout#*x}"
  for build in before after; do
    PYTHONPATH="/tmp/build-$build" timeout 240 python3 -m xccl_rs.bench --ranks $((hosts * per)) --fake-hosts "$hosts" \
      --ops all_reduce all_gather reduce_scatter --dtypes float32 --sizes $sizes --no-check --scale "${SCALE:-0.5}" \
      >"$OUT/hosts-$layout-$build.log" 2>&1
    echo "$layout $build rc=$?"; grep -v "^# *$" "$OUT/hosts-$layout-$build.log" | tail -n 14
  done
done
