#!/usr/bin/env bash
# Here (the machine with Rust): builds what the GPU machine cannot, into .gpu/ (git-ignored,
# carried by the device tool): the Rust core as a static library, and the cxx bridge's
# generated C++ (header, glue source, rust/cxx.h). No torch is compiled against here; the GPU
# machine compiles csrc/ against its own torch (scripts/gpu/build.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
OUT="$ROOT/.gpu"
# Its own target directory: the export build's environment differs from the normal one's.
export CARGO_TARGET_DIR="$CACHE/target-gpu"
rm -rf "$OUT"
mkdir -p "$OUT"
cd "$ROOT"
# build.rs writes the generated C++ to a fixed place when it runs (cargo reruns it when its
# inputs change or a copy there is missing, so the files are copied from there).
EXPORT="$CARGO_TARGET_DIR/bridge-export"
XCCL_RS_BRIDGE_EXPORT="$EXPORT" cargo rustc --release --quiet --lib --features bridge --crate-type staticlib
cp -r "$EXPORT/." "$OUT/"
cp "$CARGO_TARGET_DIR/release/libxccl_rs.a" "$OUT/"
strip --strip-debug "$OUT/libxccl_rs.a"
echo "prepared $OUT ($(du -sh "$OUT" | cut -f1))"
