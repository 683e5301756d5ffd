#!/usr/bin/env bash
# On the GPU machine (no Rust, no network): compiles the C++ bridge against the torch of
# python3 there and links it with the Rust core that scripts/gpu/prepare.sh built, into
# python/xccl_rs/_C<suffix>.so. Then `PYTHONPATH=python python3 -c "import xccl_rs"` works.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
[ -f .gpu/libxccl_rs.a ] || { echo "run scripts/gpu/prepare.sh first (and carry .gpu)" >&2; exit 1; }
read -r TORCH_DIR ABI PYINC SUFFIX < <("$PY" - <<'PY'
import os, sysconfig, torch
print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI),
      sysconfig.get_paths()["include"], sysconfig.get_config_var("EXT_SUFFIX"))
PY
)
FLAGS=(-O2 -fPIC -std=c++20 -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DTORCH_EXTENSION_NAME=_C
       -Icsrc/include -I.gpu/include -I"$TORCH_DIR/include" -I"$TORCH_DIR/include/torch/csrc/api/include" -I"$PYINC")
mkdir -p .gpu/obj
pids=()
for src in csrc/*.cc .gpu/ffi.rs.cc; do
  g++ "${FLAGS[@]}" -c "$src" -o ".gpu/obj/$(basename "$src").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
g++ -shared -o "python/xccl_rs/_C$SUFFIX" .gpu/obj/*.o \
  -Wl,--whole-archive .gpu/libxccl_rs.a -Wl,--no-whole-archive \
  -L"$TORCH_DIR/lib" -lc10 -ltorch_cpu -ltorch -ltorch_python -Wl,-rpath,"$TORCH_DIR/lib" -lpthread -ldl -lm
PYTHONPATH="$ROOT/python" "$PY" -c "import xccl_rs, torch; print('xccl_rs built against torch', xccl_rs.torch_version_built, 'loaded in', torch.__version__)"
