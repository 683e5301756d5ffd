#!/usr/bin/env bash
# On the GPU machine, in one call: every device test at this commit and the figures docs/perf.md
# records for CUDA tensors, each into its own log in $OUT:
#   tests.log (the tests marked gpu), xpu.log (the emulated-XPU tests), demo-bf16.log and
#   demo-fp32.log (weight sync, --device cuda), broadcast-1G.log (2 ranks) and
#   all_reduce-64M.log (4 ranks, bf16, with 100 async issues), allreduce_trace.json (a profiled
#   64 MiB all_reduce: the staging copies on the device's streams beside xccl_rs's ranges).
# From the development machine: scripts/gpu/prepare.sh, then the device tool's run with carry
# [".gpu"] and the command `scripts/gpu/at_head.sh` (docs/gpu.md).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export OUT="${OUT:-$ROOT/.gpu/out}"
mkdir -p "$OUT"
cd "$ROOT"
# No commit is recorded here: the device machine's copy of the tree may carry an older .git.
step() {  # step NAME SECONDS COMMAND...: one bounded run, its time and exit code on one line
  local name="$1" limit="$2" t0=$SECONDS
  shift 2
  timeout "$limit" "$@" >/dev/null 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
XCCL_RS_RUN_TAG=tests step tests 300 scripts/gpu/run.sh tests
ls python/xccl_rs/_C*.so >/dev/null 2>&1 || { tail -n 20 "$OUT/build.log"; exit 1; }
export XCCL_RS_SKIP_BUILD=1
step xpu 300 bash -c 'PYTHONPATH=python:python_tests OMP_NUM_THREADS=1 python3 -m pytest python_tests/test_xpu.py \
  -q -ra -p no:cacheprovider >"$OUT/xpu.log" 2>&1'
XCCL_RS_RUN_TAG=demo-bf16 step demo-bf16 120 scripts/gpu/run.sh demo --device cuda --rounds 3 --no-progress
XCCL_RS_RUN_TAG=demo-fp32 step demo-fp32 120 scripts/gpu/run.sh demo --device cuda --rounds 3 --no-progress --dtype fp32
XCCL_RS_RUN_TAG=broadcast-1G step broadcast-1G 180 scripts/gpu/run.sh bench --device cuda --ranks 2 --ops broadcast \
  --dtypes float32 --sizes 1G
XCCL_RS_RUN_TAG=all_reduce-64M step all_reduce-64M 180 scripts/gpu/run.sh bench --device cuda --ranks 4 \
  --ops all_reduce --dtypes bfloat16 --sizes 64M --issue-async 100
step profile 120 bash -c 'cd scripts/gpu && for r in 0 1 2 3; do RANK=$r WORLD=4 PYTHONPATH="$OLDPWD/python" \
  python3 allreduce_profile.py & done >"$OUT/profile.log" 2>&1; wait'
tail -n 3 "$OUT"/*.log
