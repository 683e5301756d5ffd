#!/usr/bin/env bash
# Sourced by run.sh on the GPU machine (no network) when a bench asks for `--peer deepspeed`:
# installs the DeepSpeed wheels carried in .peers/deepspeed/wheels/ (a copy of
# ../shared/peers/deepspeed/, git-ignored) into a scratch folder and puts it on PYTHONPATH and
# PATH (ninja, for DeepSpeed's JIT build of its shm op). The fallback wheels go in only for the
# modules that machine lacks. Without the folder, the bench says DeepSpeed is missing and runs on.
PEER_WHEELS="$ROOT/.peers/deepspeed/wheels"
PEER_TARGET="${XCCL_RS_PEER_TARGET:-/tmp/xccl_rs-peer-deepspeed}"
if [ ! -d "$PEER_WHEELS" ]; then
  echo "peer_deepspeed.sh: no $PEER_WHEELS (copy ../shared/peers/deepspeed to .peers/ and carry .peers)"
  return 0
fi
peer_install() {  # pip where there is one, else unzip (a wheel is a zip file)
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-warn-script-location --target "$PEER_TARGET" "$@"
  else
    for w in "$@"; do python3 -m zipfile -e "$w" "$PEER_TARGET" || return 1; done
  fi
}
rm -rf "$PEER_TARGET" && mkdir -p "$PEER_TARGET"
peer_install "$PEER_WHEELS"/*.whl || echo "peer_deepspeed.sh: installing the wheels failed"
missing=()
for pair in einops:einops cpuinfo:py_cpuinfo msgpack:msgpack psutil:psutil packaging:packaging tqdm:tqdm; do
  python3 -c "import ${pair%%:*}" 2>/dev/null || missing+=("$(ls "$PEER_WHEELS"/fallback/"${pair##*:}"-*.whl)")
done
command -v ninja >/dev/null 2>&1 || missing+=("$(ls "$PEER_WHEELS"/fallback/ninja-*.whl)")
[ ${#missing[@]} -gt 0 ] && peer_install "${missing[@]}"
for s in "$PEER_TARGET"/*.data/scripts/*; do [ -f "$s" ] && mkdir -p "$PEER_TARGET/bin" && cp "$s" "$PEER_TARGET/bin/" && chmod +x "$PEER_TARGET/bin/${s##*/}"; done
export PYTHONPATH="$PYTHONPATH:$PEER_TARGET" PATH="$PATH:$PEER_TARGET/bin"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-/tmp/xccl_rs-peer-ext}"
# DeepSpeed's segments are never unlinked by it (the bench unlinks them); a killed run's stay
trap 'rm -f /dev/shm/deepspeed_allreduce_buffer_$(id -u)_127.0.0.1_* 2>/dev/null' EXIT
