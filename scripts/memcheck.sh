#!/usr/bin/env bash
# The Rust core's own tests (tests/*.rs: ranks as threads over loopback TCP and shared memory)
# under valgrind memcheck: invalid reads/writes, uses of uninitialised memory, bad frees and
# leaks in the Rust code and in what it calls. Stable Rust has neither ASan nor Miri for code
# that does syscalls, futexes and mmap, hence valgrind. Not part of scripts/test.sh: it takes
# minutes, and it is a sweep for memory errors, not a functional test.
#
#   scripts/memcheck.sh              the representative subset below
#   scripts/memcheck.sh BIN FILTER   one test binary (tests/BIN.rs) with a libtest filter
#
# Exit status: non-zero if any binary fails or valgrind reports an error (--error-exitcode).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
# Its own target directory: a memcheck build never races the normal builds for cargo's lock.
export CARGO_TARGET_DIR="$CACHE/target-memcheck"
LOG_DIR="$CARGO_TARGET_DIR/memcheck-logs"
mkdir -p "$LOG_DIR"
cd "$ROOT"

command -v valgrind >/dev/null || { echo "== installing valgrind"; apt-get install -y -q valgrind >/dev/null; }

# Release with debug info: the speed the tests expect (their timeouts), stacks with lines.
export CARGO_PROFILE_RELEASE_DEBUG=true
echo "== building the test binaries (cargo test --release --no-run, target $CARGO_TARGET_DIR)"
# The path of each tests/<name>.rs binary, from cargo's JSON messages.
declare -A BIN
while IFS=$'\t' read -r name path; do BIN[$name]=$path; done < <(
  cargo test --release --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"], sep="\t")')
[ "${#BIN[@]}" -gt 0 ] || { echo "no test binaries built (run cargo test --release --no-run to see why)" >&2; exit 1; }

# (binary, filter): every collective family over both transports, point-to-point, the
# shared-memory futex wake-ups, abort and zero-copy heaps — the code with the unsafe blocks
# (segments, slots, heaps, raw buffers, the reduction kernels) — and the TLS tunnels (their
# threads, socket pairs, rustls). The exhaustive dtype × size sweeps stay out: valgrind runs
# them 20-50 times slower and they add no new code paths.
CASES=(
  "collectives allreduce_f32::"
  "collectives allreduce_bf16::"
  "collectives reduce_scatter_f32_i32_bf16::"
  "collectives broadcast_every_root::"
  "collectives allgather_out_of_place_and_in_place::"
  "collectives alltoall_unequal_and_empty_pairs::"
  "collectives coalesced_job_of_collectives::"
  "p2p "
  "shm_wakeup "
  "abort "
  "zero_copy "
  "tls "
  "cma the_config_is_what_the_group_uses"
)
[ "$#" -ge 1 ] && CASES=("$1 ${2:-}")

# The tests give each rank a thread and wait on timeouts: valgrind serialises threads, so
# --fair-sched keeps a spinning rank from starving the one it waits for.
# memcheck.supp: valgrind's known blind spot in ring's AES-GCM assembly (the TLS tests), and
# nothing else.
VG=(valgrind --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite
    --fair-sched=yes --num-callers=30 --quiet --suppressions="$ROOT/scripts/memcheck.supp")
failed=0
for case in "${CASES[@]}"; do
  read -r bin filter <<<"$case"
  exe="${BIN[$bin]:-}"
  [ -n "$exe" ] || { echo "no test binary '$bin'" >&2; failed=1; continue; }
  log="$LOG_DIR/$bin${filter:+-${filter//:/}}.log"
  start=$SECONDS
  # --test-threads=1: one test at a time, so a report belongs to one test.
  if "${VG[@]}" --log-file="$log.vg" "$exe" --test-threads=1 ${filter:+"$filter"} >"$log" 2>&1; then
    verdict=ok
  else
    verdict="FAILED (rc $?)"; failed=1
  fi
  ran=$(grep -Eo '[0-9]+ passed; [0-9]+ failed' "$log" | tail -1 || true)
  errors=$(grep -c '^==[0-9]*== [A-Z].*\(Invalid\|uninitialised\|definitely lost\|Mismatched\|free\)' "$log.vg" || true)
  printf '%-12s %-45s %4ds  %-22s valgrind reports: %s  %s\n' "$bin" "${filter:-(all)}" $((SECONDS - start)) \
    "${ran:-?}" "$errors" "$verdict"
  [ "$verdict" = ok ] || { tail -40 "$log.vg"; tail -20 "$log"; }
done
echo "logs: $LOG_DIR"
exit "$failed"
