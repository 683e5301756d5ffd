#!/usr/bin/env bash
# On the GPU machine (no Rust, no network): compiles the C++ bridge against the torch of
# python3 there and links it with the Rust core that scripts/gpu/prepare.sh built, into
# python/xccl_rs/_C<suffix>.so. Then `PYTHONPATH=python python3 -c "import xccl_rs"` works.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
cd "$ROOT"
[ -f .gpu/libxccl_rs.a ] || { echo "run scripts/gpu/prepare.sh first (and carry .gpu)" >&2; exit 1; }
# The C++ flags come from the one description of them (python/xccl_rs/torch_build_flags.py).
declare -A T
while IFS=$'\t' read -r key values; do T[$key]="$values"; done < <("$PY" python/xccl_rs/torch_build_flags.py)
IFS=$'\t' read -r -a TORCH_FLAGS <<<"${T[cxx_flags]}"
IFS=$'\t' read -r -a TORCH_INCLUDES <<<"${T[include_dirs]}"
TORCH_LIB="${T[library_dir]}"
FLAGS=(-O2 -fPIC -fvisibility=hidden -DTORCH_EXTENSION_NAME=_C "${TORCH_FLAGS[@]}"
       -Iinclude -Icsrc/include -I.gpu/include "${TORCH_INCLUDES[@]/#/-I}" -I"${T[python_include]}")
mkdir -p .gpu/obj
pids=()
for src in csrc/*.cc .gpu/ffi.rs.cc; do
  g++ "${FLAGS[@]}" -c "$src" -o ".gpu/obj/$(basename "$src").o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
IFS=$'\t' read -r -a TORCH_LIBS <<<"${T[libraries]}"
g++ -shared -o "python/xccl_rs/_C${T[ext_suffix]}" .gpu/obj/*.o \
  -Wl,--whole-archive .gpu/libxccl_rs.a -Wl,--no-whole-archive \
  -L"$TORCH_LIB" "${TORCH_LIBS[@]/#/-l}" -Wl,-rpath,"$TORCH_LIB" -lpthread -ldl -lm
PYTHONPATH="$ROOT/python" "$PY" -c "import xccl_rs, torch; print('xccl_rs built against torch', xccl_rs.torch_version_built, 'loaded in', torch.__version__)"
