#!/usr/bin/env bash
# Configures and builds Tessera into ./build (Release, warnings as errors, the
# CUDA backend when nvcc exists). `--target NAME` (repeatable) builds only
# those targets (e.g. tessera_cli, the `tessera` program); other arguments go
# to CMake, e.g.
#   scripts/build.sh -DTESSERA_CUDA=OFF
#   scripts/build.sh --target tessera_cli
set -euo pipefail
cd "$(dirname "$0")/.."
configure=() targets=()
while (($#)); do
  if [[ $1 == --target ]]; then
    (($# >= 2)) || { echo "build.sh: --target needs a target name (e.g. tessera_cli)" >&2; exit 2; }
    targets+=(--target "$2")
    shift 2
  else
    configure+=("$1")
    shift
  fi
done
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTESSERA_WERROR=ON "${configure[@]}" >build-configure.log 2>&1 || {
  cat build-configure.log >&2; exit 1; }
grep -E '^-- Tessera' build-configure.log || true
cmake --build build --parallel "$(nproc)" "${targets[@]}"
