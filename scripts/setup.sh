#!/usr/bin/env bash
# Prepares everything xccl_rs needs on a fresh machine, idempotently, outside the clone:
# a Python virtual environment with torch (from PyPI) and the build tools, and xccl_rs built
# against that torch and installed into it. Build products live in the cache too, so repeated
# runs only rebuild what changed.
#
#   XCCL_RS_CACHE   where the venv and the cargo target directory live (default ~/.cache/xccl_rs)
#   XCCL_RS_TORCH   the torch requirement to install (default "torch", the newest on PyPI)
#   XCCL_RS_SETUP_TORCH_ONLY=1   only the venv and torch
#
# Source it (`. scripts/setup.sh`): it exports PY (the venv's python) and CARGO_TARGET_DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
VENV="$CACHE/venv"
export CARGO_TARGET_DIR="$CACHE/target"
mkdir -p "$CACHE"

# libfabric for the OFI transport's tests (XCCL_RS_TRANSPORT=ofi, tests/ofi.rs, python_tests/
# test_ofi.py): loaded at run time, never needed to build. As root we install Debian's package;
# elsewhere the tests skip, saying why.
if ! ldconfig -p 2>/dev/null | grep -q 'libfabric\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing libfabric1 (Debian) for the OFI transport's tests"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfabric1; } >/dev/null 2>&1 \
      || echo "!! could not install libfabric1: the OFI tests will fail (they require it as root)" >&2
  else
    echo "== libfabric.so.1 not found and not root: the OFI transport's tests will skip"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PY="$VENV/bin/python"
export PY

# pip's progress bars where someone watches (a terminal); plain lines, one per package, in logs.
if [ -t 1 ]; then PIP_PROGRESS=(); else PIP_PROGRESS=(--progress-bar off); fi

# Prints "   ... $1 (N s)" every 30 s until killed (kill "$!"): a long silent step is not a hang.
heartbeat() {
  local start=$SECONDS pid=
  trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; exit 0' TERM
  while :; do
    sleep 30 & pid=$!
    wait "$pid"
    echo "   ... $1 ($((SECONDS - start)) s)"
  done
}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing ${XCCL_RS_TORCH:-torch} from PyPI (about 3 GB to download; the venv then takes about 5.5 GB; a minute or two)"
  "$PY" -m pip install "${PIP_PROGRESS[@]}" "${XCCL_RS_TORCH:-torch}"
fi
# XCCL_RS_SETUP_TORCH_ONLY=1: stop here (scripts/torch_matrix.sh --prefetch).
if [ "${XCCL_RS_SETUP_TORCH_ONLY:-0}" = 1 ]; then
  return 0 2>/dev/null || exit 0
fi
# Build tools (setuptools-rust for the extension; cmake and ninja for the C++ package's test and
# the emulated XPU device of the tests), the package's one dependency besides torch (tqdm), and
# the test tools (pytest, hypothesis, numpy: the tests use numpy, xccl_rs does not; expecttest: torch's test harness).
"$PY" -m pip install -q "setuptools>=68" "setuptools-rust>=1.9" wheel tqdm pytest hypothesis numpy cmake ninja expecttest

echo "== building xccl_rs against torch $("$PY" -c 'import torch; print(torch.__version__)') (about 3 minutes on 2 cores from scratch; seconds when nothing changed)"
# --no-build-isolation: the extension must be compiled against the torch installed here.
heartbeat "building" &
heartbeat_pid=$!
(cd "$ROOT" && XCCL_RS_PYTHON="$PY" "$PY" -m pip install -q --no-build-isolation --no-deps . 2>&1 \
  | grep -v -E "BuildBackendWarning|^\s*$|\*{10}|corresp\(|!!" || true)
kill "$heartbeat_pid" 2>/dev/null || true
wait "$heartbeat_pid" 2>/dev/null || true
"$PY" -c "import xccl_rs, torch.distributed as dist; assert 'xccl_rs' in dist.Backend.backend_list" \
  || { echo "xccl_rs did not install correctly" >&2; exit 1; }
