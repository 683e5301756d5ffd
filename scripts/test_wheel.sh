#!/usr/bin/env bash
# The install without a toolchain (issue 37), as a user meets it: the wheel that
# scripts/build_wheels.sh makes for this Python and torch X.Y goes into a fresh venv, with torch
# from PyPI, through a PATH that has no cargo, rustc, cc, c++, gcc or g++ (nor ld or as), and
# pip allowed binary wheels only. Then, still without them:
#   1. the smoke suite (pytest python_tests -m smoke) and the demo's short form, on the wheel;
#   2. the wheel refused by another torch at import, naming both versions (the wheel's own
#      package files on the path of another torch's Python: the main venv's, $XCCL_RS_CACHE/venv,
#      if it has that torch, else the torch matrix's venv of it);
#   3. the C++ package in the wheel (docs/cpp.md): examples/cpp built through find_package(xccl_rs)
#      with CMake and g++ (a C++ user's tools) but no Rust, run at 2 ranks; and find_package
#      refusing a Python whose torch is another minor version.
# Fails loudly: the first failing step prints its output and the script exits 1.
#
#   scripts/test_wheel.sh
#   XCCL_RS_WHEEL=path/to.whl      test that wheel instead of building one
#   XCCL_RS_WHEEL_TORCH            the torch minor to build the wheel for (default: the main venv's,
#                                  $XCCL_RS_CACHE/venv, else 2.15)
#   XCCL_RS_WHEEL_OTHER_TORCH      the other torch of steps 2 and 3 (default 2.8)
#   XCCL_RS_WHEEL_REF / _SRC       passed to build_wheels.sh (default: the wheel of HEAD)
#
# Costs (2-core VM, shared, load 9): warm (the wheel built, the wheelhouse filled) 5.3 minutes
# for the torch 2.8 wheel: the wheel 35 s, the fresh venv and its install 2.4 min, the smoke
# suite 1 min, the demo 1 min, the C++ package 25 s. The first run adds torch's download (1 to
# 3.5 minutes here, 3 GB), the wheel's build (2 minutes after a change to the sources, 4 to 7
# cold) and, if missing, the other torch's venv (about 90 s).
# The fresh venv (5.5 GB) is deleted at the end, in the background.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
WT="$CACHE/wheel-test"
OTHER="${XCCL_RS_WHEEL_OTHER_TORCH:-2.8}"
mkdir -p "$WT"
T0=$SECONDS
step() { echo "== [$(( SECONDS - T0 )) s] $*"; }
fail() { echo "test_wheel.sh: FAILED: $*" >&2; exit 1; }
# Runs a step's command with its output in $WT/<name>.log; on failure prints the log's end.
logged() {
  local name=$1; shift
  if ! "$@" >"$WT/$name.log" 2>&1; then
    tail -n 80 "$WT/$name.log" >&2
    fail "$name (log: $WT/$name.log)"
  fi
}

# --- The wheel.
if [ -n "${XCCL_RS_WHEEL:-}" ]; then
  WHEEL="$(cd "$(dirname "$XCCL_RS_WHEEL")" && pwd)/$(basename "$XCCL_RS_WHEEL")"
  [ -f "$WHEEL" ] || fail "no wheel at $XCCL_RS_WHEEL"
else
  V="${XCCL_RS_WHEEL_TORCH:-}"
  if [ -z "$V" ]; then
    V="$(PYTHONWARNINGS=ignore "$CACHE/venv/bin/python" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null || echo 2.15)"
  fi
  step "building the wheel for torch $V (scripts/build_wheels.sh $V)"
  rm -rf "$WT/dist"
  WHEEL_OUT="$WT/dist" XCCL_RS_MATRIX_KEEP=1 "$ROOT/scripts/build_wheels.sh" "$V" || fail "scripts/build_wheels.sh $V"
  WHEEL="$(ls "$WT"/dist/xccl_rs-"$V".*.whl | head -1)"
fi
NAME="$(basename "$WHEEL")"
V="$(echo "$NAME" | sed -E 's/^xccl_rs-([0-9]+\.[0-9]+)\..*/\1/')"
step "testing $NAME (torch $V)"

# --- A PATH without a toolchain: a directory of links to what the steps need, and nothing else.
NOTC="$WT/path-without-toolchain"
rm -rf "$NOTC" && mkdir -p "$NOTC"
for tool in bash sh env cat ls rm mkdir cp mv ln dirname basename readlink realpath uname sleep true \
            false grep sed awk tail head wc sort tr cut find xargs touch chmod date mktemp tee id \
            hostname nproc ps kill timeout getconf; do
  if path="$(command -v "$tool")"; then ln -s "$path" "$NOTC/$tool"; fi
done
BASE_PY="$(python3 -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
ln -s "$BASE_PY" "$NOTC/python3"
for tool in cargo rustc cc c++ gcc g++ ld as; do
  [ ! -e "$NOTC/$tool" ] || fail "$tool in $NOTC"
done

VENV="$WT/venv"
# Runs a command with the fresh venv first on a PATH that has no toolchain (what a user with
# the venv activated and no compilers has); the rest of the environment stays.
bare() { env -u CARGO -u RUSTC -u CC -u CXX -u CARGO_TARGET_DIR PATH="$VENV/bin:$NOTC" VIRTUAL_ENV="$VENV" "$@"; }

step "a fresh venv at $VENV, PATH without cargo, rustc, cc, c++, gcc, g++"
rm -rf "$VENV" "$WT"/venv.deleting.*
logged venv bare python3 -m venv "$VENV"
bare python -c '
import shutil, sys
found = {t: shutil.which(t) for t in ("cargo", "rustc", "cc", "c++", "gcc", "g++", "ld", "as")}
assert not any(found.values()), f"a toolchain is on PATH: {found}"
print("no toolchain on PATH:", ", ".join(found))
' || fail "the PATH of the test has a toolchain"

# torch and the test tools come from PyPI through a wheelhouse of this script's: pip's own HTTP
# cache keeps nothing here, and a second run then installs from files (about a minute, not 2 to
# 3). pip download fetches only what the wheelhouse lacks; the wheelhouse holds about 3 GB per
# torch (delete $WT/wheelhouse to reclaim it).
WH="$WT/wheelhouse"
mkdir -p "$WH"
step "pip download into $WH what it lacks of $NAME's requirements (torch $V from PyPI: 3 GB the first time) and the test tools"
logged download bare python -m pip download --progress-bar off --only-binary :all: -d "$WH" "$WHEEL" pytest numpy hypothesis
rm -f "$WH"/xccl_rs-*.whl
step "pip install $NAME with torch $V, pytest, numpy, hypothesis (binary wheels only, from the wheelhouse)"
logged install bare python -m pip install --progress-bar off --only-binary :all: --no-index --find-links "$WH" \
  "$WHEEL" pytest numpy hypothesis
grep -E "^Successfully installed" "$WT/install.log" | tr ' ' '\n' | grep -E "^(torch|xccl[-_]rs|tqdm)-" | sed 's/^/   /'
bare python - "$V" <<'EOF' || fail "the installed package"
import importlib.metadata as md, os, sys, torch, xccl_rs
want = sys.argv[1]
assert torch.__version__.startswith(want + "."), (torch.__version__, want)
assert xccl_rs.torch_version_built == want, xccl_rs.torch_version_built
site = os.path.dirname(os.path.dirname(torch.__file__))
assert xccl_rs.__file__.startswith(site), f"xccl_rs from {xccl_rs.__file__}, not the venv's {site}"
print(f"   xccl_rs {md.version('xccl_rs')} (xccl_rs {xccl_rs.__version__} for torch {xccl_rs.torch_version_built}) in torch {torch.__version__}")
EOF

step "smoke suite (pytest python_tests -m smoke) on the wheel"
(cd "$ROOT" && logged smoke bare python -X faulthandler -m pytest python_tests -m smoke -q -p no:cacheprovider)
grep -E "passed|failed" "$WT/smoke.log" | tail -1 | sed 's/^/   /'

step "demo, short form (python -m xccl_rs.demo --rounds 2 --layers 1)"
(cd / && logged demo bare python -m xccl_rs.demo --rounds 2 --layers 1 --no-progress)
tail -n 4 "$WT/demo.log" | sed 's/^/   /'

# --- 2. Another torch refuses the wheel, before loading its extension, naming both versions.
# The other torch's Python, used read only: the main venv's if it has that torch (the test
# command's, torch 2.15 in CI), else the matrix's venv, made if missing.
OTHER_PY="$CACHE/matrix/torch-$OTHER/venv/bin/python"
if [ "$(PYTHONWARNINGS=ignore "$CACHE/venv/bin/python" -c 'import torch; print(".".join(torch.__version__.split(".")[:2]))' 2>/dev/null)" = "$OTHER" ]; then
  OTHER_PY="$CACHE/venv/bin/python"
fi
if [ ! -x "$OTHER_PY" ]; then
  step "the torch $OTHER venv of the matrix (scripts/torch_matrix.sh --prefetch $OTHER; about 90 s)"
  logged prefetch "$ROOT/scripts/torch_matrix.sh" --prefetch "$OTHER"
fi
step "the wheel's package on the path of torch $OTHER ($OTHER_PY): the import must refuse it"
rm -rf "$WT/other"
mkdir -p "$WT/other"
bare python -m zipfile -e "$WHEEL" "$WT/other"
set +e
(cd / && PYTHONPATH="$WT/other" PYTHONWARNINGS=ignore "$OTHER_PY" -c 'import xccl_rs') >"$WT/other.log" 2>&1
rc=$?
set -e
said="$(grep -E '^ImportError' "$WT/other.log" | tail -1)"
echo "   $said"
[ "$rc" -ne 0 ] || fail "torch $OTHER imported the torch $V wheel"
case "$said" in
  "ImportError: xccl_rs was compiled against torch $V "*"but is being loaded into torch $OTHER "*) ;;
  *) cat "$WT/other.log" >&2; fail "torch $OTHER's error does not name torch $V and torch $OTHER" ;;
esac

# --- 3. The C++ package of the wheel: CMake and g++, no Rust.
CXXBIN="$WT/path-cxx"
rm -rf "$CXXBIN" && mkdir -p "$CXXBIN"
for tool in c++ g++ gcc cc ld as ar ranlib; do
  if path="$(command -v "$tool")"; then ln -s "$path" "$CXXBIN/$tool"; fi
done
cxx() { env -u CARGO -u RUSTC PATH="$VENV/bin:$CXXBIN:$NOTC" VIRTUAL_ENV="$VENV" "$@"; }
step "the C++ package in the wheel: examples/cpp through find_package(xccl_rs), CMake and g++, no Rust"
logged cmake-install bare python -m pip install --progress-bar off --only-binary :all: cmake ninja
cxx python -c 'import shutil; assert shutil.which("cargo") is None and shutil.which("rustc") is None and shutil.which("g++")' \
  || fail "the C++ step's PATH"
SITE="$(bare python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
EX="$WT/example"
rm -rf "$EX"
logged cmake-configure cxx cmake -S "$ROOT/examples/cpp" -B "$EX" -G Ninja -DCMAKE_PREFIX_PATH="$SITE"
logged cmake-build cxx cmake --build "$EX"
# Rank 0 serves the store on port 0 and prints the port; rank 1 joins it.
exe="$EX/allreduce_avg"
"$exe" 0 2 0 >"$WT/rank0.log" 2>&1 &
r0=$!
port=
for _ in $(seq 1 300); do
  port="$(sed -n 's/^port \([0-9]*\)$/\1/p' "$WT/rank0.log" | head -1)"
  [ -n "$port" ] && break
  kill -0 "$r0" 2>/dev/null || break
  sleep 0.2
done
[ -n "$port" ] || { kill "$r0" 2>/dev/null; cat "$WT/rank0.log" >&2; fail "rank 0 of the example printed no port"; }
set +e
timeout 120 "$exe" 1 2 "$port" >"$WT/rank1.log" 2>&1
rc1=$?
wait "$r0"
rc0=$?
set -e
for r in 0 1; do
  grep -q "rank $r: AVG all_reduce of 1001 floats over 2 ranks is right" "$WT/rank$r.log" \
    || { cat "$WT/rank0.log" "$WT/rank1.log" >&2; fail "the example's rank $r (exit codes $rc0, $rc1)"; }
done
[ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ] || fail "the example's exit codes: $rc0, $rc1"
echo "   2 ranks: $(grep -h "is right" "$WT/rank0.log" "$WT/rank1.log" | tr '\n' ' ')"
# find_package with the other torch's Python: refused, naming both.
set +e
cxx cmake -S "$ROOT/examples/cpp" -B "$WT/example-other" -G Ninja -DCMAKE_PREFIX_PATH="$SITE" \
  -DXCCL_RS_PYTHON="$OTHER_PY" >"$WT/cmake-other.log" 2>&1
rc=$?
set -e
said="$(tr -s ' \n' ' ' <"$WT/cmake-other.log")"
[ "$rc" -ne 0 ] || fail "find_package(xccl_rs) accepted torch $OTHER"
case "$said" in
  *"xccl_rs was built against torch $V, but $OTHER_PY has torch $OTHER"*) echo "   find_package with torch $OTHER: refused, naming torch $V and torch $OTHER" ;;
  *) cat "$WT/cmake-other.log" >&2; fail "find_package's refusal does not name both torches" ;;
esac
rm -rf "$WT/example-other"

# The venv goes (5.5 GB; deleting it takes a minute or two on a busy disk): in the background.
mv "$VENV" "$WT/venv.deleting.$$"
(setsid nohup rm -rf "$WT/venv.deleting.$$" >/dev/null 2>&1 &)
step "PASS: $NAME installs and works without a toolchain (the fresh venv is being deleted in the background)"
