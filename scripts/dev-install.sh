#!/usr/bin/env bash
# Developer loop: rebuild the extension with cargo and copy it (and the Python sources) into the
# cached virtual environment's installed package. Run scripts/setup.sh once first.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${XCCL_RS_CACHE:-$HOME/.cache/xccl_rs}"
PY="$CACHE/venv/bin/python"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
cd "$ROOT"
XCCL_RS_PYTHON="$PY" cargo build --release --features bridge
PKG="$("$PY" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("xccl_rs").origin))')"
SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
# A new file renamed over the old one: processes that have the old one loaded keep its pages.
cp "$CARGO_TARGET_DIR/release/libxccl_rs.so" "$PKG/_C$SUFFIX.new" && mv -f "$PKG/_C$SUFFIX.new" "$PKG/_C$SUFFIX"
# The Python sources, subpackages too; not the source tree's _build_info.py, which describes
# the last build made there (perhaps against another torch), nor any extension left there.
(cd python && tar cf - --exclude=_build_info.py --exclude='*.so' --exclude=__pycache__ xccl_rs) | tar xf - -C "$PKG/.."
echo "installed into $PKG"
